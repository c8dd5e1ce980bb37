"""The profiler's running aggregates: a whole run's figures in memory that does not grow with its length.

Every record goes through :meth:`RunningAggregates.add` as it is made. The
aggregates keep, per (mode, tag):

- per (collective kind, process group), kind one of ``"allreduce"`` (a DDP
  bucket or a loop's own all-reduce), ``"all_gather"``, ``"reduce_scatter"``,
  ``"all_reduce"`` (HSDP's across replicas):
  calls, and bytes and seconds as :class:`QuantileSketch` (count / sum / min /
  max exact, quantiles exact up to ``exact_limit`` calls, then estimated);
- FSDP2's post-backward hooks: per micro-batch, the units' hook seconds
  summed, sorted by what the micro-batch did (see :class:`Figures`'s
  ``pb_*``);
- what :class:`accum_kit.profiler.figures.Figures` needs: sketches of the
  phase times and of the per-sync and per-micro-batch figures, the busy time
  of the all-gathers, per-unit all-gather counts and seconds.

Groups of records are closed as the run moves on: a DDP sync when a call of
a later sync arrives; an FSDP2 micro-batch's collectives when its
micro-batch record arrives (at the end of its backward), or when more than
``open_limit`` micro-batches wait for theirs (then its per-micro-batch
figures are lost, its sync still counts). Collectives that arrive after
their micro-batch's record (e.g. an evaluation forward between steps, which
carries the last micro-batch's labels) count in the totals but not in that
micro-batch's compute time. Busy times are unions of intervals; an interval
arriving more than ``open_limit`` intervals out of start order is clipped
to the closed part's end. On the records of a short run the summaries equal
those of :func:`accum_kit.profiler.figures.from_records` (float rounding
aside), which the test suite checks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .figures import Figures
from .quantiles import EXACT_LIMIT, RELATIVE_ACCURACY, QuantileSketch
from .records import BucketCall, CollectiveCall, MicroBatchTimes, PostBackwardTime, StepTimes

#: The ``group`` of a record made over the whole world (every process).
WORLD = "world"


class IntervalUnion:
    """Length of the union of ``[lo, hi]`` intervals, in bounded memory.

    Keeps the last ``open_limit`` disjoint spans; older ones are folded into a
    closed total and later intervals are clipped to the closed part's end.
    Exact when every interval arrives less than ``open_limit`` spans out of order.
    """

    __slots__ = ("open_limit", "closed", "horizon", "spans")

    def __init__(self, open_limit: int = 64):
        self.open_limit, self.closed, self.horizon, self.spans = open_limit, 0.0, float("-inf"), []

    def add(self, lo: float, hi: float) -> None:
        lo = max(lo, self.horizon)
        if hi <= lo:
            return
        spans = self.spans
        if not spans or lo > spans[-1][1]:  # in start order, after the last span: the common case
            spans.append([lo, hi])
            if len(spans) > self.open_limit:
                a, b = spans.pop(0)
                self.closed, self.horizon = self.closed + b - a, b
            return
        if lo >= spans[-1][0]:  # overlaps the last span only
            spans[-1][1] = max(spans[-1][1], hi)
            return
        spans, merged = [], [lo, hi]
        for s in self.spans:
            if s[1] < merged[0] or s[0] > merged[1]:
                spans.append(s)
            else:
                merged = [min(s[0], merged[0]), max(s[1], merged[1])]
        spans.append(merged)
        spans.sort()
        while len(spans) > self.open_limit:
            a, b = spans.pop(0)
            self.closed += b - a
            self.horizon = b
        self.spans = spans

    def total(self) -> float:
        return self.closed + sum(b - a for a, b in self.spans)


@dataclass
class _Open:
    """The collectives of one micro-batch not yet closed (FSDP2), or the calls of one open DDP sync."""

    all_gather: IntervalUnion = field(default_factory=IntervalUnion)
    both: IntervalUnion = field(default_factory=IntervalUnion)
    ag_calls: int = 0
    rs_calls: int = 0
    rs_seconds: float = 0.0
    ar_calls: int = 0
    ar_seconds: float = 0.0
    pb_calls: int = 0
    pb_reduced: int = 0
    pb_seconds: float = 0.0
    pb_cpu: float | None = 0.0  # None once a record came without CPU time


class _Bin:
    """The aggregates of one (mode, tag)."""

    NAMES = ("busy_per_sync", "calls_per_sync", "forward", "backward_sync", "backward_no_sync", "backward_first",
             "backward_later", "optimizer", "step", "rs_per_sync", "rs_calls_per_sync", "ag_per_micro",
             "compute_no_sync", "compute_all", "ar_per_micro", "pb_sync", "pb_sync_adding", "pb_no_sync",
             "pb_sync_cpu", "pb_sync_adding_cpu", "pb_no_sync_cpu", "backward_first_cpu", "backward_later_cpu",
             "accumulate_first", "accumulate_later", "accumulate_first_cpu", "accumulate_later_cpu")

    def __init__(self, sketch):
        self.sketch = sketch
        self.s = {name: sketch() for name in self.NAMES}
        self.kinds: dict[tuple[str, str], tuple[QuantileSketch, QuantileSketch]] = {}  # (kind, group) -> bytes, seconds
        self.open_syncs: dict[int, IntervalUnion] = {}
        self.open_sync_calls: dict[int, int] = {}
        self.open_micro: dict[int, _Open] = {}
        self.ag_busy = IntervalUnion()
        self.ag_units: dict[int, QuantileSketch] = {}
        self.call_steps = self.collective_steps = 0
        self._last_call_step = self._last_collective_step = self._window = self._synced_window = None

    def kind(self, kind: str, group: str) -> tuple[QuantileSketch, QuantileSketch]:
        if (kind, group) not in self.kinds:
            self.kinds[(kind, group)] = (self.sketch(), self.sketch())
        return self.kinds[(kind, group)]


class RunningAggregates:
    """Whole-run aggregates of the profiler's records, in memory bounded whatever the run's length.

    Args:
        exact_limit: values each sketch keeps exactly (see :class:`QuantileSketch`).
        relative_accuracy: the sketches' quantile accuracy beyond that.
        open_limit: micro-batches waiting for their record before the oldest is closed.
    """

    def __init__(self, exact_limit: int = EXACT_LIMIT, relative_accuracy: float = RELATIVE_ACCURACY,
                 open_limit: int = 8):
        self._sketch = lambda: QuantileSketch(exact_limit, relative_accuracy)
        self.open_limit = open_limit
        self._bins: dict[tuple[str, str | None], _Bin] = {}
        self._lock = threading.Lock()

    def _bin(self, record) -> _Bin:
        key = (record.mode, record.tag)
        if key not in self._bins:
            self._bins[key] = _Bin(self._sketch)
        return self._bins[key]

    def add(self, record) -> None:
        """Fold one record in (thread-safe)."""
        with self._lock:
            b = self._bin(record)
            if isinstance(record, BucketCall):
                self._add_call(b, record)
            elif isinstance(record, CollectiveCall):
                self._add_collective(b, record)
            elif isinstance(record, PostBackwardTime):
                o = self._open(b, record.micro_batch)
                o.pb_calls += 1
                o.pb_reduced += record.reduced
                o.pb_seconds += record.seconds
                o.pb_cpu = None if (o.pb_cpu is None or record.cpu_seconds is None) else o.pb_cpu + record.cpu_seconds
            elif isinstance(record, MicroBatchTimes):
                self._add_micro_batch(b, record)
            elif isinstance(record, StepTimes):
                b.s["optimizer"].add(record.optimizer_seconds)
                b.s["step"].add(record.step_seconds)
            else:
                raise TypeError(f"not a profiler record: {type(record).__name__}")

    def _add_call(self, b: _Bin, c: BucketCall) -> None:
        nbytes, seconds = b.kind("allreduce", c.group)
        nbytes.add(c.bytes)
        seconds.add(c.seconds)
        if c.step != b._last_call_step:
            b.call_steps, b._last_call_step = b.call_steps + 1, c.step
        for done in [s for s in b.open_syncs if s < c.sync]:  # DDP finishes a sync's buckets before the next
            self._close_sync(b, done)
        b.open_syncs.setdefault(c.sync, IntervalUnion()).add(c.start, c.start + c.seconds)
        b.open_sync_calls[c.sync] = b.open_sync_calls.get(c.sync, 0) + 1

    @staticmethod
    def _close_sync(b: _Bin, sync: int) -> None:
        b.s["busy_per_sync"].add(b.open_syncs.pop(sync).total())
        b.s["calls_per_sync"].add(b.open_sync_calls.pop(sync))

    def _add_collective(self, b: _Bin, c: CollectiveCall) -> None:
        nbytes, seconds = b.kind(c.kind, c.group)
        nbytes.add(c.bytes)
        seconds.add(c.seconds)
        if c.step != b._last_collective_step:
            b.collective_steps, b._last_collective_step = b.collective_steps + 1, c.step
        o = self._open(b, c.micro_batch)
        o.both.add(c.start, c.start + c.seconds)
        if c.kind == "all_gather":
            o.all_gather.add(c.start, c.start + c.seconds)
            o.ag_calls += 1
            b.ag_busy.add(c.start, c.start + c.seconds)
            b.ag_units.setdefault(c.unit, self._sketch()).add(c.seconds)
        elif c.kind == "all_reduce":  # a reduce-scattered shard all-reduced across replicas (a 2-D mesh)
            o.ar_calls += 1
            o.ar_seconds += c.seconds
        else:
            o.rs_calls += 1
            o.rs_seconds += c.seconds

    def _open(self, b: _Bin, micro_batch: int) -> _Open:
        o = b.open_micro.get(micro_batch)
        if o is None:
            o = b.open_micro[micro_batch] = _Open()
            while len(b.open_micro) > self.open_limit:  # never closed by a micro-batch record
                self._close_micro(b, b.open_micro.pop(next(iter(b.open_micro))))
        return o

    @staticmethod
    def _close_micro(b: _Bin, o: _Open, m: MicroBatchTimes | None = None) -> None:
        if o.rs_calls:
            b.s["rs_per_sync"].add(o.rs_seconds)
            b.s["rs_calls_per_sync"].add(o.rs_calls)
        if o.ar_calls:
            b.s["ar_per_micro"].add(o.ar_seconds)
        if m is not None:
            work = m.forward_seconds + m.backward_seconds
            b.s["ag_per_micro"].add(o.ag_calls)
            b.s["compute_all"].add(work - o.both.total())
            if not m.sync:
                b.s["compute_no_sync"].add(work - o.all_gather.total())
            if o.pb_calls:  # a reduction adds to the shard held when the window already reduced once
                adding = bool(o.pb_reduced) and b._synced_window == m.step
                name = "pb_sync_adding" if adding else "pb_sync" if o.pb_reduced else "pb_no_sync"
                b.s[name].add(o.pb_seconds)
                if o.pb_cpu is not None:
                    b.s[f"{name}_cpu"].add(o.pb_cpu)
                if o.pb_reduced:
                    b._synced_window = m.step

    def _add_micro_batch(self, b: _Bin, m: MicroBatchTimes) -> None:
        b.s["forward"].add(m.forward_seconds)
        b.s["backward_sync" if m.sync else "backward_no_sync"].add(m.backward_seconds)
        first = m.step != b._window
        b._window = m.step
        if not m.sync:
            b.s["backward_first" if first else "backward_later"].add(m.backward_seconds)
            if m.backward_cpu_seconds is not None:
                b.s["backward_first_cpu" if first else "backward_later_cpu"].add(m.backward_cpu_seconds)
            if m.accumulate_seconds is not None:
                which = "first" if first else "later"
                b.s[f"accumulate_{which}"].add(m.accumulate_seconds)
                b.s[f"accumulate_{which}_cpu"].add(m.accumulate_cpu_seconds)
        self._close_micro(b, b.open_micro.pop(m.micro_batch, None) or _Open(), m)

    # ---- reading -----------------------------------------------------------------------
    def _selected(self, mode, tag) -> list[_Bin]:
        return [b for (m, t), b in self._bins.items() if (mode is None or m == mode) and (tag is None or t == tag)]

    def figures(self, *, mode: str | None = None, tag: str | None = None) -> Figures:
        """The :class:`Figures` of the records of one ``mode`` and / or ``tag`` (None: any), open groups included."""
        with self._lock:
            bins = self._selected(mode, tag)
            s = {name: self._sketch() for name in _Bin.NAMES}
            out = Figures()
            units: dict[int, QuantileSketch] = {}
            for b in bins:
                extra = {name: self._sketch() for name in ("busy_per_sync", "calls_per_sync", "rs_per_sync",
                                                           "rs_calls_per_sync", "ar_per_micro")}
                for sync, union in b.open_syncs.items():  # groups still open count as they stand
                    extra["busy_per_sync"].add(union.total())
                    extra["calls_per_sync"].add(b.open_sync_calls[sync])
                for o in b.open_micro.values():
                    if o.rs_calls:
                        extra["rs_per_sync"].add(o.rs_seconds)
                        extra["rs_calls_per_sync"].add(o.rs_calls)
                    if o.ar_calls:
                        extra["ar_per_micro"].add(o.ar_seconds)
                for name in _Bin.NAMES:
                    s[name] = s[name].merge(b.s[name])
                    if name in extra:
                        s[name] = s[name].merge(extra[name])
                for (kind, _group), (nbytes, seconds) in b.kinds.items():
                    prefix = {"allreduce": "allreduce", "all_gather": "ag", "reduce_scatter": "rs",
                              "all_reduce": "ar"}[kind]
                    setattr(out, f"{prefix}_calls", getattr(out, f"{prefix}_calls") + nbytes.count)
                    setattr(out, f"{prefix}_bytes", getattr(out, f"{prefix}_bytes") + int(nbytes.sum))
                    setattr(out, f"{prefix}_seconds", getattr(out, f"{prefix}_seconds") + seconds.sum)
                out.call_steps += b.call_steps
                out.collective_steps += b.collective_steps
                out.ag_busy_seconds += b.ag_busy.total()
                for unit, sk in b.ag_units.items():
                    units[unit] = units[unit].merge(sk) if unit in units else sk.merge(self._sketch())
            out.syncs, out.busy_seconds = s["busy_per_sync"].count, s["busy_per_sync"].sum
            out.seconds_per_sync, out.calls_per_sync = s["busy_per_sync"].median(), s["calls_per_sync"].median()
            out.optimizer_steps, out.micro_batches = s["step"].count, s["forward"].count
            out.no_sync_micro_batches = s["backward_no_sync"].count
            for name in ("forward", "backward_sync", "backward_no_sync", "backward_first", "backward_later",
                         "optimizer", "step", "compute_no_sync", "compute_all", "accumulate_first", "accumulate_later",
                         "accumulate_first_cpu", "accumulate_later_cpu"):
                setattr(out, name, s[name].median())
            out.rs_syncs, out.rs_seconds_per_sync = s["rs_per_sync"].count, s["rs_per_sync"].median()
            out.rs_calls_per_sync = s["rs_calls_per_sync"].median()
            out.ag_calls_per_micro_batch = s["ag_per_micro"].median()
            out.ag_per_unit = {u: (sk.count, sk.median()) for u, sk in units.items()}
            out.ar_micro_batches, out.ar_seconds_per_micro = s["ar_per_micro"].count, s["ar_per_micro"].median()
            for name in ("pb_sync", "pb_sync_adding", "pb_no_sync",
             "pb_sync_cpu", "pb_sync_adding_cpu", "pb_no_sync_cpu", "backward_first_cpu", "backward_later_cpu"):
                setattr(out, f"{name}_micro_batches", s[name].count)
                setattr(out, name, s[name].median())
            return out

    def table(self) -> list[dict]:
        """One row per (kind, mode, tag, group): ``calls``, and ``bytes`` / ``seconds`` as
        :meth:`QuantileSketch.describe` (count, sum, min, max, p50, p90, exact)."""
        with self._lock:
            return [{"kind": kind, "mode": mode, "tag": tag, "group": group, "calls": nbytes.count,
                     "bytes": nbytes.describe(), "seconds": seconds.describe()}
                    for (mode, tag), b in self._bins.items() for (kind, group), (nbytes, seconds) in b.kinds.items()]
