"""DeepSpeed (0.19.8) and Accelerate's DeepSpeed path (accelerate 1.15): the internals accum-kit touches.

Part of :mod:`accum_kit.compat` (import from there): the CPU switch, the C++
op DeepSpeed would compile at start-up, the comm backend the profiler wraps,
the gradient partitions ZeRO holds, and the classes its checkpoints pickle.
"""

from __future__ import annotations


def enable_deepspeed_on_cpu(accelerator, deepspeed_plugin) -> None:
    """Make a CPU (gloo) Accelerator prepare with DeepSpeed, as it would on GPUs.

    Accelerate switches to DeepSpeed only without ``cpu=True``
    (``PartialState.__init__`` and ``AcceleratorState.__init__`` test
    ``ACCELERATE_USE_DEEPSPEED == "true" and not cpu``, accelerate 1.15). On a
    machine without a GPU that branch leaves no process group of Accelerate's
    own (its backend is None), so the state says ``DEEPSPEED`` with
    ``num_processes`` 1 and DeepSpeed then fails its batch check
    (``train_batch_size != micro x K x world``); with ``cpu=True`` the config is
    ignored and ``prepare`` wraps the model in DDP, silently. DeepSpeed itself
    runs on CPU: without oneCCL its CPU accelerator uses gloo (DeepSpeed
    0.19.8). So the Accelerator is built with ``cpu=True`` (one gloo group),
    and then the state gets what the GPU branch of ``AcceleratorState.__init__``
    sets: ``distributed_type = DEEPSPEED`` in the shared state of
    ``AcceleratorState`` and ``PartialState``, the plugin in
    ``deepspeed_plugins`` after ``set_mixed_precision`` and ``select``, and
    ``_mixed_precision = "no"`` (DeepSpeed casts itself, from its config). The
    constructor's autocast and GradScaler, which it set up for MULTI_CPU, are
    switched off as its DEEPSPEED branch would have left them. After it,
    ``prepare`` calls ``deepspeed.initialize`` and ``backward`` goes through
    ``DeepSpeedEngineWrapper`` (checked on 2 gloo processes, ZeRO 1/2/3,
    accelerate 1.15, DeepSpeed 0.19.8, torch 2.13).

    Call right after building the Accelerator, before ``prepare``.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    precision = accelerator.state.mixed_precision
    deepspeed_plugin.set_mixed_precision(precision)
    deepspeed_plugin.select(_from_accelerator_state=True)
    AcceleratorState._shared_state["deepspeed_plugins"] = deepspeed_plugin
    AcceleratorState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
    AcceleratorState._shared_state["_mixed_precision"] = "no"
    PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
    accelerator.native_amp, accelerator.scaler = False, None
    skip_deepspeed_shm_op()
    if accelerator.deepspeed_plugin is not deepspeed_plugin:  # a later Accelerate keeps the plugin elsewhere
        raise RuntimeError("accelerate no longer reads its DeepSpeed plugin from the shared state; "
                           "see accum_kit.compat.enable_deepspeed_on_cpu")


def skip_deepspeed_shm_op() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory op, which training does not use.

    DeepSpeed 0.19.8's ``TorchBackend.__init__`` (the first ``deepspeed.initialize``
    of a process) JIT-compiles the C++ op ``deepspeed_shm_comm`` with ninja when
    it is marked compatible in ``deepspeed.ops.__compatible_ops__``; it serves
    only ``inference_all_reduce``, and training's collectives go to
    ``torch.distributed`` (gloo) either way. On a loaded 2-core machine the
    compile ran for more than 8 minutes (and two processes wait on one lock
    file; a killed compile leaves the lock and every later start hangs).
    Marking it incompatible makes ``build_shm_op`` return None.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_comm_backend():
    """DeepSpeed's communication backend object, through which every collective of its engine passes.

    ``deepspeed.comm.comm.cdb`` (a ``TorchBackend`` on CPU and CUDA), set by
    ``deepspeed.comm.init_distributed``, which ``deepspeed.initialize`` calls
    (DeepSpeed 0.19.8). Every ``deepspeed.comm`` function calls a method of it.

    Raises:
        RuntimeError: not initialised yet (``prepare`` has not run ``deepspeed.initialize``).
    """
    from deepspeed.comm import comm

    if getattr(comm, "cdb", None) is None:
        raise RuntimeError("DeepSpeed's communication backend is not initialised: prepare the model first")
    return comm.cdb


def deepspeed_held_gradients(engine):
    """Yield ``(kind, tensor)`` for the gradients a DeepSpeed engine holds between micro-batches.

    kinds: ``"grad"`` (a parameter's ``.grad``: ZeRO-1 accumulates the full
    gradient there until the boundary), ``"partition_grad"`` (the reduced
    gradient partition the ZeRO optimizer keeps: ``all_grad_tensors`` (per group, the
    reduced gradients of the parameters in this process's partition, summed over
    the window; whole parameters, so a parameter that straddles the partition
    boundary is held entirely), ``grads_in_partition`` and ``averaged_gradients`` of
    ZeRO-1/2's ``DeepSpeedZeroOptimizer``, ``grad_partitions_flat_buffer`` of
    ZeRO-3's ``DeepSpeedZeroOptimizer_Stage3``). Attributes of DeepSpeed 0.19.8;
    count storages, not tensors (partitions are views of flat buffers).
    """
    for p in engine.module.parameters():
        if p.grad is not None:
            yield "grad", p.grad
    opt = getattr(engine, "optimizer", None)
    for name in ("grad_partitions_flat_buffer", "grads_in_partition"):
        flat = getattr(opt, name, None)
        if flat is not None:
            yield "partition_grad", flat
    groups = []
    for name in ("averaged_gradients", "all_grad_tensors"):  # dicts {group index: tensors} (lists in older versions)
        found = getattr(opt, name, None) or {}
        groups += list(found.values() if isinstance(found, dict) else found)
    for value in groups:
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if t is not None and hasattr(t, "untyped_storage"):
                yield "partition_grad", t


def deepspeed_checkpoint_globals() -> list:
    """The DeepSpeed classes its checkpoint files pickle, to allow in a weights-only load; [] without DeepSpeed.

    ``engine.save_checkpoint`` (which ``save_state`` calls under DeepSpeed)
    writes ``zero_pp_rank_*_optim_states.pt`` holding a ``ZeroStageEnum``,
    ``fragment_address`` records and the ``LossScaler`` (DeepSpeed 0.19.8,
    found with ``torch.serialization.get_unsafe_globals_in_checkpoint``). They
    are plain data classes; allowing exactly these keeps the weights-only
    pre-check of :mod:`accum_kit.checkpoint_files` strict for everything else.
    """
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return []
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler]
