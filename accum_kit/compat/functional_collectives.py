"""torch's collective operators as a dispatch mode sees them (torch 2.13): which op, on which process group, how
many bytes.

Part of :mod:`accum_kit.compat`, imported directly (``from accum_kit.compat.functional_collectives import ...``)
by :mod:`accum_kit.profiler.mesh_collectives`. Why internals: DTensor's collectives (tensor-parallel
activations, the reductions of its gradients) never pass through the ``torch.distributed.*`` functions,
which a wrapper could see; DTensor issues *functional collectives*, the operators
``torch.ops._c10d_functional.*`` (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_to_all_single``, ...), while FSDP2, DDP's reducer and ``torch.distributed.*`` calls (DeepSpeed's
``deepspeed.comm`` included) reach the ``torch.ops.c10d.*`` operators (``allreduce_``, ``_allgather_base_``,
``_reduce_scatter_base_``, ``alltoall_base_``, ...), through the dispatcher in both cases. Only a
``TorchDispatchMode`` sees both where they are issued (torch's own
``torch.distributed.tensor.debug.CommDebugMode`` counts them the same way). What this touches:

- ``torch.utils._python_dispatch.TorchDispatchMode`` and ``_get_current_dispatch_mode`` (a private module);
- the two namespaces' schemas (checked against torch 2.13.0): a functional collective names its group by
  ``group_name`` (a string; ``Any`` in the schema), a c10d operator takes the ``ProcessGroup`` as a
  ``torch.ScriptObject``, unboxed with ``ProcessGroup.unbox``; the ``_c10d_functional_autograd`` ops,
  when a mode sees them at all, do not re-dispatch to the ``_c10d_functional`` ones (counted once);
- ``torch._C._current_graph_task_id`` (:func:`in_autograd_backward`);
- returning ``NotImplemented`` for an op on a ``DTensor`` so that DTensor turns it into local ops and
  collectives first (what ``CommDebugMode.__torch_dispatch__`` does), which the mode then sees.

``wait_tensor`` and ``_wrap_tensor_autograd`` are not collectives and are not counted.
"""

from __future__ import annotations

#: Collective kinds, normalised across the two namespaces.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter",
         "barrier", "send", "recv", "p2p")


def _nbytes(x) -> int:
    """Bytes of a tensor, or of a (nested) list of tensors (``numel x element size``)."""
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size() if hasattr(x, "numel") else 0


# Per operator name: (kind, bytes of the call from (args, group size)). Bytes are nccl-tests' S: the whole
# buffer (an all-gather's output, a reduce-scatter's input, an all-reduce's or all-to-all's input).
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_reduce_": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_reduce_coalesced": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_reduce_coalesced_": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a[0]) * int(a[1])),
    "all_gather_into_tensor_out": ("all_gather", lambda a: _nbytes(a[0]) * int(a[1])),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda a: _nbytes(a[0]) * int(a[1])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "reduce_scatter_tensor_out": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "all_to_all_single": ("all_to_all", lambda a: _nbytes(a[0])),
    "broadcast": ("broadcast", lambda a: _nbytes(a[0])),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0])),
    "isend": ("send", lambda a: _nbytes(a[0])),
    "irecv": ("recv", lambda a: _nbytes(a[0])),
    "batch_p2p_ops": ("p2p", lambda a: _nbytes(a[3])),
}
_C10D = {
    "allreduce_": ("all_reduce", lambda a: _nbytes(a[0])),
    "allreduce_coalesced_": ("all_reduce", lambda a: _nbytes(a[0])),
    "_allgather_base_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_coalesced_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: _nbytes(a[0])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "alltoall_base_": ("all_to_all", lambda a: _nbytes(a[1])),
    "alltoall_": ("all_to_all", lambda a: _nbytes(a[1])),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0])),
    "reduce_": ("reduce", lambda a: _nbytes(a[0])),
    "gather_": ("gather", lambda a: _nbytes(a[1])),
    "scatter_": ("scatter", lambda a: _nbytes(a[0])),
    "barrier": ("barrier", lambda a: 0),
    "monitored_barrier_": ("barrier", lambda a: 0),
    "send": ("send", lambda a: _nbytes(a[0])),
    "recv_": ("recv", lambda a: _nbytes(a[0])),
    "recv_any_source_": ("recv", lambda a: _nbytes(a[0])),
}

_RULES: dict | None = None  # OpOverload -> (kind, bytes rule, index of the group argument)


def _rules() -> dict:
    """Every overload of the known operators that this torch has, with the position of its group argument."""
    global _RULES
    if _RULES is not None:
        return _RULES
    import torch

    rules = {}
    for namespace, table in (("_c10d_functional", _FUNCTIONAL), ("_c10d_functional_autograd", _FUNCTIONAL),
                             ("c10d", _C10D)):
        ops = getattr(torch.ops, namespace)
        for name, (kind, size) in table.items():
            try:
                packet = getattr(ops, name)
            except (AttributeError, RuntimeError):  # not in this torch (or not built with distributed)
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                args = op._schema.arguments
                where = [i for i, a in enumerate(args)
                         if a.name in ("group_name", "process_group") or "ProcessGroup" in str(a.type)]
                if where:
                    rules[op] = (kind, size, where[0])
    _RULES = rules
    return rules


def group_name_of(group) -> str | None:
    """The name of a process group as an operator carries it: a string (functional collectives), a
    ``torch.ScriptObject`` boxing a ``ProcessGroup`` (c10d operators) or a ``ProcessGroup``; None otherwise."""
    if isinstance(group, str):
        return group
    import torch
    import torch.distributed as dist

    if isinstance(group, torch.ScriptObject):
        try:
            group = dist.ProcessGroup.unbox(group)
        except (RuntimeError, TypeError):
            return None
    return getattr(group, "group_name", None)


def collective_of(func, args) -> tuple[str, str | None, int] | None:
    """``(kind, group name, bytes)`` when ``func`` (an ``OpOverload`` a dispatch mode received with ``args``) is a
    collective, else None. ``kind`` is one of :data:`KINDS`; bytes as nccl-tests' S (see the tables above)."""
    rule = _rules().get(func)
    if rule is None:
        return None
    kind, size, at = rule
    return kind, group_name_of(args[at]) if at < len(args) else None, size(args)


def collective_mode(on_collective):
    """A ``TorchDispatchMode`` that calls ``on_collective(kind, group_name, nbytes)`` for every collective
    issued while it is active (on any thread autograd runs the backward on), and otherwise passes every op
    through unchanged. Ops on a ``DTensor`` are handed back (``NotImplemented``) so that DTensor issues its
    collectives first. Enter it with :func:`enter_mode`, leave it with :func:`exit_mode`."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    rules, plain = _rules(), torch.Tensor

    class CollectiveMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for t in types:
                if t is not plain and issubclass(t, DTensor):
                    return NotImplemented
            rule = rules.get(func)
            if rule is not None:
                kind, size, at = rule
                on_collective(kind, group_name_of(args[at]) if at < len(args) else None, size(args))
            return func(*args, **(kwargs or {}))

    return CollectiveMode()


def in_autograd_backward() -> bool:
    """Whether this thread is running autograd's backward now (a graph task: hooks, the engine's queued final
    callbacks). Reads ``torch._C._current_graph_task_id()`` (-1 outside; private, torch 2.13): it tells a
    collective that a backward issues (gradient synchronisation) from one issued between the forward and
    ``backward()`` (a loss normalisation's all-reduce)."""
    import torch

    return torch._C._current_graph_task_id() != -1


def enter_mode(mode) -> None:
    """Push ``mode`` on this thread's dispatch mode stack (``TorchDispatchMode.__enter__``)."""
    mode.__enter__()


def exit_mode(mode) -> bool:
    """Pop ``mode`` if it is the innermost active dispatch mode of this thread; returns whether it was. A mode
    entered after it and still active is left alone (popping it would break its owner), and so is ``mode``."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not mode:
        return False
    mode.__exit__(None, None, None)
    return True
