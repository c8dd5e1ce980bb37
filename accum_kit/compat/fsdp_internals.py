"""torch FSDP2 internals (torch 2.13): what a unit holds, its reshard setting, the collectives it calls.

Part of :mod:`accum_kit.compat` (import from there). FSDP2's public API sets
these (``set_custom_all_gather``, ``set_reshard_after_forward``) but does not
read them back; the profiler, the memory measurement and the bench need to.
"""

from __future__ import annotations


def fsdp_units(model) -> list:
    """FSDP2's parameter groups ("units") of ``model``, one per ``fully_shard`` call, in module order.

    Each entry is ``(module, group)``: the first ``FSDPModule`` that owns the
    group (a ``fully_shard([a, b])`` call makes one state shared by several
    modules; it is listed once) and its ``FSDPParamGroup``. Touches
    ``FSDPModule._get_fsdp_state()._fsdp_param_groups`` (a list, torch 2.13);
    torch 2.11 keeps one group per state as ``_fsdp_param_group`` (None when
    the module holds no parameter of its own), found on an H200 where the
    plural raised ``AttributeError``. Empty for a model that is not FSDP2.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []
    seen, units = set(), []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch 2.11: one group per state, or None
            single = getattr(state, "_fsdp_param_group", None)
            groups = [single] if single is not None else []
        units += [(module, group) for group in groups]
    return units


def fsdp_unit_name(group) -> str:
    """The unit's module path (``""`` for the root), ``FSDPParamGroup._module_fqn`` (torch 2.13)."""
    return getattr(group, "_module_fqn", "") or ""


def fsdp_unit_parameters(group) -> int:
    """Elements of the unit's parameters, unsharded (each ``FSDPParam.sharded_param`` is a DTensor of the full shape)."""
    return sum(p.sharded_param.numel() for p in group.fsdp_params)


def fsdp_unit_trainable_parameters(group) -> int:
    """Elements of the unit's parameters that require a gradient, unsharded (a LoRA run's adapters; the frozen
    weights beside them in the same unit are gathered but never reduce-scattered)."""
    return sum(p.sharded_param.numel() for p in group.fsdp_params if p.sharded_param.requires_grad)


def fsdp_reshards_after_forward(group) -> bool:
    """Whether the unit frees its gathered parameters after its forward right now.

    ``FSDPParamGroup.post_forward_mesh_info`` is None when it does not
    (torch 2.13). FSDP2 turns it off for the root at the first forward, and
    Accelerate's tied embedding/head unit is built with it off, so read it
    after a forward.
    """
    return group.post_forward_mesh_info is not None


def fsdp_reshard_after_forward_state(model) -> list:
    """Every unit's reshard-after-forward setting, to give back to :func:`restore_fsdp_reshard_after_forward`.

    ``FSDPModule.set_reshard_after_forward(flag)`` sets one value for every
    unit, the root and the tied-embedding unit included, whose own settings
    differ; saving ``post_forward_mesh_info`` per group (torch 2.13) restores
    them exactly.
    """
    return [(group, group.post_forward_mesh_info) for _, group in fsdp_units(model)]


def restore_fsdp_reshard_after_forward(saved: list) -> None:
    """Put back the settings :func:`fsdp_reshard_after_forward_state` returned."""
    for group, info in saved:
        group.post_forward_mesh_info = info


def keep_fsdp_parameters_after_forward(model) -> None:
    """Make every unit keep its gathered parameters after forward (``reshard_after_forward=False`` at run time).

    ``FSDPModule.set_reshard_after_forward(False)`` also marks each state so
    that the root's lazy initialisation no longer overrides it; setting the
    group's ``post_forward_mesh_info`` to None, which is what that call does
    for ``False`` (torch 2.13), leaves the root's own rule alone so that
    :func:`restore_fsdp_reshard_after_forward` gives exactly the state built by
    ``prepare``.
    """
    for _, group in fsdp_units(model):
        group.post_forward_mesh_info = None


def fsdp_unit_comms(group) -> tuple:
    """The (all-gather, reduce-scatter) objects the unit calls now: ``_all_gather_comm``, ``_reduce_scatter_comm``.

    FSDP2 starts with ``DefaultAllGather`` / ``DefaultReduceScatter``, which call
    ``torch.distributed.all_gather_single`` / ``reduce_scatter_single``;
    ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` replace
    them (torch 2.13). The profiler wraps what it finds, so a user's custom
    collective keeps working.
    """
    return group._all_gather_comm, group._reduce_scatter_comm


def fsdp_held_tensors(group):
    """Yield ``(kind, tensor)`` for what the unit holds between two micro-batches.

    kinds: ``"sharded_grad"`` (the local shard of ``sharded_param.grad``, after a
    reduce-scatter), ``"unsharded_grad"`` (``FSDPParam._unsharded_param.grad``:
    the full gradient kept under ``no_sync`` when it is accumulated in the
    parameter's dtype), ``"accumulated_grad"`` (``FSDPParam.unsharded_accumulated_grad``:
    the full gradient in the reduce dtype, when that differs from the compute
    dtype), ``"gathered_parameter"`` (the unsharded parameter, when its
    storage is allocated, i.e. not resharded) and, under HSDP with the
    all-reduce deferred (``set_requires_all_reduce(False)``),
    ``"partial_reduce_output"`` (``FSDPParamGroup._partial_reduce_output``: the
    unit's reduce-scattered shard, summed over the window's micro-batches
    until the boundary all-reduces it). Attributes of torch 2.13's
    ``FSDPParam`` and ``FSDPParamGroup``; several tensors may share one storage
    (a unit's shards are views of one reduce-scatter output), so count
    storages, not tensors.
    """
    partial = getattr(group, "_partial_reduce_output", None)
    if partial is not None:
        yield "partial_reduce_output", partial
    for p in group.fsdp_params:
        grad = p.sharded_param.grad
        if grad is not None:
            yield "sharded_grad", _local(grad)
        unsharded = getattr(p, "_unsharded_param", None)
        if unsharded is not None:
            unsharded = _local(unsharded)
            if unsharded.grad is not None:
                yield "unsharded_grad", _local(unsharded.grad)
            if unsharded.untyped_storage().nbytes() > 0:
                yield "gathered_parameter", unsharded
        if p.unsharded_accumulated_grad is not None:
            yield "accumulated_grad", _local(p.unsharded_accumulated_grad)


def _local(t):
    """The local tensor of a ``DTensor`` (under tensor parallel FSDP2's unsharded parameter is still split over tp,
    and its storage is that of the local part); any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def fsdp_replicate_process_group(group):
    """The process group a unit all-reduces its reduce-scattered gradients over under HSDP; None without one.

    ``FSDPParamGroup.mesh_info`` is an ``HSDPMeshInfo`` on a 2-D mesh, whose
    ``replicate_process_group`` FSDP2's ``foreach_reduce`` passes to
    ``torch.distributed.all_reduce`` (torch 2.13); plain FSDP2's ``FSDPMeshInfo`` has none.
    """
    return getattr(getattr(group, "mesh_info", None), "replicate_process_group", None)


def fsdp_comm_interfaces() -> tuple:
    """FSDP2's abstract ``AllGather`` and ``ReduceScatter`` classes, which ``set_custom_*`` objects subclass.

    Defined in ``torch.distributed.fsdp._fully_shard._fsdp_api`` and not
    re-exported by ``torch.distributed.fsdp`` (torch 2.13).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def fsdp_unsharded_parameters(group) -> list:
    """The unit's unsharded parameters, the leaves autograd accumulates gradients into under ``no_sync``.

    FSDP2 makes each ``FSDPParam._unsharded_param`` at the unit's first
    all-gather and keeps that tensor for the run, freeing and refilling its
    storage (torch 2.13). Returns those made so far (empty before the first
    forward, or under another torch layout).
    """
    params = (getattr(fp, "_unsharded_param", None) for fp in getattr(group, "fsdp_params", ()))
    return [p for p in params if p is not None]


def fsdp_unit_reduces_gradients(group) -> bool:
    """Whether the unit's next post-backward reduces its gradients: ``FSDPParamGroup.reduce_grads`` (torch 2.13).

    ``FSDPModule.set_requires_gradient_sync(False)`` (what Accelerate's ``no_sync`` calls) sets it off for
    every unit; True when the attribute is missing (a torch whose groups always reduce).
    """
    return bool(getattr(group, "reduce_grads", True))


def wrap_fsdp_post_backward(group, make_wrapper) -> bool:
    """Replace the unit's post-backward hook by ``make_wrapper(inner)`` (same signature), on this group only.

    FSDP2 reaches it as ``ctx.param_group.post_backward()`` from its autograd function and from the root's
    final backward callback (torch 2.13's ``RegisterPostBackwardFunction`` and
    ``FSDPState._root_post_backward_final_callback``), both attribute look-ups on the group, so an instance
    attribute takes the class method's place. Returns False, changing nothing, when the group has no
    ``post_backward`` method (another torch layout) or already carries a wrapper; undo with
    :func:`unwrap_fsdp_post_backward`.
    """
    inner = getattr(group, "post_backward", None)
    if not callable(inner) or "post_backward" in vars(group):
        return False
    group.post_backward = make_wrapper(inner)
    return True


def unwrap_fsdp_post_backward(group) -> None:
    """Give the unit its own post-backward hook back (drop the instance attribute :func:`wrap_fsdp_post_backward` set)."""
    vars(group).pop("post_backward", None)


def full_tensor(tensor):
    """The whole tensor of a parameter or gradient: a ``DTensor`` (FSDP2's and HSDP's shards, on any mesh) gathered
    with ``DTensor.full_tensor()`` (a collective: every process of its mesh must call it), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
