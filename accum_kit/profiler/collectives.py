"""FSDP2's collectives, recorded: every all-gather and reduce-scatter of every unit.

FSDP2 (``torch.distributed.fsdp.fully_shard``) has no comm hook; instead each
``FSDPModule`` accepts objects that perform its collectives,
``set_custom_all_gather`` and ``set_custom_reduce_scatter`` (PyTorch docs,
"torch.distributed.fsdp.fully_shard", the ``FSDPModule`` API). An object
must allocate the buffers (``allocate``) and run the collective
(``__call__``). :class:`CollectiveRecorder` installs, on every unit, a
recording object that wraps the one the unit had (FSDP2's default calls
``torch.distributed.all_gather_single`` / ``reduce_scatter_single``; a
user's custom object is wrapped just the same), as :class:`BucketRecorder`
wraps a DDP comm hook.

Under HSDP FSDP2 then all-reduces each reduce-scattered shard across the
replicate group with a plain ``torch.distributed.all_reduce`` call, which has
no such extension point: :class:`CollectiveRecorder` wraps that function
while it is registered and records the calls made on a unit's replicate
group (the loop's own all-reduces run on the whole world and pass through
unrecorded).

Each unit's post-backward hook (FSDP2's whole gradient reduction path:
copy-in, divide, reduce-scatter, storing or adding the new shard into the
sharded gradient, HSDP's all-reduce) is timed as well, one
:class:`PostBackwardTime` per unit and backward, marked ``reduced`` when the
unit reduced its gradients; the estimated saving of ``no_sync``
(:mod:`.sharded`) is built on it.

Timing: on CPU (gloo) FSDP2 calls both collectives synchronously
(``async_op=False``): the call returns when the data is there, so the
seconds are those of the call. An asynchronous call's completion is taken
from its ``Work`` future. On CUDA the call only enqueues work on FSDP2's
communication stream, so CUDA events recorded on that stream around it give
the seconds, read when the records are read (written to the same
interface; this project's machines have no GPU, so that path is unverified).
"""

from __future__ import annotations

import threading
import time

from .records import KEEP_RECORDS, CollectiveCall, Labels, PostBackwardTime, recent


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Recording:
    """The part shared by the all-gather and reduce-scatter wrappers: allocation and timing."""

    kind = ""

    def __init__(self, inner, recorder: "CollectiveRecorder", unit: int):
        self.inner, self.recorder, self.unit = inner, recorder, unit

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    group = "shard"

    def _run(self, size_tensor, call, async_op: bool):
        rec = self.recorder
        if not rec.labels.enabled:
            return call()
        lab = rec.labels
        fields = dict(kind=self.kind, step=lab.step, micro_batch=lab.micro_batch, mode=lab.mode, tag=lab.tag,
                      unit=self.unit, bytes=_nbytes(size_tensor), group=self.group)
        if size_tensor.is_cuda:
            import torch

            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fields["start"] = time.perf_counter()
            begin.record()
            work = call()
            end.record()
            rec.add_pending(fields, begin, end)
            return work
        start = fields["start"] = time.perf_counter()
        work = call()
        if async_op and work is not None and hasattr(work, "get_future"):
            work.get_future().then(lambda _: rec.add(CollectiveCall(**fields, seconds=time.perf_counter() - start)))
        else:
            rec.add(CollectiveCall(**fields, seconds=time.perf_counter() - start))
        return work


def recording_all_gather(inner, recorder: "CollectiveRecorder", unit: int):
    """An FSDP2 ``AllGather`` that calls ``inner`` and records the call (size: the gathered output)."""
    from ..compat import fsdp_comm_interfaces

    AllGather, _ = fsdp_comm_interfaces()

    class RecordingAllGather(_Recording, AllGather):
        kind = "all_gather"

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            return self._run(output_tensor, lambda: self.inner(output_tensor=output_tensor, input_tensor=input_tensor,
                                                               group=group, async_op=async_op), async_op)

    return RecordingAllGather(inner, recorder, unit)


def recording_reduce_scatter(inner, recorder: "CollectiveRecorder", unit: int):
    """An FSDP2 ``ReduceScatter`` that calls ``inner`` and records the call (size: the full input)."""
    from ..compat import fsdp_comm_interfaces

    _, ReduceScatter = fsdp_comm_interfaces()

    class RecordingReduceScatter(_Recording, ReduceScatter):
        kind = "reduce_scatter"

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            return self._run(input_tensor, lambda: self.inner(output_tensor=output_tensor, input_tensor=input_tensor,
                                                              group=group, op=op, async_op=async_op), async_op)

    return RecordingReduceScatter(inner, recorder, unit)


class _ReplicateAllReduce(_Recording):
    """``torch.distributed.all_reduce`` while registered: records the calls on a replicate group (HSDP)."""

    kind, group = "all_reduce", "replicate"

    def __init__(self, inner, recorder: "CollectiveRecorder", groups: list):
        super().__init__(inner, recorder, unit=-1)
        self.groups = groups

    def __call__(self, tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        if not any(group is g for g in self.groups):
            return self.inner(tensor, *args, **kwargs)
        async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        return self._run(tensor, lambda: self.inner(tensor, *args, **kwargs), async_op)


class CollectiveRecorder:
    """Records one :class:`CollectiveCall` per FSDP2 all-gather and reduce-scatter of a model (and HSDP all-reduce),
    and one :class:`PostBackwardTime` per unit and backward.

    Args:
        labels: the shared :class:`Labels` stamped on every record; with
            ``labels.enabled`` False calls go straight to the wrapped objects.
        keep_records: raw records kept, the most recent (None: all).
        sink: called with every new record (the profiler's running aggregates), or None.

    Attributes:
        units: one dict per unit after :meth:`register`: ``name`` (module path,
            ``""`` for the root), ``parameters`` (elements, unsharded) and
            ``reshard_after_forward`` (read again by :meth:`unit_info`, since
            FSDP2 settles the root's at the first forward).
    """

    def __init__(self, labels: Labels, keep_records: int | None = KEEP_RECORDS, sink=None):
        self.labels, self.sink = labels, sink
        self._calls = recent(keep_records)
        self._post_backwards = recent(keep_records)
        self._pending: list = []  # CUDA: (fields, begin event, end event)
        self._lock = threading.Lock()
        self._groups: list = []
        self._replicate_groups: list = []  # HSDP: the units' replicate process groups
        self._all_reduce = None  # the installed _ReplicateAllReduce (HSDP)

    def register(self, model) -> int:
        """Wrap the collectives of every unit of the FSDP2 ``model``; returns the number of units.

        Raises:
            ValueError: ``model`` has no FSDP2 unit.
        """
        from ..compat import fsdp_replicate_process_group, fsdp_unit_comms, fsdp_units, wrap_fsdp_post_backward

        units = fsdp_units(model)
        if not units:
            raise ValueError("the model has no FSDP2 unit: prepare it under an FSDP2 config "
                             "(accelerate_configs/cpu_fsdp.yaml or gpu_fsdp.yaml)")
        for index, (module, group) in enumerate(units):
            gather, scatter = fsdp_unit_comms(group)
            module.set_custom_all_gather(recording_all_gather(gather, self, index))
            module.set_custom_reduce_scatter(recording_reduce_scatter(scatter, self, index))
            wrap_fsdp_post_backward(group, lambda inner, index=index, group=group: self._timed(inner, index, group))
        self._groups = [group for _, group in units]
        self._replicate_groups = [g for g in map(fsdp_replicate_process_group, self._groups) if g is not None]
        self.hook_all_reduce()
        return len(units)

    def _timed(self, inner, unit: int, group):
        """``inner`` (a unit's post-backward hook), recording one :class:`PostBackwardTime` per call."""
        from ..compat import fsdp_unit_reduces_gradients

        def post_backward(*args, **kwargs):
            lab = self.labels
            if not lab.enabled:
                return inner(*args, **kwargs)
            reduced = fsdp_unit_reduces_gradients(group)  # read before: the hook does not change it
            start, cpu = time.perf_counter(), time.process_time()
            out = inner(*args, **kwargs)
            self.add(PostBackwardTime(step=lab.step, micro_batch=lab.micro_batch, mode=lab.mode, tag=lab.tag,
                                      unit=unit, reduced=reduced, start=start, seconds=time.perf_counter() - start,
                                      cpu_seconds=time.process_time() - cpu))
            return out

        return post_backward

    def hook_all_reduce(self) -> None:
        """Under HSDP, wrap ``torch.distributed.all_reduce`` to record the replicate-group calls (idempotent)."""
        import torch.distributed as dist

        if self._replicate_groups and self._all_reduce is None:
            self._all_reduce = _ReplicateAllReduce(dist.all_reduce, self, self._replicate_groups)
            dist.all_reduce = self._all_reduce

    def unregister(self) -> None:
        """Give ``torch.distributed.all_reduce`` back (HSDP), unless something wrapped it after us."""
        import torch.distributed as dist

        if self._all_reduce is not None and dist.all_reduce is self._all_reduce:
            dist.all_reduce = self._all_reduce.inner
        self._all_reduce = None

    @property
    def groups(self) -> list:
        """The FSDP2 units' parameter groups (``FSDPParamGroup``), in module order; empty before :meth:`register`."""
        return list(self._groups)

    def unit_info(self) -> list[dict]:
        """Per unit: ``name``, ``parameters`` (elements, unsharded), ``trainable_parameters`` (those that require a
        gradient: fewer under LoRA), ``reshard_after_forward`` (now)."""
        from ..compat import (fsdp_reshards_after_forward, fsdp_unit_name, fsdp_unit_parameters,
                              fsdp_unit_trainable_parameters)

        return [{"name": fsdp_unit_name(g), "parameters": fsdp_unit_parameters(g),
                 "trainable_parameters": fsdp_unit_trainable_parameters(g),
                 "reshard_after_forward": fsdp_reshards_after_forward(g)} for g in self._groups]

    def add(self, call: CollectiveCall | PostBackwardTime) -> None:
        """Keep ``call`` among the recent records (of its kind) and pass it to the sink."""
        with self._lock:
            (self._post_backwards if isinstance(call, PostBackwardTime) else self._calls).append(call)
        if self.sink is not None:
            self.sink(call)

    def add_pending(self, fields: dict, begin, end) -> None:
        with self._lock:
            self._pending.append((fields, begin, end))

    def flush(self) -> None:
        """Turn the CUDA-timed calls into records, waiting for their end events; until then neither the records
        nor the sink (the profiler's aggregates, which its summary reads) hold them. The profiler flushes at
        every optimizer step and before a summary."""
        with self._lock:
            pending, self._pending = self._pending, []
        for fields, begin, end in pending:
            end.synchronize()
            self.add(CollectiveCall(**fields, seconds=begin.elapsed_time(end) / 1000))

    @property
    def calls(self) -> list[CollectiveCall]:
        """The most recent recorded collectives (``keep_records`` of them; a copy); waits for pending CUDA ones."""
        self.flush()
        with self._lock:
            return list(self._calls)

    @property
    def post_backwards(self) -> list[PostBackwardTime]:
        """The most recent post-backward hook records (``keep_records`` of them; a copy)."""
        with self._lock:
            return list(self._post_backwards)
