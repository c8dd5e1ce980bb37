"""The engine protocol: everything that differs between DDP, FSDP2 (HSDP) and DeepSpeed ZeRO, asked of one object.

An engine is what ``accelerator.prepare`` wraps the model in and what then
decides which collectives a micro-batch runs: DDP (and one process, its
degenerate case), FSDP2 (``fully_shard``; HSDP is its 2-D mesh) or
DeepSpeed's ZeRO engine. :func:`accum_kit.build_accelerator` picks the
engine once, from the launch and the plugins passed, and keeps it on the
run's :class:`accum_kit.core.run_plan.RunPlan` (``accelerator.run_plan.engine``);
the loop, the train job, the profiler, the bench and verify ask it instead of
testing which engine they run under. Accelerate's, torch's and DeepSpeed's
private attributes stay in :mod:`accum_kit.compat`; an engine calls them.

The base class is the plain data-parallel behaviour (one process or DDP):
gradients in ``.grad``, reduced on the window's boundary (or on every
micro-batch under ``sync_each_batch``), rescaled after the window, clipped by
``accelerator.clip_grad_norm_``. Each engine overrides what it does otherwise.
"""

from __future__ import annotations

import contextlib

from ..errors import UsageError
from .policies import AccumulationPolicy


def trainable_and_frozen(model) -> tuple[int, int]:
    """``(P_t, P_f)``: elements of ``model``'s parameters that require a gradient and of those that do not (a LoRA
    run's frozen weights), each parameter once (a tied weight is one parameter)."""
    trainable = frozen = 0
    for p in model.parameters():
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


class Engine:
    """One run's engine. Built before the Accelerator (from the request), bound to it after.

    Attributes:
        name: ``"ddp"``, ``"fsdp2"`` or ``"deepspeed"`` (the family: its module, bench part, tests).
        accelerator: the bound Accelerator (None until :meth:`bind`).

    Subclasses override the methods below; every method's docstring says what
    the loop or tool uses it for.
    """

    name = "base"
    #: the DDP constructor settings (``ddp_kwargs``) mean something under this engine
    takes_ddp_kwargs = False
    #: ``torch.compile`` is supported (exactness and no_sync checked) under this engine
    compiles = True

    def __init__(self):
        self.accelerator = None

    # ---- identity ----------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """How a person names the engine in messages and tables (``"DDP"``, ``"HSDP 2 x 2"``, ``"DeepSpeed ZeRO-2"``)."""
        return self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label}>"

    # ---- before the Accelerator --------------------------------------------------------------
    def check_request(self, policy: AccumulationPolicy, *, ddp_kwargs: dict | None, compile_requested: bool,
                      world_size: int, on_cpu: bool) -> None:
        """Refuse what this engine cannot run, before anything is built.

        Args:
            policy: the run's accumulation policy (see :mod:`accum_kit.engines.policies`).
            ddp_kwargs: DDP constructor settings asked for (DDP's names), or None.
            compile_requested: ``torch.compile`` was asked for.
            world_size: processes launched.
            on_cpu: the run trains on CPU (gloo).

        Raises:
            UsageError: naming the flag and the fix.
        """
        self.check_policy(policy)
        if ddp_kwargs and not self.takes_ddp_kwargs:
            from .ddp import flag_of

            raise UsageError(flag_of(next(iter(ddp_kwargs))), f"is a DDP setting and has no effect under {self.label}",
                             "drop it, or launch with a DDP config (accelerate_configs/cpu_ddp.yaml)")

    def check_policy(self, policy: AccumulationPolicy) -> None:
        """Refuse an accumulation policy this engine cannot apply (here: the FSDP2-only ones).

        Raises:
            UsageError (``--accumulation_policy``).
        """
        if policy.fsdp_only:
            raise UsageError("--accumulation_policy", f"{policy.name} needs FSDP2 (it acts on sharded parameters or "
                             f"gradients), but this run is {self.label}", "launch with an FSDP2 config "
                             "(accelerate_configs/cpu_fsdp.yaml, cpu_hsdp.yaml or their gpu_ twins), or use no_sync")

    def resolve_policy(self, name: str) -> AccumulationPolicy:
        """The policy called ``name`` under this engine, checked (:meth:`check_policy`).

        Raises:
            UsageError (``--accumulation_policy``): unknown, or not one this engine applies.
        """
        from .policies import resolve_policy

        policy = resolve_policy(name)
        self.check_policy(policy)
        return policy

    def accelerator_kwargs(self, kwargs: dict, *, accumulation_steps: int, policy: AccumulationPolicy,
                           max_grad_norm: float | None, mixed_precision: str | None) -> dict:
        """``Accelerator(**kwargs)``'s arguments with this engine's plugin filled in (returns ``kwargs``)."""
        return kwargs

    def parallelism_config(self, on_cpu: bool):
        """The ``parallelism_config`` to pass to the Accelerator's constructor (None: none)."""
        return None

    def constructing(self, on_cpu: bool):
        """A context the Accelerator's constructor runs in (an environment switch some engines need)."""
        return contextlib.nullcontext()

    def run_policy(self, policy: AccumulationPolicy) -> AccumulationPolicy:
        """The policy as the run records it (DeepSpeed: the ZeRO stage, ``zero2``...)."""
        return policy

    def compile_per_block(self) -> bool:
        """Whether ``torch.compile`` applies per transformer block (FSDP2) rather than to the whole model."""
        return False

    def resolve_activation_checkpointing(self, enabled: bool, kwargs) -> tuple[bool, dict]:
        """``(on, torch.utils.checkpoint arguments in force)`` for ``--gradient_checkpointing`` and its kwargs
        (:func:`accum_kit.engines.activation_checkpointing.resolve_checkpointing`; non-reentrant by default).

        Raises:
            UsageError: bad or orphaned ``--gradient_checkpointing_kwargs``.
        """
        from .activation_checkpointing import resolve_checkpointing

        return resolve_checkpointing(enabled, kwargs)

    # ---- binding -----------------------------------------------------------------------------
    def bind(self, accelerator, on_cpu: bool) -> "Engine":
        """Attach to the built Accelerator; switch Accelerate's state to this engine where it would not (CPU)."""
        self.accelerator = accelerator
        return self

    # ---- prepare ----------------------------------------------------------------------------
    def before_prepare(self, accelerator, objects: tuple) -> None:
        """Check the objects handed to ``accelerator.prepare`` against the engine's config (no-op by default)."""

    def preparing(self, accelerator):
        """A context around Accelerate's own ``prepare`` (none by default)."""
        return contextlib.nullcontext()

    def apply_activation_checkpointing(self, accelerator, model):
        """``model`` with one checkpoint per transformer block, before ``prepare`` wraps it (the run plan's
        ``gradient_checkpointing_kwargs``; :func:`accum_kit.engines.activation_checkpointing.apply_to_model`).

        Raises:
            UsageError (``--gradient_checkpointing``): no transformer block found in ``model``.
        """
        from .activation_checkpointing import apply_to_model

        return apply_to_model(model, accelerator.run_plan.gradient_checkpointing_kwargs)

    def after_prepare(self, accelerator, objects: tuple, prepared: list) -> list:
        """What ``prepare`` returns, made to keep Accelerate's contract under this engine (identity by default)."""
        return prepared

    # ---- the window --------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, accelerator, model, policy: AccumulationPolicy, base_no_sync):
        """Inside a non-boundary micro-batch: ``base_no_sync(model)`` (Accelerate's), plus the policy's switches.

        Args:
            accelerator, model: the run's.
            policy: the policy in force.
            base_no_sync: ``Accelerator.no_sync`` bound to the accelerator (a context manager factory).
        """
        with base_no_sync(model):
            yield

    def backward(self, accelerator, loss, base_backward, **kwargs):
        """``accelerator.backward(loss, **kwargs)``: ``base_backward`` (Accelerate's) on ``loss``, which an engine may
        complete first for a model with per-module experts (DDP, DeepSpeed:
        :func:`accum_kit.engines.moe.with_zero_gradients`, so that a parameter the forward did not reach still gets a
        gradient where the backward reduces) or check after (DDP: every parameter reduced). Here: ``loss`` as it is."""
        return base_backward(loss, **kwargs)

    def reduces_each_micro_batch(self, accelerator, policy: AccumulationPolicy) -> bool:
        """Whether every micro-batch's backward reduces gradients (``LoopState.sync`` inside a window)."""
        return accelerator.num_processes > 1 and policy.sync_each_batch

    def data_parallel_size(self, accelerator) -> int:
        """Processes that read different examples from the dataloader: all of them here (tp and cp ranks share theirs)."""
        return accelerator.num_processes

    def token_ranks(self, accelerator):
        """The ranks holding different tokens (:class:`accum_kit.core.token_ranks.TokenRanks`): every process here."""
        from ..core.token_ranks import TokenRanks

        return TokenRanks(accelerator)

    def window_normalizer(self, accelerator, mode: str, loss_fn):
        """The loop's :class:`accum_kit.core.loss.WindowNormalizer` for ``mode`` (``tokens`` or ``mean``)."""
        from ..core.loss import WindowNormalizer

        return WindowNormalizer(accelerator, mode)

    def check_schedule(self, schedule: dict | None) -> None:
        """Refuse an accumulation schedule (``{step: K}``) the engine cannot follow (any is fine by default)."""

    def loop_callbacks(self, accelerator, model) -> list:
        """Loop callbacks this engine needs for ``model`` (added last by the loop; none by default)."""
        return []

    def use_clipping(self, accelerator, max_grad_norm: float | None) -> None:
        """Make the engine clip at ``max_grad_norm`` (None: no clipping) when it clips inside its own step.

        Under DDP and FSDP2 the loop clips with ``accelerator.clip_grad_norm_``
        between the window's rescale and the optimizer step, so nothing is set.
        """

    # ---- what it holds, sends and reports ---------------------------------------------------
    def communication_buffer_bytes(self, accelerator, model, policy: str) -> int:
        """Bytes of the engine's own communication buffers at a micro-batch's peak (the start of its backward).

        DDP: its reducer's buckets, a flat copy of every gradient (``P b_p``, resident from the first sync),
        unless ``gradient_as_bucket_view`` makes the gradients views of them; 0 for a model without DDP's
        reducer (one process; DeepSpeed's buckets are not counted).
        """
        if getattr(model, "reducer", None) is None or getattr(model, "gradient_as_bucket_view", False):
            return 0
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def held_tensors(self, model):
        """Yield ``(kind, tensor)`` for the gradients (and gathered parameters) ``model`` holds now."""
        for p in model.parameters():
            if p.grad is not None:
                yield "grad", p.grad

    def window_costs(self, accelerator, model, accumulation_steps: int, policy: str):
        """What one window of K micro-batches sends and holds per process under ``policy``: the cost table's row
        (:class:`accum_kit.engines.costs.PolicyCosts`; collectives' calls and bytes, bytes held).

        DDP: the table's row with a shard group of one (:func:`accum_kit.engines.costs.ddp_costs`): the whole
        gradient, ``P_t b_p`` bytes (the parameters that require a gradient), all-reduced once per synchronised
        backward; frozen parameters (a LoRA run's base weights) held as parameters only.
        """
        from .costs import ddp_costs

        P, F = trainable_and_frozen(model)
        b_p = next((p.element_size() for p in model.parameters()), 4)
        return ddp_costs(policy, world_size=accelerator.num_processes, accumulation_steps=accumulation_steps,
                         gradient_bytes=P * b_p, reduce_bytes=b_p, frozen_parameters=F)

    def predicted_memory(self, accelerator, model, accumulation_steps: int, policies) -> dict:
        """``{policy: PolicyCosts.to_dict()}``: what each of ``policies`` holds between micro-batches, in bytes.

        DDP and one process: every process holds the whole gradient as ``.grad``,
        ``P_t b_p`` bytes of the trainable parameters (none with K = 1: nothing is held between micro-batches).
        """
        P = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if not P:
            return {}
        b_p = next((p.element_size() for p in model.parameters()), 4)
        grads = P * b_p if accumulation_steps >= 2 else 0
        return {n: {"policy": n, "gradient_bytes": grads, "gathered_parameter_bytes": 0,
                    "formulas": {"gradients": f"P b_p = {P} x {b_p} (DDP: every process holds the full gradient)"}}
                for n in policies}

    def compute_precision(self, accelerator) -> str:
        """The precision gradients are computed in: Accelerate's ``mixed_precision`` (``no``, ``bf16``, ``fp16``)."""
        return accelerator.mixed_precision

    def casts_model(self) -> bool:
        """Whether the engine casts the model's weights itself (DeepSpeed) instead of Accelerate's autocast."""
        return False

    def summary_blocks(self, accelerator) -> dict:
        """``train_summary.json``'s engine blocks: ``{"fsdp": dict | None, "deepspeed": dict | None}``."""
        return {"fsdp": None, "deepspeed": None}

    def mesh(self, accelerator):
        """The run's :class:`accum_kit.engines.mesh.Mesh` (replicas x shard group); None when the model is not sharded."""
        return None

    def checkpoint_tag(self, accelerator) -> str:
        """What a checkpoint records as its writer: Accelerate's distributed type in lower case (``multi_cpu``...)."""
        return str(accelerator.distributed_type).split(".")[-1].lower()

    def check_job(self, *, profile_ab_steps: int = 0, auto_find_batch_size: bool = False) -> None:
        """Refuse, before any data or model work, a train-job setting this engine cannot honour (none by default;
        ``--auto_find_batch_size`` restarts the workers with another micro-batch, which needs nothing of DDP or FSDP2).
        """

    def prepared_engine(self, model):
        """The engine object ``prepare`` returned for ``model`` when it is not a plain module wrapper (DeepSpeed)."""
        return None

    def profiler_part(self, profiler):
        """The :class:`accum_kit.profiler.CommProfiler`'s part for this engine (several processes): which recorder
        sees the gradient collectives and which keys the summary gets (:mod:`accum_kit.profiler.parts`).

        Here DDP's: :class:`accum_kit.profiler.parts.BucketPart` (the comm hook on a DDP model).
        """
        from ..profiler.parts import BucketPart

        return BucketPart(profiler)

    def owns_backward(self) -> bool:
        """Whether the prepared model's backward runs through the engine's own object, which scales the loss,
        reduces and steps inside it (DeepSpeed): then a plain ``loss.backward()`` (verify's ``sum`` row) measures
        something else, and a trainer that builds its own engine (verify's Trainer row) cannot share this one."""
        return False
