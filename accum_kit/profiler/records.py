"""The profiler's plain records, and the labels every new record is stamped with.

Five kinds of record, one per event the profiler sees (all times in seconds,
from ``time.perf_counter``; sizes in bytes):

- :class:`BucketCall`: one gradient bucket's all-reduce (the DDP comm hook);
- :class:`CollectiveCall`: one FSDP2 all-gather or reduce-scatter (a unit's collective);
- :class:`PostBackwardTime`: one FSDP2 unit's post-backward hook (its gradient reduction path);
- :class:`MicroBatchTimes`: forward and backward of one micro-batch;
- :class:`StepTimes`: one optimizer step.

Each carries the ``mode`` (``"no_sync"`` or ``"sync_each_batch"``, what the
A/B switch sets) and the free-form ``tag`` (a run label, None by default)
that were current when it was recorded, so one profiler can hold several
runs or modes and :meth:`ProfileRecords.select` can keep them apart.
No torch here: the report works on these records alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: Raw records of each kind a profiler keeps by default (the most recent ones; the
#: whole run's figures come from running aggregates, see :mod:`.aggregates`).
KEEP_RECORDS = 1024


def recent(keep: int | None) -> deque:
    """The store of one kind of raw record: the last ``keep`` records (None: every record, for short runs).

    Raises:
        ValueError: ``keep`` below 1.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep_records must be a positive integer or None (got {keep!r})")
    return deque(maxlen=keep)


#: The two values of ``mode``: Accelerate's ``sync_each_batch`` flag off / on.
MODES = ("no_sync", "sync_each_batch")


@dataclass
class Labels:
    """What the recorders stamp on every new record; shared by the bucket recorder and the phase timer.

    ``step`` and ``micro_batch`` are the loop's counters (optimizer steps done,
    micro-batches done on this process), updated by the phase timer at each
    micro-batch; they stay 0 when the profiler is used outside a loop.
    ``enabled`` False makes every recorder skip its records and timers.
    """

    mode: str = "no_sync"
    tag: str | None = None
    step: int = 0
    micro_batch: int = 0
    enabled: bool = True


@dataclass
class BucketCall:
    """One gradient bucket all-reduce.

    Attributes:
        step, micro_batch: the loop's counters when DDP handed the bucket over.
        sync: index of the synchronised backward this bucket belongs to
            (0, 1, ...; a new one starts after DDP's last bucket).
        mode, tag: see :class:`Labels`.
        bucket: DDP's bucket index.
        bytes: the bucket's gradient size, ``numel x element size`` (a
            compression hook sends fewer over the wire).
        start: ``perf_counter`` seconds when the wrapped hook was called.
        seconds: from ``start`` to the completion of the all-reduce future.
        group: the process group it ran over: ``"world"`` (every process).
    """

    step: int
    micro_batch: int
    sync: int
    mode: str
    tag: str | None
    bucket: int
    bytes: int
    start: float
    seconds: float
    group: str = "world"


#: The kinds of :class:`CollectiveCall`.
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
#: The process groups a :class:`CollectiveCall` runs on: FSDP2's shard group (all its processes under
#: plain FSDP2), and under HSDP the replicate group its reduce-scattered gradients are all-reduced over.
GROUPS = ("shard", "replicate")


@dataclass
class CollectiveCall:
    """One FSDP2 collective of one unit (a ``fully_shard`` parameter group).

    Attributes:
        kind: ``"all_gather"`` (parameters, before a forward or backward),
            ``"reduce_scatter"`` (gradients, after a synchronised backward) or,
            under HSDP, ``"all_reduce"`` (a reduce-scattered gradient shard
            across the replicate group).
        step, micro_batch, mode, tag: see :class:`Labels` (``micro_batch``
            also tells which backward a reduce-scatter belongs to).
        unit: index of the unit in :func:`accum_kit.compat.fsdp_units` order.
        bytes: the size S of nccl-tests' bus-bandwidth definition: the whole
            buffer, i.e. the all-gather's output and the reduce-scatter's
            input (``numel x element size``), shard-group-size times one
            process's shard; the all-reduce's buffer (one shard).
        start: ``perf_counter`` seconds when the collective was called.
        seconds: from ``start`` to its completion.
        group: ``"shard"`` or ``"replicate"`` (:data:`GROUPS`): the mesh dimension it ran on
            (plain FSDP2's one dimension is ``"shard"``). The all-reduce's ``unit`` is -1 (FSDP2
            calls it without naming the unit).
    """

    kind: str
    step: int
    micro_batch: int
    mode: str
    tag: str | None
    unit: int
    bytes: int
    start: float
    seconds: float
    group: str = "shard"


@dataclass
class PostBackwardTime:
    """One FSDP2 unit's post-backward hook in one backward: the whole gradient reduction path of that unit.

    FSDP2 calls ``FSDPParamGroup.post_backward`` once per unit and backward. When the unit reduces
    gradients (``reduced``: a sync micro-batch) it copies the unsharded gradients into the reduce-scatter
    input, divides, reduce-scatters (the :class:`CollectiveCall` inside it), then stores the shard or ADDS it
    to the sharded gradient already held (every synchronised micro-batch after a window's first under
    ``sync_each_batch``), and under HSDP all-reduces it across replicas; when it does not (a deferred
    micro-batch under ``no_sync``) it only reshards. ``seconds``: the hook's wall time on the calling thread
    (on CUDA the reduction runs on side streams and this is the CPU time of launching it).

    Attributes:
        step, micro_batch, mode, tag: see :class:`Labels`.
        unit: index of the unit in :func:`accum_kit.compat.fsdp_units` order.
        reduced: the unit reduced its gradients in this call (``FSDPParamGroup.reduce_grads``).
        start: ``perf_counter`` seconds when the hook was entered.
        seconds: until it returned.
        cpu_seconds: the CPU time this process (all its threads, gloo's included) used meanwhile
            (``time.process_time``; None when not measured).
    """

    step: int
    micro_batch: int
    mode: str
    tag: str | None
    unit: int
    reduced: bool
    start: float
    seconds: float
    cpu_seconds: float | None = None


@dataclass
class MicroBatchTimes:
    """Forward and backward seconds of one micro-batch; ``sync``: its backward all-reduced.

    ``backward_cpu_seconds``: the CPU time this process (all its threads) used during the backward
    (``time.process_time``; None when not measured): the work, without waiting for other processes or
    for the cores other jobs hold. ``accumulate_seconds`` / ``accumulate_cpu_seconds``: the part of the
    backward autograd spent accumulating into FSDP2's unsharded gradients
    (:mod:`accum_kit.profiler.accumulation`; None when not timed: DDP, CUDA).
    """

    step: int
    micro_batch: int
    sync: bool
    mode: str
    tag: str | None
    forward_seconds: float
    backward_seconds: float
    backward_cpu_seconds: float | None = None
    accumulate_seconds: float | None = None
    accumulate_cpu_seconds: float | None = None


@dataclass
class StepTimes:
    """One optimizer step (``step`` = its index, from 0).

    ``optimizer_seconds``: from ``on_step_begin`` to ``on_step_end`` (window
    rescale, clipping, optimizer and scheduler step, ``zero_grad``);
    ``step_seconds``: from the end of the previous step to the end of this one;
    ``cpu_seconds``: the CPU time this process (all its threads) used in that
    span (``time.process_time``): the work done, without the time spent
    waiting for other processes or descheduled by other jobs on the machine.
    """

    step: int
    mode: str
    tag: str | None
    optimizer_seconds: float
    step_seconds: float
    cpu_seconds: float | None = None


@dataclass
class ProfileRecords:
    """The records of one process: bucket calls, micro-batches, optimizer steps, FSDP2 collectives and
    FSDP2 post-backward hooks."""

    calls: list[BucketCall] = field(default_factory=list)
    micro_batches: list[MicroBatchTimes] = field(default_factory=list)
    steps: list[StepTimes] = field(default_factory=list)
    collectives: list[CollectiveCall] = field(default_factory=list)
    post_backwards: list[PostBackwardTime] = field(default_factory=list)

    def select(self, *, mode: str | None = None, tag: str | None = None) -> "ProfileRecords":
        """The records of one ``mode`` and / or one ``tag``; None keeps every value of that field."""
        def keep(r) -> bool:
            return (mode is None or r.mode == mode) and (tag is None or r.tag == tag)

        return ProfileRecords([r for r in self.calls if keep(r)], [r for r in self.micro_batches if keep(r)],
                              [r for r in self.steps if keep(r)], [r for r in self.collectives if keep(r)],
                              [r for r in self.post_backwards if keep(r)])


def of_step(records: list, step: int) -> list:
    """The records of optimizer step ``step`` among ``records`` (in order), read from the newest back.

    ``records`` is any list of records with a ``step`` field, oldest first (what the recorders keep);
    reading stops at the first older step, so the cost does not grow with the run.
    """
    out = []
    for r in reversed(records):
        if r.step < step:
            break
        if r.step == step:
            out.append(r)
    return out[::-1]
