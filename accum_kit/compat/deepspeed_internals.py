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


#: The ZeRO optimizers' methods on the gradient reduction path (DeepSpeed 0.19.8, ``stage_1_and_2.py`` and
#: ``stage3.py``): ``process_gradients`` (the per-parameter gradient hook's body: under ZeRO-2 it copies the
#: gradient into the reduction bucket, reducing the bucket when it fills, and drops ``.grad``; under ZeRO-1
#: it does nothing inside the window), ``reduce_ready_partitions_and_remove_grads`` (the same per parameter;
#: ZeRO-3's hook and ZeRO-1's boundary call it), ``reduce_gradients`` (ZeRO-1's boundary reduction, called
#: by the engine), ``overlapping_partition_gradients_reduce_epilogue`` and
#: ``independent_gradient_partition_epilogue`` (the flush of the last bucket: the all-reduce or
#: reduce-scatter, the copy of the reduced bucket into this process's partition, the bookkeeping).
ZERO_REDUCTION_METHODS = ("process_gradients", "reduce_ready_partitions_and_remove_grads", "reduce_gradients",
                          "overlapping_partition_gradients_reduce_epilogue", "independent_gradient_partition_epilogue")


def zero_reduction_methods(optimizer) -> list[str]:
    """The names of :data:`ZERO_REDUCTION_METHODS` that ``optimizer`` (an engine's ZeRO optimizer) has.

    The engine and the gradient hooks call them as ``self.<name>(...)`` / ``self.optimizer.<name>(...)``,
    looked up on the instance at each call, so an instance attribute of the same name intercepts
    every call (checked for DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer`` and ``DeepSpeedZeroOptimizer_Stage3``).
    """
    return [name for name in ZERO_REDUCTION_METHODS if callable(getattr(optimizer, name, None))]


def deepspeed_parameter_bytes(engine) -> int:
    """Bytes of parameters the engine's module holds now, each storage once.

    A parameter's own data (ZeRO-1/2: views of the flat buffer, the whole
    parameter; ZeRO-3: empty once released, the whole parameter while
    gathered or when it stays resident under ``stage3_param_persistence_threshold``)
    plus, under ZeRO-3, this process's partition ``ds_tensor`` (DeepSpeed 0.19.8).
    The optimizer's fp32 master partitions are not counted.
    """
    seen, total = set(), 0
    for p in engine.module.parameters():
        for t in (p.data, getattr(p, "ds_tensor", None)):
            if t is None or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            key = (storage.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def prepare_deepspeed_engine(accelerator, model, optimizer, plugin, micro_batch: int, *extra):
    """``accelerator.prepare(model, optimizer, *extra)`` as one more DeepSpeed engine, built from ``plugin``.

    Accelerate (1.15) keeps one DeepSpeed plugin in its shared state and ties
    ``accelerator.backward`` to the first engine it prepares
    (``deepspeed_engine_wrapped``). To hold several engines (of other ZeRO stages
    or K) in one process, this selects ``plugin`` as :func:`enable_deepspeed_on_cpu`
    does, fixes the micro-batch and global batch in its config (no dataloader
    need be passed), clears the tie, prepares, and returns ``(prepared objects,
    wrapper)``; :func:`use_deepspeed_engine` ties ``backward`` to a wrapper again.
    """
    plugin.set_mixed_precision(accelerator.state.mixed_precision)
    config = plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["train_batch_size"] = micro_batch * int(config["gradient_accumulation_steps"]) * accelerator.num_processes
    use_deepspeed_engine(accelerator, plugin, None)
    prepared = accelerator.prepare(model, optimizer, *extra)
    return prepared, accelerator.deepspeed_engine_wrapped


def use_deepspeed_engine(accelerator, plugin, wrapper) -> None:
    """Make ``accelerator.backward`` drive ``wrapper``'s engine, with its ``plugin`` the selected one.

    The shared state's ``deepspeed_plugins`` (what ``accelerator.deepspeed_plugin``
    returns) and ``deepspeed_engine_wrapped`` (what ``backward`` calls: the
    engine's ``backward``, then ``step`` on the boundary), accelerate 1.15.
    """
    from accelerate.state import AcceleratorState

    plugin.select(_from_accelerator_state=True)
    AcceleratorState._shared_state["deepspeed_plugins"] = plugin
    accelerator.deepspeed_engine_wrapped = wrapper
    if accelerator.deepspeed_plugin is not plugin:
        raise RuntimeError("accelerate no longer reads its DeepSpeed plugin from the shared state; "
                           "see accum_kit.compat.use_deepspeed_engine")


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
    pre-check of :mod:`accum_kit.core.checkpoint_files` strict for everything else.
    """
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return []
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler]


def zero_flat_partitions(engine) -> dict:
    """``{id(flat fp32 tensor): (layout, parameters)}``: what the ZeRO optimizer hands its inner optimizer.

    The inner (client) optimizer of a ZeRO engine never sees the model's
    parameters: ``step`` is called once per parameter group (sub-group under
    ZeRO-3) with ``param_groups`` holding one flat float32 tensor, this
    process's partition of the group, whose ``.grad`` is the averaged (and
    clipped) gradient partition (DeepSpeed 0.19.8). layout ``"fragments"``:
    ZeRO-1/2's ``single_partition_of_fp32_groups[i]`` with ``bit16_groups[i]``,
    or ``BF16_Optimizer``'s ``fp32_groups_flat_partition[i]`` with
    ``bf16_groups[i]`` (each parameter's ``_hp_mapping`` says which slice of the
    partition holds which slice of it); ``"stage3"``: ZeRO-3's
    ``fp32_partitioned_groups_flat[i]`` with ``fp16_groups[i]`` (each
    parameter's own partition at ``grad_position``). Empty for an engine without ZeRO.
    """
    opt = getattr(engine, "optimizer", None)
    pairs = []
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        pairs = [(f, ("stage3", list(ps))) for f, ps in zip(opt.fp32_partitioned_groups_flat, opt.fp16_groups)]
    elif hasattr(opt, "single_partition_of_fp32_groups"):
        pairs = [(f, ("fragments", list(ps))) for f, ps in zip(opt.single_partition_of_fp32_groups, opt.bit16_groups)]
    elif hasattr(opt, "fp32_groups_flat_partition"):
        pairs = [(f, ("fragments", list(ps))) for f, ps in zip(opt.fp32_groups_flat_partition, opt.bf16_groups)]
    return {id(f): (layout, params, opt) for f, (layout, params) in pairs}


def zero_full_gradients(flat, layout: str, params: list, zero_optimizer) -> list:
    """``[(parameter, full float32 gradient)]`` of one group, rebuilt from every process's flat partition.

    Collective over the data-parallel group: call on every process, inside the
    inner optimizer's ``step`` (where ``flat.grad`` holds the partition, see
    :func:`zero_flat_partitions`). "fragments": each process writes its slices
    of each parameter into a zero buffer of the parameter's size, and one
    all-reduce (sum) assembles them (the slices are disjoint, so the sum only
    adds zeros: exact); "stage3": one all-gather of the equal-sized
    partitions, cut to ``ds_numel``.
    """
    import torch
    import torch.distributed as dist

    grad = flat.grad.detach().float()
    if layout == "fragments":
        group = next((p._dp_group for p in params if getattr(p, "_dp_group", None) is not None), None)
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=grad.device)
        offset = 0
        for p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is not None:  # None: no slice of this parameter in this process's partition
                lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
                buffer[offset + lp.start: offset + lp.start + lp.numel] = grad[hp.start: hp.start + hp.numel]
            offset += p.numel()
        dist.all_reduce(buffer, group=group)
        return [(p, t.view(p.shape)) for p, t in zip(params, buffer.split([p.numel() for p in params]))]
    out = []
    for p in params:
        _, start, numel = zero_optimizer.grad_position[zero_optimizer.get_param_id(p)]
        group = zero_optimizer._get_param_partition_group(p)
        parts = [torch.empty(numel, dtype=torch.float32, device=grad.device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, grad[start: start + numel].contiguous(), group=group)
        out.append((p, torch.cat(parts)[: p.ds_numel].view(p.ds_shape)))
    return out


def set_deepspeed_clipping(engine, max_norm: float) -> None:
    """Make a built DeepSpeed engine clip the global gradient norm at ``max_norm`` (0: no clipping).

    DeepSpeed reads ``gradient_clipping`` from its config once, in
    ``deepspeed.initialize``: the engine answers ``gradient_clipping()`` from
    ``engine._config.gradient_clipping`` (used when it clips itself, without
    ZeRO), and the ZeRO optimizers copy it into their ``clip_grad`` attribute,
    which their ``step`` uses (``DeepSpeedZeroOptimizer`` and
    ``DeepSpeedZeroOptimizer_Stage3``, DeepSpeed 0.19.8). Both are set. A
    checkpoint saved afterwards records the new value (``CLIP_GRAD`` of the
    ZeRO optimizer's state), and loading it restores it.
    """
    engine._config.gradient_clipping = float(max_norm)
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "clip_grad"):
        optimizer.clip_grad = float(max_norm)
    if engine.gradient_clipping() != float(max_norm):  # a later DeepSpeed keeps it elsewhere
        raise RuntimeError("deepspeed no longer reads gradient_clipping from engine._config; "
                           "see accum_kit.compat.set_deepspeed_clipping")


def make_zero3_leaf_modules(model, modules) -> int:
    """Flag ``modules`` (inside ``model``) as ZeRO-3 leaf modules with ``deepspeed.utils.set_z3_leaf_modules_by_name``
    (DeepSpeed 0.19.8; the mechanism Accelerate's ``transformer_moe_cls_names`` uses): ZeRO-3 gathers a leaf
    module's parameters at its forward and, after its backward, reduces every one of them, a zero gradient for
    those that got none (``DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks``). Before
    ``deepspeed.initialize`` (``prepare``). Returns how many were flagged."""
    if not modules:
        return 0
    from deepspeed.utils import set_z3_leaf_modules_by_name

    names = {id(m): n for n, m in model.named_modules()}
    flagged, _ = set_z3_leaf_modules_by_name(model, [names[id(m)] for m in modules if id(m) in names])
    return len(flagged)
