"""Averaging gradients by hand, as forum answers and the PyTorch tutorial do, instead of DDP.

The PyTorch tutorial "Writing Distributed Applications with PyTorch"
(https://pytorch.org/tutorials/intermediate/dist_tuto.html, section
"Distributed Training") averages gradients after ``loss.backward()`` with one
``dist.all_reduce(param.grad, op=SUM)`` and ``param.grad /= world_size`` per
parameter: :func:`allreduce_per_parameter`. :func:`allreduce_flat` sends the
same numbers in one collective per dtype, by flattening every gradient into
one buffer first (what DDP's buckets and ``torch._utils._flatten_dense_tensors``
coalescing do). With gradient accumulation both run once per window, after
the last micro-batch's backward, so neither overlaps any computation; DDP
all-reduces its buckets while the backward still runs.

Either one, passed to :func:`accum_kit.reference.raw_ddp.train_raw_ddp` as
``average_gradients`` with a plain (not DDP-wrapped) model, gives the same
gradients as DDP's average, hence the same update (``accum-kit bench`` modes
``manual_allreduce`` and ``manual_allreduce_flat``; ``docs/allreduce.md``).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch
import torch.distributed as dist

#: ``on_call(nbytes, start, seconds, last)``: told about every all-reduce (bytes sent per process,
#: ``time.perf_counter`` start, seconds until it returned, True for the last one of this sync).
OnCall = Callable[[int, float, float, bool], None]


def _timed_allreduce(tensor: torch.Tensor, world: int, on_call: OnCall | None, last: bool) -> None:
    start = time.perf_counter()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # synchronous: returns when every process has the sum
    seconds = time.perf_counter() - start
    tensor.div_(world)
    if on_call is not None:
        on_call(tensor.numel() * tensor.element_size(), start, seconds, last)


def allreduce_per_parameter(parameters: Iterable[torch.nn.Parameter], on_call: OnCall | None = None) -> int:
    """Average every parameter's ``.grad`` over the processes: one all-reduce (SUM, then ``/= world``) each.

    Args:
        parameters: the model's parameters; those whose ``.grad`` is None are skipped.
        on_call: optional ``on_call(nbytes, start, seconds, last)`` per all-reduce (for a profiler).

    Returns:
        The number of all-reduce calls made (= parameter tensors with a gradient).

    Raises:
        RuntimeError: no default process group (``torch.distributed.init_process_group`` not called).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    world = dist.get_world_size()
    for i, g in enumerate(grads):
        _timed_allreduce(g, world, on_call, last=i == len(grads) - 1)
    return len(grads)


def allreduce_flat(parameters: Iterable[torch.nn.Parameter], on_call: OnCall | None = None) -> int:
    """Average every ``.grad`` over the processes with one all-reduce per (device, dtype) of a flat buffer.

    The gradients are copied into one contiguous buffer (``torch.cat`` of
    their flattened views), all-reduced (SUM, then ``/= world``) and copied
    back; that costs two gradient-sized copies and one buffer of memory,
    against one collective per parameter for :func:`allreduce_per_parameter`.

    Args:
        parameters: the model's parameters; those whose ``.grad`` is None are skipped.
        on_call: optional ``on_call(nbytes, start, seconds, last)`` per all-reduce.

    Returns:
        The number of all-reduce calls made (1 for a model of one dtype on one device).

    Raises:
        RuntimeError: no default process group.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    world = dist.get_world_size()
    for i, grads in enumerate(groups.values()):
        flat = torch.cat([g.reshape(-1) for g in grads])
        _timed_allreduce(flat, world, on_call, last=i == len(groups) - 1)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(groups)


#: ``accum-kit bench`` mode -> the function that averages the gradients.
MANUAL_MODES = {"manual_allreduce": allreduce_per_parameter, "manual_allreduce_flat": allreduce_flat}
