"""Every place accum-kit reaches into Accelerate's, torch's and DeepSpeed's internals, in one package.

Accelerate has no public API for these few things, so the toolkit touches
its attributes directly. Keeping them here means an Accelerate upgrade can
break only this module: read it first after upgrading. Each function says
what it touches, why, and the version it was checked against (accelerate
1.15.0, the version in the project's lock of measurements).
"""

from __future__ import annotations

import contextlib
import os


def sync_each_batch(accelerator, *, distributed_only: bool = True) -> bool:
    """Whether ``accumulate()`` all-reduces on every micro-batch right now.

    Touches ``accelerator.gradient_state.plugin_kwargs["sync_each_batch"]``:
    the live copy of ``GradientAccumulationPlugin.sync_each_batch`` that
    ``Accelerator.accumulate`` reads on every call (accelerate 1.15). Only
    meaningful with several processes; one process never syncs, so the answer
    is False there unless ``distributed_only=False`` (the switch as set).
    """
    flag = bool(accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False))
    return flag and (accelerator.use_distributed or not distributed_only)


def at_end_of_dataloader(accelerator) -> bool:
    """Whether the batch being processed is the last of the prepared dataloader being iterated.

    Reads ``accelerator.gradient_state.end_of_dataloader``, which the prepared
    dataloader sets before it yields its last batch (it peeks one ahead); it
    is the flag ``Accelerator.gather_for_metrics`` reads to drop the examples
    ``even_batches`` repeated (accelerate 1.15).
    """
    return bool(accelerator.gradient_state.end_of_dataloader)


def set_sync_each_batch(accelerator, value: bool) -> None:
    """Switch ``sync_each_batch`` between windows (for A/B timing of no_sync).

    Accelerate reads the flag from ``gradient_state.plugin_kwargs`` on each
    ``accumulate()`` call and offers no setter, so writing the dict is the
    only way to flip it without building a new Accelerator (accelerate 1.15).
    Flip it only between windows: mid-window it changes which micro-batches sync.
    """
    accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = bool(value)


def restart_window_counter(accelerator) -> None:
    """Reset Accelerate's micro-batch counter so the next micro-batch opens a window.

    ``accumulate()`` syncs when ``accelerator.step % num_steps == 0`` and
    ``step`` is never reset by Accelerate itself (accelerate 1.15). A loop that
    stopped mid-window (``max_train_steps``, an exception) would otherwise
    shift every window of the next loop that uses the same Accelerator.
    """
    accelerator.step = 0


def set_accumulation_steps(accelerator, steps: int) -> None:
    """Switch K between windows (accumulation schedules) and make the next micro-batch open a window.

    The ``gradient_accumulation_steps`` setter of accelerate 1.15 only
    updates ``gradient_state.plugin_kwargs["num_steps"]``, which
    ``accumulate()`` reads on every call; its micro-batch counter
    ``accelerator.step`` runs on, so after two windows of 3 (step 6) a switch
    to 4 would sync at step 8, a window of 2. The counter is reset here too
    (:func:`restart_window_counter`). Call it only at a window boundary.
    """
    accelerator.gradient_accumulation_steps = int(steps)
    restart_window_counter(accelerator)


def scheduler_base_lrs(lr_scheduler) -> list | None:
    """The ``base_lrs`` list of a (prepared) PyTorch LR scheduler, to scale in place; None if it has none.

    ``LRScheduler.step`` recomputes every group's learning rate from
    ``base_lrs`` (``LambdaLR``, which transformers' ``get_scheduler``
    returns: ``base_lr x lambda(step)``), so a learning-rate change that must
    last is made there. Accelerate's ``AcceleratedScheduler`` keeps the
    wrapped scheduler in ``.scheduler`` (accelerate 1.15).
    """
    inner = getattr(lr_scheduler, "scheduler", lr_scheduler)
    base = getattr(inner, "base_lrs", None)
    return base if isinstance(base, list) else None


def release_dataloader(accelerator, dataloader) -> None:
    """Unregister a prepared dataloader that was left before its end.

    A prepared ``DataLoaderShard`` registers itself in
    ``gradient_state.dataloader_references`` when iteration starts and
    removes itself in ``end()`` when it is exhausted. Breaking out early
    (``max_train_steps``) leaves it registered, and later ``accumulate()``
    calls then see ``end_of_dataloader`` and sync every micro-batch
    (accelerate 1.15). Calling ``end()`` here restores the state.
    """
    if hasattr(dataloader, "end") and dataloader in accelerator.gradient_state.dataloader_references:
        dataloader.end()


def forget_prepared(accelerator, objects) -> None:
    """Remove ``objects`` from the lists ``accelerator.prepare`` appended them to.

    ``prepare`` keeps every model, optimizer and dataloader in
    ``accelerator._models`` / ``_optimizers`` / ``_dataloaders`` (used by
    ``save_state`` and ``free_memory``); there is no public way to drop a
    temporary one without dropping the caller's too (accelerate 1.15). Used by
    ``verify``, which prepares a throw-away copy inside a caller's Accelerator.
    """
    for attr in ("_models", "_optimizers", "_dataloaders"):
        lst = getattr(accelerator, attr, None)
        if isinstance(lst, list):
            lst[:] = [o for o in lst if not any(o is x for x in objects)]


def shuffle_generators(dataloader) -> list:
    """The ``torch.Generator`` objects that decide the order of a (prepared) dataloader, without duplicates.

    Follows the ``batch_sampler`` chain (Accelerate's ``SkipBatchSampler`` and
    ``BatchSamplerShard`` each wrap the user's ``BatchSampler`` in an attribute
    of that name, accelerate 1.15) down to the sampler and takes its
    ``generator``, plus the DataLoader's own ``generator`` (from which PyTorch
    draws each iterator's base seed). On several processes ``prepare`` gives a
    ``RandomSampler`` without one a generator and keeps it synchronised from
    rank 0 at the start of every epoch; its state is not part of
    ``save_state`` for map-style datasets, so a checkpoint must store it.
    Returns an empty list when nothing is seeded by a generator (the sampler
    then draws from the global torch RNG).
    """
    found = []
    obj = getattr(dataloader, "batch_sampler", None)
    while obj is not None and not hasattr(obj, "sampler") and hasattr(obj, "batch_sampler"):
        obj = obj.batch_sampler
    for owner in (getattr(obj, "sampler", None), dataloader):
        gen = getattr(owner, "generator", None)
        if gen is not None and not any(gen is g for g in found):
            found.append(gen)
    return found


def enable_fsdp_on_cpu(accelerator, fsdp_plugin) -> None:
    """Make a CPU (gloo) Accelerator prepare models with FSDP2, as it would on GPUs.

    Accelerate turns FSDP on only for GPU-type distributed types: with
    ``cpu=True`` (the only way several CPU processes form one gloo group, see
    :mod:`accum_kit.launch`) an FSDP config or plugin is silently ignored and
    ``prepare`` wraps the model in DDP (``AcceleratorState.__init__``,
    accelerate 1.15). The FSDP2 code path itself has nothing GPU-specific:
    ``fully_shard`` runs on gloo with CPU tensors. Setting
    ``distributed_type = DistributedType.FSDP`` in the shared state of
    ``AcceleratorState`` and ``PartialState`` (both are singletons shared by
    every Accelerator of the process) and ``fsdp_plugin`` in the former is what
    the GPU branch of ``AcceleratorState.__init__`` does; after it,
    ``accelerator.is_fsdp2`` is True, ``prepare`` applies ``fully_shard`` per
    the plugin's wrap policy, ``accumulate``/``no_sync`` call
    ``set_requires_gradient_sync``, and ``clip_grad_norm_``, ``save_state``,
    ``load_state`` and ``get_state_dict`` take their FSDP2 branches (all
    checked on 2 gloo processes, accelerate 1.15, torch 2.13). The mixed
    precision policy is set on the plugin beforehand by
    :func:`accum_kit.engines.fsdp2_plugin.fsdp_plugin_for`, which the GPU branch would
    otherwise fill in.

    Call right after building the Accelerator, before ``prepare``.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._shared_state["fsdp_plugin"] = fsdp_plugin
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if not accelerator.is_fsdp2:  # a later Accelerate keeps the switch elsewhere: fail here, not in prepare
        raise RuntimeError("accelerate no longer reads its FSDP switch from the shared state; "
                           "see accum_kit.compat.enable_fsdp_on_cpu")


def set_end_of_dataloader(accelerator, value: bool) -> None:
    """Tell ``accumulate()`` whether the batch about to run is the last of the dataloader being iterated.

    A prepared dataloader sets ``end_of_dataloader`` on itself just before it
    yields its last batch (it peeks one ahead); ``GradientState.end_of_dataloader``
    reads it from the active dataloader, and ``accumulate()`` then closes the
    window (accelerate 1.15). A loop that reads a whole window ahead (under
    DeepSpeed, to count its tokens first: :mod:`accum_kit.engines.deepspeed`) sees the flag
    turn on while earlier batches of the window are still to run; it sets the
    flag back per batch so that only the last one closes the window. No-op
    outside a prepared dataloader.
    """
    state = accelerator.gradient_state
    if state.in_dataloader:
        state.active_dataloader.end_of_dataloader = bool(value)


@contextlib.contextmanager
def parallelism_config_from_env_off():
    """Keep ``Accelerator()`` from reading the launcher's parallelism config while it is built on CPU.

    ``accelerate launch`` with a ``parallelism_config`` exports
    ``ACCELERATE_USE_PARALLELISM_CONFIG=true``; the ``Accelerator`` constructor
    then builds a ``ParallelismConfig`` from the environment and validates it
    against the distributed type, which on CPU is ``MULTI_CPU`` until
    :func:`enable_fsdp_on_cpu` has run: it raises "ParallelismConfig is only
    compatible DistributedType.FSDP" (accelerate 1.15). The variable is set to
    false for the constructor and put back after; :func:`enable_hsdp_on_cpu`
    applies the config afterwards.
    """
    key = "ACCELERATE_USE_PARALLELISM_CONFIG"
    saved = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[key]
        else:
            os.environ[key] = saved


def enable_hsdp_on_cpu(accelerator, parallelism_config) -> None:
    """Give a CPU Accelerator already switched to FSDP2 (:func:`enable_fsdp_on_cpu`) its 2-D device mesh.

    What the ``Accelerator`` constructor does with a ``parallelism_config``
    when the distributed type is FSDP from the start (accelerate 1.15): store
    the config in the shared ``AcceleratorState`` (``accelerator.parallelism_config``
    reads it), build the mesh with ``ParallelismConfig.get_device_mesh(device_type)``
    into ``state.device_mesh`` (``accelerator.torch_device_mesh``, which
    ``prepare`` passes to ``fully_shard`` as ``mesh[parallelism_config.fsdp_dim_names]``)
    and run ``ParallelismConfig._validate_accelerator``. Checked on 4 gloo
    processes (2 x 2): every parameter is a DTensor on the mesh
    ``(dp_replicate, dp_shard_cp)`` with placements ``(Replicate(), Shard(0))``.

    Call right after :func:`enable_fsdp_on_cpu`, before ``prepare``.
    """
    from accelerate.state import AcceleratorState

    AcceleratorState._shared_state["parallelism_config"] = parallelism_config
    AcceleratorState._shared_state["device_mesh"] = parallelism_config.get_device_mesh(accelerator.device.type)
    parallelism_config._validate_accelerator(accelerator)
    if accelerator.torch_device_mesh is None:  # a later Accelerate keeps the mesh elsewhere
        raise RuntimeError("accelerate no longer reads its device mesh from the shared state; "
                           "see accum_kit.compat.enable_hsdp_on_cpu")


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide singletons so the next ``Accelerator()`` starts afresh.

    ``AcceleratorState``, ``PartialState`` and ``GradientState`` are shared
    across every Accelerator of a process; their ``_reset_state`` methods are
    what Accelerate's own test-suite uses between cases (accelerate 1.15).
    Needed in a process forked from a notebook kernel that already built a
    single-process Accelerator. The torch.distributed process group is not touched.
    """
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@contextlib.contextmanager
def keep_gradient_plugin(accelerator):
    """Restore the shared gradient-accumulation settings after a block that builds another Accelerator.

    ``GradientState`` is one per process and shared by every Accelerator;
    a new ``Accelerator(gradient_accumulation_plugin=...)`` overwrites its
    ``plugin_kwargs`` (``num_steps``, ``sync_each_batch``,
    ``sync_with_dataloader``; transformers' Trainer builds one with
    ``num_steps=1``) and leaves ``sync_gradients`` at its last value. This
    puts both back as they were for ``accelerator`` (accelerate 1.15).
    """
    state = accelerator.gradient_state
    kwargs, sync = dict(state.plugin_kwargs), state.sync_gradients
    try:
        yield
    finally:
        state.plugin_kwargs.clear()
        state.plugin_kwargs.update(kwargs)
        state._set_sync_gradients(sync)


def ddp_static_graph_unprimed(model) -> bool:
    """True for a DDP model built with ``static_graph=True`` that has not run a synchronising backward yet.

    DDP's static-graph mode fails ("expect_autograd_hooks_ INTERNAL ASSERT
    FAILED" in ``reducer.cpp``) when its first backward runs under
    ``no_sync``, which gradient accumulation does (pytorch/pytorch#143580,
    huggingface/accelerate#3679; reproduced with torch 2.13 on gloo). After
    one synchronising backward, ``no_sync`` windows give the exact averaged
    gradients (checked against an all-reduced reference, torch 2.13 CPU).
    Touches DDP's private ``_static_graph_delay_allreduce_enqueued``, which it
    sets when that first synchronising backward is enqueued (torch 2.13).
    """
    return bool(getattr(model, "static_graph", False)) and not getattr(model, "_static_graph_delay_allreduce_enqueued", True)


def wrap_prepared_scheduler(accelerator, scheduler):
    """``scheduler`` wrapped as ``prepare`` wraps one under DDP and FSDP2, and kept for ``save_state``.

    Accelerate's ``prepare`` wraps a learning-rate scheduler in
    ``AcceleratedScheduler`` (stepped only on optimizer steps, once per process
    unless ``split_batches``) and appends it to ``accelerator._schedulers``,
    the list ``save_state`` and ``load_state`` walk. Its DeepSpeed branch does
    neither for a scheduler prepared in a call without the model: it returns
    the object as given (``_prepare_deepspeed``, accelerate 1.15). This does
    what the other branches do; anything that is not a plain torch scheduler
    (already wrapped, or not a scheduler) is returned unchanged.
    """
    from accelerate.scheduler import AcceleratedScheduler
    from torch.optim.lr_scheduler import LRScheduler

    if not isinstance(scheduler, LRScheduler):
        return scheduler
    wrapped = AcceleratedScheduler(scheduler, accelerator._optimizers, step_with_optimizer=accelerator.step_scheduler_with_optimizer,
                                   split_batches=accelerator.split_batches)
    accelerator._schedulers.append(wrapped)
    return wrapped


def restored_state_objects(accelerator) -> tuple[int, int]:
    """``(schedulers, custom objects)`` whose files Accelerate's ``load_state`` will read (accelerate 1.15):
    the prepared schedulers (``accelerator._schedulers``) but DeepSpeed's own ``DeepSpeedSchedulerWrapper``
    (saved inside DeepSpeed's checkpoint), and the objects registered with ``register_for_checkpointing``
    (``accelerator._custom_objects``)."""
    from accelerate.utils import DeepSpeedSchedulerWrapper

    schedulers = [s for s in accelerator._schedulers if not isinstance(s, DeepSpeedSchedulerWrapper)]
    return len(schedulers), len(accelerator._custom_objects)


# The engine-specific internals live in their own modules; every name stays importable from accum_kit.compat.
from .deepspeed_internals import (  # noqa: E402
    deepspeed_checkpoint_globals, deepspeed_comm_backend, deepspeed_held_gradients, deepspeed_parameter_bytes,
    enable_deepspeed_on_cpu, prepare_deepspeed_engine, set_deepspeed_clipping, skip_deepspeed_shm_op, use_deepspeed_engine,
    zero_flat_partitions, zero_full_gradients, zero_reduction_methods,
)
from .fsdp_internals import (  # noqa: E402
    fsdp_comm_interfaces, fsdp_held_tensors, fsdp_replicate_process_group, fsdp_reshard_after_forward_state, full_tensor,
    fsdp_reshards_after_forward, fsdp_unit_comms, fsdp_unit_name, fsdp_unit_parameters, fsdp_unit_trainable_parameters,
    fsdp_units,
    fsdp_unit_reduces_gradients, fsdp_unsharded_parameters, keep_fsdp_parameters_after_forward, restore_fsdp_reshard_after_forward,
    unwrap_fsdp_post_backward, wrap_fsdp_post_backward,
)


def ddp_constructor_kwargs(accelerator) -> dict:
    """The DDP constructor arguments ``prepare`` passes (``DistributedDataParallelKwargs`` by DDP's names; {} if none).

    Reads ``accelerator.ddp_handler``, where the Accelerator keeps the ``DistributedDataParallelKwargs`` of its
    ``kwargs_handlers`` and whose ``to_kwargs()`` it hands to DDP in ``prepare_model`` (accelerate 1.15).
    """
    handler = getattr(accelerator, "ddp_handler", None)
    return handler.to_kwargs() if handler is not None else {}
