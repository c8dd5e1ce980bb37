"""DeepSpeed's collectives, recorded: every call its ZeRO optimizer and engine make through ``deepspeed.comm``.

Every collective DeepSpeed issues (``deepspeed.comm.all_reduce``,
``reduce_scatter_fn``, ``allgather_fn``, ...) ends in a method of one object,
the communication backend ``deepspeed.comm.comm.cdb`` (a ``TorchBackend``
that calls ``torch.distributed``, DeepSpeed 0.19.8). :class:`ZeroRecorder`
wraps those methods on that object while registered, so each call becomes a
:class:`accum_kit.profiler.records.CollectiveCall` labelled with the loop's
step and micro-batch, as FSDP2's are; the loop's own scalar all-reduces go to
``torch.distributed`` through Accelerate and are not recorded. The backend
binds ``torch.distributed.all_gather_into_tensor`` when it is built, so a
wrapper at the ``torch.distributed`` level would miss ZeRO's all-gathers.

DeepSpeed's own comms logger (``"comms_logger": {"enabled": true}`` in the
config) was not used: it keeps totals per operation name and message size
for the whole run, with no step or micro-batch, and must be enabled before
``deepspeed.initialize``.

Summary (:func:`zero_summary`), per optimizer step over the records kept:
calls, bytes (nccl-tests' S: the whole buffer, i.e. the all-reduced tensor,
the all-gather's output, the reduce-scatter's input) and seconds per kind,
and the bus bandwidth (``algbw (n-1)/n``, all-reduce ``2 algbw (n-1)/n``,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
On CPU (gloo) the calls are synchronous, so their seconds are the call's.

The reduction path (:meth:`ZeroRecorder.watch`). The collectives are only
part of what a ZeRO stage spends on reducing gradients: ZeRO-2's gradient
hook copies every parameter's gradient into the reduction bucket after every
backward, the bucket is flattened and all-reduced, the reduced bucket is
copied into this process's partition and ``.grad`` is dropped (measured on
``small``, K=8, 2 gloo processes: the collectives were about a third of
what ZeRO-2 spent beyond ZeRO-1). So the recorder also times the ZeRO
optimizer's reduction entry points
(:data:`accum_kit.compat.deepspeed_internals.ZERO_REDUCTION_METHODS`: the
hook's body, ZeRO-1's boundary reduction and the end-of-backward flush),
outermost calls only (they call each other), the collectives inside them
included. ``reduction_seconds_per_step`` is that time per optimizer step;
what one stage saves over another is the difference of theirs (ZeRO-1 runs
the same path once per window, ZeRO-2 once per micro-batch).
"""

from __future__ import annotations

import time

from ..engines.bandwidth import bus_bandwidth
from .records import KEEP_RECORDS, CollectiveCall, recent

#: backend method -> (kind, position and keyword of the tensor whose size is S)
METHODS = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "all_reduce_coalesced": ("all_reduce", 0, "tensors"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input_tensor"),
    "reduce_scatter": ("reduce_scatter", 1, "input_list"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),
    "broadcast": ("broadcast", 0, "tensor"),
    "reduce": ("reduce", 0, "tensor"),
    "all_to_all_single": ("all_to_all", 0, "output"),
}
GROUP = "shard"  # ZeRO partitions over the whole data-parallel world: FSDP2's one mesh dimension


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if hasattr(t, "numel") else 0


class ZeroRecorder:
    """Wraps the DeepSpeed communication backend's collective methods and adds a record per call.

    Args:
        labels: the profiler's shared :class:`accum_kit.profiler.records.Labels`.
        keep_records: raw records kept, the most recent (None: all). They are kept
            here, not in the running aggregates, whose kinds are DDP's and FSDP2's.
    """

    def __init__(self, labels, keep_records: int | None = KEEP_RECORDS):
        self.labels, self._saved = labels, {}
        self._calls = recent(keep_records)
        self._reductions = recent(keep_records)
        self._inside = recent(keep_records)  # the collective records made inside the reduction path
        self._optimizers: list = []  # ZeRO optimizers whose reduction path is timed (see :meth:`watch`)
        self._depth = 0  # nesting of reduction-path calls: only the outermost is recorded

    @property
    def reductions(self) -> list:
        """The most recent reduction-path records (``kind == "reduction"``, ``bytes`` 0; a copy)."""
        return list(self._reductions)

    @property
    def inside_reduction(self) -> list:
        """The most recent collective records that ran inside a watched reduction path (a copy)."""
        return list(self._inside)

    def watch(self, optimizer) -> None:
        """Time ``optimizer``'s gradient reduction path while registered (an engine's ZeRO optimizer;
        idempotent). See the module docstring."""
        if optimizer is not None and all(o is not optimizer for o in self._optimizers):
            self._optimizers.append(optimizer)
            if self._saved:
                self._wrap_reduction(optimizer)

    def _wrap_reduction(self, optimizer) -> None:
        from ..compat import zero_reduction_methods

        for name in zero_reduction_methods(optimizer):
            if name not in vars(optimizer):  # not wrapped yet (the instance attribute hides the class's method)
                setattr(optimizer, name, self._timed(getattr(optimizer, name)))

    def _timed(self, inner):
        add = self._reductions.append

        def call(*args, **kwargs):
            lab = self.labels
            if not lab.enabled or self._depth:
                return inner(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._depth -= 1
                add(CollectiveCall(kind="reduction", step=lab.step, micro_batch=lab.micro_batch, mode=lab.mode,
                                   tag=lab.tag, unit=-1, bytes=0, group=GROUP, start=start,
                                   seconds=time.perf_counter() - start))
        return call

    @property
    def calls(self) -> list:
        """The most recent records (a copy)."""
        return list(self._calls)

    def register(self) -> None:
        """Wrap the backend's methods (idempotent).

        Raises:
            RuntimeError: DeepSpeed's communication backend is not initialised (prepare the model first).
        """
        from ..compat import deepspeed_comm_backend

        backend = deepspeed_comm_backend()
        if self._saved:
            return
        for name, (kind, pos, key) in METHODS.items():
            inner = getattr(backend, name, None)
            if inner is not None:
                self._saved[name] = inner
                setattr(backend, name, self._wrap(inner, kind, pos, key))
        self._backend = backend
        for optimizer in self._optimizers:
            self._wrap_reduction(optimizer)

    def unregister(self) -> None:
        """Give the backend and the watched optimizers their own methods back."""
        from ..compat import zero_reduction_methods

        for name in self._saved:
            try:
                delattr(self._backend, name)  # the instance attribute hides the class's method
            except AttributeError:
                pass
        for optimizer in self._optimizers:
            for name in zero_reduction_methods(optimizer):
                vars(optimizer).pop(name, None)
        self._saved = {}

    def _wrap(self, inner, kind, pos, key):
        calls, inside = self._calls.append, self._inside.append

        def add(record):
            calls(record)
            if self._depth:
                inside(record)

        def call(*args, **kwargs):
            lab = self.labels
            if not lab.enabled:
                return inner(*args, **kwargs)
            t = kwargs[key] if key in kwargs else (args[pos] if len(args) > pos else None)
            start = time.perf_counter()
            work = inner(*args, **kwargs)
            fields = dict(kind=kind, step=lab.step, micro_batch=lab.micro_batch, mode=lab.mode, tag=lab.tag,
                          unit=-1, bytes=_nbytes(t), group=GROUP, start=start)
            if work is not None and hasattr(work, "get_future"):  # async: done when its future completes
                work.get_future().then(lambda _: add(CollectiveCall(**fields, seconds=time.perf_counter() - start)))
            else:
                add(CollectiveCall(**fields, seconds=time.perf_counter() - start))
            return work
        return call


def zero_summary(calls: list, *, steps: int, world_size: int, stage: int, reductions: list = (),
                 inside: list = ()) -> dict:
    """Per-kind figures of one process's DeepSpeed records (see the module docstring).

    Args:
        calls: the :class:`CollectiveCall` records of one mode.
        steps: optimizer steps they cover (per-step figures divide by it; 0 gives totals).
        world_size: n of the bus bandwidth.
        stage: the ZeRO stage (reported).
        reductions: the reduction-path records of the same mode (:meth:`ZeroRecorder.watch`).
        inside: the collective records of the same mode made inside the reduction path.

    Returns:
        ``{"zero_stage": int, "by_kind": {kind: {"calls_per_step", "bytes_per_step",
        "seconds_per_step", "busbw_GBps"}}, "collective_seconds_per_step": float,
        "reduction_seconds_per_step": float, "reduction_calls_per_step": float,
        "reduction_path_collectives": {kind: calls per step}}`` (seconds:
        of the calls, summed; the reduction path's include its collectives).
    """
    per = max(steps, 1)
    by_kind: dict = {}
    for c in calls:
        k = by_kind.setdefault(c.kind, {"calls": 0, "bytes": 0, "seconds": 0.0})
        k["calls"] += 1
        k["bytes"] += c.bytes
        k["seconds"] += c.seconds
    out = {}
    for kind, k in sorted(by_kind.items()):
        busbw = (bus_bandwidth(k["bytes"] / k["seconds"] / 1e9, kind, world_size)
                 if k["seconds"] > 0 and world_size > 1 else None)
        out[kind] = {"calls_per_step": k["calls"] / per, "bytes_per_step": k["bytes"] / per,
                     "seconds_per_step": k["seconds"] / per, "busbw_GBps": busbw}
    return {"zero_stage": stage, "by_kind": out,
            "collective_seconds_per_step": sum(k["seconds_per_step"] for k in out.values()),
            "reduction_seconds_per_step": sum(r.seconds for r in reductions) / per,
            "reduction_calls_per_step": len(reductions) / per,
            "reduction_path_collectives": {kind: sum(c.kind == kind for c in inside) / per
                                           for kind in sorted({c.kind for c in inside})}}
