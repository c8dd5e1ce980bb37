"""Building the Accelerator so that multi-process CPU runs cannot silently train alone.

On a machine without CUDA, `accelerate launch` with a two-process config starts
two processes through torchrun, but a plain ``Accelerator()`` in each of them
sees ``DistributedType.NO`` and ``num_processes == 1``: two independent
trainings and no error (measured with accelerate 1.15, torch 2.13). ``Accelerator(cpu=True)``
makes them join one gloo process group instead. :func:`build_accelerator` passes
``cpu=True`` whenever the launcher started several processes and no GPU is
present, then :func:`check_process_count` compares the launcher's ``WORLD_SIZE``
with what the Accelerator sees and fails loudly on a mismatch.

It also passes ``--ddp_timeout`` to the process group, and, when torch elastic
may restart the workers (``accelerate launch --max_restarts N``), forms the
gloo group itself so that a restarted attempt does not read the previous
attempt's keys (see :func:`init_restartable_process_group`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import (DistributedDataParallelKwargs, GradientAccumulationPlugin, InitProcessGroupKwargs,
                               get_int_from_env)

from . import checks
from .errors import ProcessCountError
# The default-K rule lives in the torch-free settings module (``accum-kit plan`` uses it too);
# re-exported here for callers of ``accum_kit.launch.resolve_accumulation_steps``.
from .core.settings import DEFAULT_GRADIENT_ACCUMULATION_STEPS, resolve_accumulation_steps  # noqa: F401


def launcher_world_size() -> int:
    """Number of processes the launcher (torchrun, accelerate launch, mpirun) started; 1 if none.

    Reads the same variables as Accelerate's own state (``WORLD_SIZE`` and the MPI ones).
    """
    return get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1)


def _has_gpu() -> bool:
    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "is_available"):
        return bool(accel.is_available())
    return torch.cuda.is_available()


def check_process_count(accelerator: Accelerator, expected: int | None = None) -> None:
    """Fail loudly when the Accelerator does not see every launched process.

    Args:
        accelerator: a constructed Accelerator.
        expected: the number of processes that should train together; defaults
            to the launcher's ``WORLD_SIZE`` environment variable (1 if unset).

    Raises:
        ProcessCountError: ``accelerator.num_processes != expected``.
    """
    expected = launcher_world_size() if expected is None else expected
    if accelerator.num_processes != expected:
        raise ProcessCountError(
            f"the launcher started {expected} processes but the Accelerator sees "
            f"{accelerator.num_processes} (distributed_type={accelerator.distributed_type}): "
            "each process would train alone on its own data. On a machine without a GPU "
            "build the Accelerator with accum_kit.build_accelerator() or Accelerator(cpu=True), "
            "or set ACCELERATE_USE_CPU=true."
        )


def elastic_restarts_possible() -> bool:
    """True when torch elastic may restart this worker and the workers use the agent's store.

    Reads the variables torchrun sets for every worker: ``TORCHELASTIC_MAX_RESTARTS``
    (``accelerate launch --max_restarts``) and ``TORCHELASTIC_USE_AGENT_STORE``
    (True for the static and the c10d rendezvous unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).
    """
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return restarts.isdigit() and int(restarts) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def init_restartable_process_group(timeout: timedelta | None = None, backend: str = "gloo") -> bool:
    """Form the default process group in a namespace of its own for this restart attempt.

    Why: under torchrun every worker's ``init_process_group`` connects, as a
    client, to the TCPStore that the launcher's agent hosts at
    ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``), and
    publishes its keys (among them each rank's gloo listening address) under
    the same fixed prefix in every attempt. The agent and its store outlive the
    workers, so after a restart the previous attempt's keys are still there: a
    restarted worker that reads a peer's address before the restarted peer has
    overwritten it gets the dead process's address, and gloo dials a port
    nobody listens on. It is a race, so the symptom varies (measured, torch
    2.13, 2 CPU processes, one killed in attempt 0): with ``--rdzv_backend
    c10d`` attempt 1 died at once with "Gloo connectFullMesh failed ...
    Connection refused"; with the default static rendezvous one restart hung
    for over 120 s and another happened to succeed. The same store sharing is
    behind pytorch/pytorch#135712. Prefixing every key with
    ``TORCHELASTIC_RESTART_COUNT`` gives each attempt a fresh namespace in the
    same store, so a read waits for the live peer's key; all workers of an
    attempt agree on the number because the agent restarts its whole worker
    group at once and sets the count for each (verified: 4 of 4 restarts
    formed a group and finished, static and c10d rendezvous).
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` with the c10d rendezvous also
    works: a new store on a new port per round; it needs the variable in the
    launcher's environment.)

    Launch: ``accelerate launch --config_file accelerate_configs/cpu_ddp.yaml
    --max_restarts 1 -m accum_kit train ...`` (the default static rendezvous is
    enough). The flag must be on the command line: accelerate 1.15 refuses a
    ``max_restarts`` key in a config file.

    Limits: each agent counts its own restarts. On several nodes whose agents
    restart together (fixed ``--nnodes N``) the counts agree; a node that joins
    an elastic job later counts from 0 and would wait for peers until ``timeout``.

    Args:
        timeout: the process group's timeout (every collective and the
            initial rendezvous); None: torch's default (30 min).
        backend: ``"gloo"`` (CPU). GPU backends are not handled here.

    Returns:
        True if it formed the group; False when no restart is possible
        (:func:`elastic_restarts_possible`) or a group already exists.
    """
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    if dist.is_initialized() or not elastic_restarts_possible():
        return False
    timeout = timeout or default_pg_timeout
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"accum_kit/attempt{attempt}/", agent_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return True


def _with_timeout(handlers: list, seconds: float | None) -> tuple[list, timedelta | None]:
    """``handlers`` with ``InitProcessGroupKwargs(timeout=seconds)`` (the user's own one updated, not duplicated)."""
    own = next((h for h in handlers if isinstance(h, InitProcessGroupKwargs)), None)
    if seconds is None:
        return handlers, own.timeout if own is not None else None
    checks.positive("--ddp_timeout", seconds, fix="pass the seconds a collective may wait for all processes, e.g. 1800")
    timeout = timedelta(seconds=seconds)
    if own is None:
        return [*handlers, InitProcessGroupKwargs(timeout=timeout)], timeout
    return [dataclasses.replace(h, timeout=timeout) if h is own else h for h in handlers], timeout


def _with_ddp_kwargs(handlers: list, ddp_kwargs: dict | None) -> list:
    """``handlers`` with ``DistributedDataParallelKwargs(**ddp_kwargs)`` (the user's own one updated, not duplicated)."""
    if not ddp_kwargs:
        return handlers
    own = next((h for h in handlers if isinstance(h, DistributedDataParallelKwargs)), None)
    if own is None:
        return [*handlers, DistributedDataParallelKwargs(**ddp_kwargs)]
    return [dataclasses.replace(h, **ddp_kwargs) if h is own else h for h in handlers]


def build_accelerator(
    gradient_accumulation_steps: int | None = None,
    *,
    sync_each_batch: bool = False,
    accumulation_policy: str | None = None,
    cpu: bool | None = None,
    ddp_timeout: float | None = None,
    ddp_kwargs: dict | None = None,
    torch_compile: bool = False,
    torch_compile_backend: str | None = None,
    torch_compile_mode: str | None = None,
    torch_compile_dynamic: bool | None = None,
    max_grad_norm: float | None = None,
    accumulation_schedule: dict | None = None,
    gradient_checkpointing: bool = False,
    gradient_checkpointing_kwargs: dict | str | None = None,
    **accelerator_kwargs,
) -> Accelerator:
    """Build an Accelerator for gradient accumulation that is safe on CPU-only machines, with DDP or FSDP2.

    Args:
        gradient_accumulation_steps: micro-batches per optimizer step (K); None
            reads ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` or uses 4
            (see :func:`resolve_accumulation_steps`).
        sync_each_batch: all-reduce gradients on every micro-batch instead of
            only on the window's boundary (Accelerate's ``GradientAccumulationPlugin``
            option of the same name); the same as ``accumulation_policy="sync_each_batch"``.
        accumulation_policy: one of :data:`accum_kit.engines.policies.POLICIES`
            (``no_sync``, the default; ``sync_each_batch``; under FSDP2 also
            ``no_sync_no_reshard_after_backward`` and ``no_sync_no_reshard``;
            under HSDP also ``reduce_scatter_each_batch``), see :mod:`accum_kit.engines.policies`.
        cpu: force CPU; None means "CPU when several processes were launched
            and no GPU exists", which is what makes gloo DDP work.
        ddp_timeout: seconds any collective (and the initial rendezvous) may
            wait for every process before it raises, as the Trainer's
            ``ddp_timeout``; passed as ``InitProcessGroupKwargs(timeout=...)``
            (replacing the timeout of one given in ``kwargs_handlers``). None:
            Accelerate's default (1800 s on CPU). gloo honours it for
            ``all_reduce``, ``barrier`` and DDP's gradient all-reduce (measured,
            torch 2.13: "Timed out waiting 5000ms for recv operation").
        ddp_kwargs: DDP constructor settings by DDP's names (``bucket_cap_mb``,
            ``gradient_as_bucket_view``, ``static_graph``, ``find_unused_parameters``;
            see :func:`accum_kit.engines.ddp.ddp_kwargs`), passed as
            ``DistributedDataParallelKwargs`` (updating one given in ``kwargs_handlers``).
        torch_compile, torch_compile_backend, torch_compile_mode: compile the
            model in ``prepare`` (transformers' names; a backend or a mode
            implies ``torch_compile``, the backend defaults to ``inductor``)
            through Accelerate's ``TorchDynamoPlugin``: the whole model under
            DDP, per block under FSDP2; without them an accelerate config's
            ``dynamo_config`` is checked and used the same way (see
            :func:`accum_kit.engines.compiling.dynamo_plugin_for`).
        torch_compile_dynamic: ``torch.compile``'s ``dynamic`` (True: shapes
            are symbolic from the first call; None: torch's default).
        max_grad_norm: the run's gradient clipping (None: none), for engines that
            clip inside their own step (DeepSpeed: it becomes the config's
            ``gradient_clipping``). Optional: :func:`accum_kit.train_loop`'s
            ``max_grad_norm`` is enough under every engine (the loop sets it on
            such an engine); given here, it must equal the loop's.
        accumulation_schedule: batch-size warm-up ``{optimizer step: K}`` (an entry for
            step 0), checked once here and kept on the run plan; :func:`accum_kit.train_loop`
            follows it when it is given no schedule of its own.
        gradient_checkpointing: activation checkpointing, one checkpoint per transformer block, applied to
            the model inside ``accelerator.prepare`` (transformers' ``TrainingArguments`` name; docs/memory.md).
            Under FSDP2 it is Accelerate's ``fsdp_plugin.activation_checkpointing``, which a config's
            ``fsdp_activation_checkpointing: true`` also sets (the plan records either).
        gradient_checkpointing_kwargs: ``torch.utils.checkpoint.checkpoint`` arguments, a dict or its JSON
            string (default ``{"use_reentrant": False}``); kept on the plan as a dict.
        **accelerator_kwargs: passed to ``accelerate.Accelerator`` (e.g.
            ``mixed_precision``, ``log_with``, ``kwargs_handlers``, ``fsdp_plugin``,
            ``deepspeed_plugin``).

    The engine (DDP, FSDP2 or HSDP, DeepSpeed ZeRO) is picked once, from the
    launch (``accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml``
    sets ``ACCELERATE_USE_FSDP=true``, a DeepSpeed config ``ACCELERATE_USE_DEEPSPEED=true``,
    an HSDP one a ``parallelism_config``) or the plugins passed
    (:func:`accum_kit.engines.requested_engine`). It checks the request, fills
    its plugin from K, the policy and ``max_grad_norm``, and, on a machine
    without a GPU, switches Accelerate's state to itself after construction
    (Accelerate alone would train DDP there, or each process alone). The engine,
    K and the policy are kept on ``accelerator.run_plan``
    (:class:`accum_kit.core.run_plan.RunPlan`).

    In a multi-process CPU run that torch elastic may restart, the gloo group is
    formed by :func:`init_restartable_process_group` first (Accelerate reuses it);
    in every multi-process run a failed collective is described by one
    ``error: rank N: <collective> ...`` line
    (:func:`accum_kit.core.faults.install_collective_failure_hook`).

    Returns:
        The Accelerator, already checked with :func:`check_process_count`.

    Raises:
        UsageError: K below 1, ``ddp_timeout`` not a positive number, an
            unknown policy, an FSDP-only policy without FSDP, an HSDP-only policy
            without a replicate group, FSDP1, FSDP on CPU with one process,
            ``ddp_kwargs`` under FSDP, a parallelism config that cannot work
            (see :func:`accum_kit.engines.mesh.resolve_parallelism_config`), an unknown
            compile backend or mode, a backend whose compiler is missing, DDP
            buckets below 1 MB with compilation; under DeepSpeed: the package
            missing (naming the extra), a config contradicting K or ``max_grad_norm``,
            a policy other than ``no_sync``, DDP settings, FSDP, compilation, or one process on CPU;
            ``gradient_checkpointing_kwargs`` not a JSON object of checkpoint arguments, given without
            ``gradient_checkpointing``, or one the engine cannot apply
            (:meth:`accum_kit.engines.base.Engine.resolve_activation_checkpointing`).
        ProcessCountError: launched and visible process counts differ.
        TypeError: a ``ddp_kwargs`` key that ``DistributedDataParallelKwargs`` does not have.
    """
    from .core.faults import install_collective_failure_hook
    from .core.run_plan import RunPlan
    from .engines import requested_engine
    from .engines.accelerator import AccumulationAccelerator
    from .engines.policies import resolve_policy

    world = launcher_world_size()
    steps, policy = resolve_accumulation_steps(gradient_accumulation_steps), resolve_policy(accumulation_policy, sync_each_batch)
    engine = requested_engine(fsdp_plugin=accelerator_kwargs.get("fsdp_plugin"),
                              deepspeed_plugin=accelerator_kwargs.get("deepspeed_plugin"),
                              parallelism_config=accelerator_kwargs.pop("parallelism_config", None), world_size=world)
    if cpu is None:
        cpu = world > 1 and not _has_gpu()
    engine.check_request(policy, ddp_kwargs=ddp_kwargs, world_size=world, on_cpu=cpu or not _has_gpu(),
                         compile_requested=bool(torch_compile or torch_compile_backend or torch_compile_mode))
    checkpointing, checkpoint_kwargs = engine.resolve_activation_checkpointing(gradient_checkpointing,
                                                                              gradient_checkpointing_kwargs)
    plan = RunPlan(engine, policy, steps, accumulation_schedule, gradient_checkpointing=checkpointing,
                   gradient_checkpointing_kwargs=checkpoint_kwargs)
    accelerator_kwargs = engine.accelerator_kwargs(
        accelerator_kwargs, accumulation_steps=plan.first_accumulation_steps, policy=plan.requested_policy,
        max_grad_norm=max_grad_norm,
        mixed_precision=accelerator_kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION"))
    handlers, timeout = _with_timeout(list(accelerator_kwargs.pop("kwargs_handlers", None) or []), ddp_timeout)
    handlers = _with_ddp_kwargs(handlers, ddp_kwargs)
    _with_compilation(accelerator_kwargs, handlers, engine, torch_compile, torch_compile_backend, torch_compile_mode,
                      torch_compile_dynamic)
    if cpu and world > 1:
        init_restartable_process_group(timeout)
    gradients = GradientAccumulationPlugin(num_steps=plan.first_accumulation_steps,
                                           sync_each_batch=plan.requested_policy.sync_each_batch)
    tf32 = _matmul_tf32()
    with engine.constructing(cpu):
        accelerator = AccumulationAccelerator(cpu=cpu, gradient_accumulation_plugin=gradients,
                                              kwargs_handlers=handlers or None,
                                              parallelism_config=engine.parallelism_config(cpu), **accelerator_kwargs)
    _restore_matmul_tf32(tf32)
    plan.bind(accelerator)
    check_process_count(accelerator)
    engine.bind(accelerator, cpu)
    if accelerator.num_processes > 1:
        install_collective_failure_hook()
    return accelerator


def _matmul_tf32() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32)


def _restore_matmul_tf32(before: bool) -> None:
    """Put back the process's TF32 matmul setting if building the Accelerator changed it.

    Accelerate 1.15 turns ``torch.backends.cuda.matmul.allow_tf32`` on, process-wide, when it builds its state for
    a compiled run in fp32 on CUDA (``AcceleratorState.__init__``). TF32 rounds every matmul input to 10 mantissa
    bits: a compiled fp32 run (and everything after it in the process) then left the float64 trajectory by 20 to
    36 times the fp32 tolerance on an H200, while the same runs with the inputs rounded to TF32 by hand on CPU
    came out alike. The user's own setting (``torch.backends.cuda.matmul.allow_tf32 = True`` before building the
    Accelerator, or ``torch.set_float32_matmul_precision``) is kept.
    """
    if bool(torch.backends.cuda.matmul.allow_tf32) != before:
        torch.backends.cuda.matmul.allow_tf32 = before
        logging.getLogger(__name__).info("TF32 matmuls left %s as before the Accelerator (Accelerate switches them on for compiled fp32 "
                    "runs on CUDA)", "on" if before else "off")


def _with_compilation(accelerator_kwargs: dict, handlers: list, engine, torch_compile: bool, backend, mode,
                      dynamic) -> None:
    """Put the compile flags' ``TorchDynamoPlugin`` into ``accelerator_kwargs`` (unless one was given), per block
    under an engine that compiles that way, and check DDP's buckets against it."""
    if "dynamo_plugin" not in accelerator_kwargs and "dynamo_backend" not in accelerator_kwargs:
        from .engines.compiling import dynamo_plugin_for

        plugin = dynamo_plugin_for(torch_compile, backend, mode, per_block=engine.compile_per_block(), dynamic=dynamic)
        if plugin is not None:
            accelerator_kwargs["dynamo_plugin"] = plugin
    if accelerator_kwargs.get("dynamo_plugin") is not None:
        from .engines.compiling import check_ddp_buckets

        check_ddp_buckets(accelerator_kwargs["dynamo_plugin"], handlers)
