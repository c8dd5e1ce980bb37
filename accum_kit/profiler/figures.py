"""What the profiler's summaries are computed from: counts, sums and medians of one selection of records.

:class:`Figures` is the bridge between the records and the formulas of
:mod:`.report` (DDP) and :mod:`.sharded` (FSDP2). :func:`from_records`
computes it from a list of raw records (exact); the running aggregates of
:mod:`.aggregates` compute the same fields as the records arrive, in bounded
memory, so a run of any length keeps its whole-run summary.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ..stats import median
from .records import BucketCall, ProfileRecords


def busy_seconds(calls) -> float:
    """Length (seconds) of the union of the calls' ``[start, start + seconds]`` intervals."""
    total, end = 0.0, float("-inf")
    for c in sorted(calls, key=lambda c: c.start):
        lo, hi = c.start, c.start + c.seconds
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


@dataclass
class Figures:
    """Counts (int), sums (bytes, seconds) and medians (seconds; None: no sample) of one selection of records.

    DDP's bucket all-reduces: ``allreduce_calls``, ``allreduce_bytes``,
    ``allreduce_seconds``; ``syncs`` (groups of one sync index),
    ``seconds_per_sync`` (median busy time of a group), ``busy_seconds``
    (summed over groups), ``calls_per_sync`` (median); ``call_steps``
    (distinct steps among the calls). Phases: ``optimizer_steps``,
    ``micro_batches``, ``no_sync_micro_batches``; medians ``forward``,
    ``backward_sync``, ``backward_no_sync``, ``optimizer``, ``step``,
    ``backward_first`` / ``backward_later`` (no-sync micro-batches first in
    their window or not). FSDP2's collectives: ``rs_calls``, ``rs_bytes``,
    ``rs_seconds``, ``ag_calls``, ``ag_bytes``, ``ag_seconds``;
    ``collective_steps`` (distinct (tag, step)); ``rs_syncs`` (groups of one
    (tag, micro-batch)), ``rs_seconds_per_sync``, ``rs_calls_per_sync``
    (medians); ``ag_busy_seconds`` (union of all all-gathers);
    ``ag_per_unit`` ``{unit: (calls, median seconds per call)}``;
    ``ag_calls_per_micro_batch`` (median over micro-batches);
    ``compute_no_sync`` (median over no-sync micro-batches of forward +
    backward minus their all-gathers' busy time) and ``compute_all`` (over
    all micro-batches, minus all their collectives). HSDP's all-reduces across
    replicas: ``ar_calls``, ``ar_bytes``, ``ar_seconds``; ``ar_micro_batches``
    (micro-batches with one) and ``ar_seconds_per_micro`` (median of their
    all-reduce seconds). FSDP2's post-backward hooks, the units' seconds summed
    per micro-batch (medians; with their counts ``*_micro_batches``):
    ``pb_sync`` (micro-batches whose units reduced, the first of their window
    to do so: the new shard is stored), ``pb_sync_adding`` (reduced after an
    earlier micro-batch of the window did: the new shard is added to the one
    held, ``sync_each_batch``), ``pb_no_sync`` (no unit reduced); each also
    in CPU seconds of the process (``*_cpu``), with ``backward_first_cpu`` /
    ``backward_later_cpu`` (None where not measured). Autograd's accumulation into FSDP2's
    unsharded gradients (:mod:`.accumulation`), medians over the same two kinds of
    no-sync micro-batches: ``accumulate_first`` / ``accumulate_later`` and ``*_cpu``
    (None where not timed).
    """

    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    allreduce_seconds: float = 0.0
    syncs: int = 0
    seconds_per_sync: float | None = None
    busy_seconds: float = 0.0
    calls_per_sync: float | None = None
    call_steps: int = 0
    optimizer_steps: int = 0
    micro_batches: int = 0
    no_sync_micro_batches: int = 0
    forward: float | None = None
    backward_sync: float | None = None
    backward_no_sync: float | None = None
    backward_first: float | None = None
    backward_later: float | None = None
    optimizer: float | None = None
    step: float | None = None
    rs_calls: int = 0
    rs_bytes: int = 0
    rs_seconds: float = 0.0
    ag_calls: int = 0
    ag_bytes: int = 0
    ag_seconds: float = 0.0
    collective_steps: int = 0
    rs_syncs: int = 0
    rs_seconds_per_sync: float | None = None
    rs_calls_per_sync: float | None = None
    ag_busy_seconds: float = 0.0
    ag_per_unit: dict = field(default_factory=dict)
    ag_calls_per_micro_batch: float | None = None
    compute_no_sync: float | None = None
    compute_all: float | None = None
    ar_calls: int = 0
    ar_bytes: int = 0
    ar_seconds: float = 0.0
    ar_micro_batches: int = 0
    ar_seconds_per_micro: float | None = None
    pb_sync: float | None = None
    pb_sync_adding: float | None = None
    pb_no_sync: float | None = None
    pb_sync_micro_batches: int = 0
    pb_sync_adding_micro_batches: int = 0
    pb_no_sync_micro_batches: int = 0
    pb_sync_cpu: float | None = None
    pb_sync_adding_cpu: float | None = None
    pb_no_sync_cpu: float | None = None
    backward_first_cpu: float | None = None
    backward_later_cpu: float | None = None
    accumulate_first: float | None = None
    accumulate_later: float | None = None
    accumulate_first_cpu: float | None = None
    accumulate_later_cpu: float | None = None


def _ddp_part(calls: list[BucketCall]) -> dict:
    by_sync: dict[int, list] = defaultdict(list)
    for c in calls:
        by_sync[c.sync].append(c)
    busy = [busy_seconds(g) for g in by_sync.values()]
    return dict(allreduce_calls=len(calls), allreduce_bytes=sum(c.bytes for c in calls),
                allreduce_seconds=sum(c.seconds for c in calls), syncs=len(by_sync), seconds_per_sync=median(busy),
                busy_seconds=sum(busy), calls_per_sync=median(len(g) for g in by_sync.values()),
                call_steps=len({c.step for c in calls}))


def _phase_part(mbs, steps) -> dict:
    first_of_window: dict = {}
    for m in mbs:
        key = (m.tag, m.step)
        first_of_window[key] = min(first_of_window.get(key, m.micro_batch), m.micro_batch)
    no_sync = [m for m in mbs if not m.sync]
    first = [m.micro_batch == first_of_window[(m.tag, m.step)] for m in no_sync]
    cpu = [(m.backward_cpu_seconds, f) for m, f in zip(no_sync, first) if m.backward_cpu_seconds is not None]
    acc = [(m.accumulate_seconds, m.accumulate_cpu_seconds, f) for m, f in zip(no_sync, first)
           if m.accumulate_seconds is not None]
    return dict(optimizer_steps=len(steps), micro_batches=len(mbs), no_sync_micro_batches=len(no_sync),
                forward=median(m.forward_seconds for m in mbs),
                backward_sync=median(m.backward_seconds for m in mbs if m.sync),
                backward_no_sync=median(m.backward_seconds for m in no_sync),
                backward_first=median(m.backward_seconds for m, f in zip(no_sync, first) if f),
                backward_later=median(m.backward_seconds for m, f in zip(no_sync, first) if not f),
                backward_first_cpu=median(c for c, f in cpu if f), backward_later_cpu=median(c for c, f in cpu if not f),
                accumulate_first=median(a for a, _, f in acc if f), accumulate_later=median(a for a, _, f in acc if not f),
                accumulate_first_cpu=median(c for _, c, f in acc if f),
                accumulate_later_cpu=median(c for _, c, f in acc if not f),
                optimizer=median(s.optimizer_seconds for s in steps), step=median(s.step_seconds for s in steps))


def _sharded_part(collectives, mbs) -> dict:
    rs = [c for c in collectives if c.kind == "reduce_scatter"]
    ag = [c for c in collectives if c.kind == "all_gather"]
    by_micro: dict = defaultdict(list)
    for c in collectives:
        by_micro[(c.tag, c.micro_batch)].append(c)
    rs_by_sync: dict = defaultdict(list)
    for c in rs:
        rs_by_sync[(c.tag, c.micro_batch)].append(c)
    ag_per_micro = Counter((c.tag, c.micro_batch) for c in ag)
    ar = [c for c in collectives if c.kind == "all_reduce"]
    ar_per_micro: dict = defaultdict(float)
    for c in ar:
        ar_per_micro[(c.tag, c.micro_batch)] += c.seconds

    def work(m, kinds) -> float:
        busy = busy_seconds([c for c in by_micro.get((m.tag, m.micro_batch), []) if c.kind in kinds])
        return m.forward_seconds + m.backward_seconds - busy

    per_unit: dict = defaultdict(list)
    for c in ag:
        per_unit[c.unit].append(c.seconds)
    return dict(rs_calls=len(rs), rs_bytes=sum(c.bytes for c in rs), rs_seconds=sum(c.seconds for c in rs),
                ag_calls=len(ag), ag_bytes=sum(c.bytes for c in ag), ag_seconds=sum(c.seconds for c in ag),
                collective_steps=len({(c.tag, c.step) for c in collectives}), rs_syncs=len(rs_by_sync),
                rs_seconds_per_sync=median(sum(c.seconds for c in g) for g in rs_by_sync.values()),
                rs_calls_per_sync=median(len(g) for g in rs_by_sync.values()), ag_busy_seconds=busy_seconds(ag),
                ag_per_unit={u: (len(v), median(v)) for u, v in per_unit.items()},
                ag_calls_per_micro_batch=median(ag_per_micro.get((m.tag, m.micro_batch), 0) for m in mbs),
                compute_no_sync=median(work(m, ("all_gather",)) for m in mbs if not m.sync),
                compute_all=median(work(m, ("all_gather", "reduce_scatter", "all_reduce")) for m in mbs),
                ar_calls=len(ar), ar_bytes=sum(c.bytes for c in ar), ar_seconds=sum(c.seconds for c in ar),
                ar_micro_batches=len(ar_per_micro), ar_seconds_per_micro=median(ar_per_micro.values()))


def _post_backward_part(post_backwards, mbs) -> dict:
    per_micro: dict = defaultdict(lambda: [0.0, False, 0.0])
    for r in post_backwards:
        entry = per_micro[(r.tag, r.micro_batch)]
        entry[0] += r.seconds
        entry[1] = entry[1] or r.reduced
        entry[2] = None if (entry[2] is None or r.cpu_seconds is None) else entry[2] + r.cpu_seconds
    kinds: dict = {"pb_sync": [], "pb_sync_adding": [], "pb_no_sync": []}
    cpu: dict = {name: [] for name in kinds}
    synced = set()  # (tag, step) windows that already reduced
    for m in sorted(mbs, key=lambda m: (str(m.tag), m.micro_batch)):
        if (m.tag, m.micro_batch) not in per_micro:
            continue
        seconds, reduced, cpu_seconds = per_micro[(m.tag, m.micro_batch)]
        window = (m.tag, m.step)
        name = "pb_sync_adding" if reduced and window in synced else "pb_sync" if reduced else "pb_no_sync"
        kinds[name].append(seconds)
        if cpu_seconds is not None:
            cpu[name].append(cpu_seconds)
        if reduced:
            synced.add(window)
    out = {name: median(v) for name, v in kinds.items()}
    out.update({f"{name}_micro_batches": len(v) for name, v in kinds.items()})
    out.update({f"{name}_cpu": median(v) for name, v in cpu.items()})
    return out


def from_records(records: ProfileRecords) -> Figures:
    """The :class:`Figures` of a selection of records, computed from every record (exact).

    Records of several tags can be pooled: micro-batches and collectives are
    told apart by (tag, micro-batch) and windows by (tag, step).
    """
    return Figures(**_ddp_part(records.calls), **_phase_part(records.micro_batches, records.steps),
                   **_sharded_part(records.collectives, records.micro_batches),
                   **_post_backward_part(records.post_backwards, records.micro_batches))
