"""The profiler's running aggregates against every record, and their memory bound; no launch, no torch work.

Oracles: :func:`statistics.median` and sorted ranks for the quantile sketch;
:func:`accum_kit.profiler.figures.from_records` (the summary computed from all
raw records) for the aggregates. The real-run comparison is in
test_profiler.py (DDP) and test_fsdp.py (FSDP2).
"""

from __future__ import annotations

import random
import statistics

import pytest

from accum_kit.profiler.aggregates import IntervalUnion, RunningAggregates
from accum_kit.profiler.figures import busy_seconds, from_records
from accum_kit.profiler.quantiles import QuantileSketch
from accum_kit.profiler.records import (BucketCall, CollectiveCall, MicroBatchTimes, PostBackwardTime, ProfileRecords,
                                      StepTimes)


def synthetic_run(rng: random.Random, steps: int, k: int, units: int = 3, tag=None, mode="no_sync",
                  t0: float = 0.0, step0: int = 0, sync0: int = 0, micro0: int = 0, hsdp: bool = False) -> ProfileRecords:
    """Records in the order a loop makes them: collectives during a micro-batch, then its record. ``hsdp``: each
    reduce-scatter on a window's last micro-batch is followed by an all-reduce across replicas."""
    rec, t, micro = ProfileRecords(), t0, micro0
    for step in range(step0, step0 + steps):
        for i in range(k):
            sync = mode == "sync_each_batch" or i == k - 1
            fwd = rng.uniform(0.01, 0.02)
            for u in range(units):  # all-gathers, some overlapping
                s = rng.uniform(0.001, 0.003)
                rec.collectives.append(CollectiveCall("all_gather", step, micro, mode, tag, u, 4096 * (u + 1), t, s))
                t += s * rng.choice((0.5, 1.0, 1.2))
            bwd = rng.uniform(0.02, 0.04) + (0.01 if sync else 0.0)
            if sync:
                for u in range(units):
                    s = rng.uniform(0.002, 0.004)
                    rec.collectives.append(CollectiveCall("reduce_scatter", step, micro, mode, tag, u, 8192, t, s))
                    rec.calls.append(BucketCall(step, micro, sync0, mode, tag, u, 1000 * (u + 1), t, s * 1.1))
                    t += s * 0.7
                    if hsdp and i == k - 1:
                        a = rng.uniform(0.001, 0.005)
                        rec.collectives.append(CollectiveCall("all_reduce", step, micro, mode, tag, -1, 4096, t, a,
                                                              "replicate"))
                        t += a
                sync0 += 1
            for u in range(units):  # each unit's post-backward hook: longer where it reduced
                s = rng.uniform(0.001, 0.002) + (0.004 if sync else 0.0)
                rec.post_backwards.append(PostBackwardTime(step, micro, mode, tag, u, sync, t, s, s * rng.uniform(0.5, 1)))
                t += s
            t += fwd + bwd
            acc = rng.uniform(0.0005, 0.001) + (0.003 if i else 0.0)  # autograd's add: not in a window's first
            rec.micro_batches.append(MicroBatchTimes(step, micro, sync, mode, tag, fwd, bwd, bwd * rng.uniform(0.5, 1),
                                                     acc, acc * rng.uniform(0.5, 1)))
            micro += 1
        rec.steps.append(StepTimes(step, mode, tag, rng.uniform(0.001, 0.002), rng.uniform(0.2, 0.3)))
    return rec


def feed(agg: RunningAggregates, rec: ProfileRecords) -> None:
    """In arrival order: by start time, a micro-batch's record after its collectives, a step after its micro-batches."""
    events = [(c.start, 0, c) for c in rec.collectives + rec.calls + rec.post_backwards]
    ends = {}
    for c in rec.collectives + rec.calls + rec.post_backwards:
        ends[c.micro_batch] = max(ends.get(c.micro_batch, 0.0), c.start + c.seconds)
    last, step_end = 0.0, {}
    for m in rec.micro_batches:
        last = max(ends.get(m.micro_batch, last), last)
        events.append((last, 1, m))
        step_end[m.step] = last
    for s in rec.steps:
        events.append((step_end[s.step], 2, s))
    for _, _, r in sorted(events, key=lambda e: (e[0], e[1])):
        agg.add(r)


def test_sketch_is_exact_up_to_its_limit_then_within_its_relative_accuracy():
    rng = random.Random(0)
    xs = [rng.lognormvariate(-4, 1) for _ in range(1001)]
    s = QuantileSketch(exact_limit=2048)
    for x in xs:
        s.add(x)
    assert s.exact and s.median() == statistics.median(xs) and s.quantile(0.9) == sorted(xs)[900]
    big = [rng.lognormvariate(-4, 1) for _ in range(50_000)] + [0.0] * 10
    s = QuantileSketch(exact_limit=256, relative_accuracy=0.01)
    for x in big:
        s.add(x)
    ordered = sorted(big)
    assert not s.exact and s.count == len(big) and (s.min, s.max) == (ordered[0], ordered[-1])
    assert s.sum == pytest.approx(sum(big), rel=1e-9)
    for q in (0.1, 0.5, 0.9, 0.99):
        true = ordered[int(q * (len(big) - 1))]
        assert abs(s.quantile(q) - true) <= 0.01 * true * 1.0001, q
    assert len(s._positive) < 1500  # bounded by the values' range, not their number
    merged = QuantileSketch(256).merge(s)
    assert merged.count == s.count and merged.median() == s.median()


def test_interval_union_equals_the_sorted_union():
    rng = random.Random(1)
    spans = [(x, x + rng.uniform(0, 2)) for x in (rng.uniform(0, 500) for _ in range(2000))]
    spans.sort()
    u = IntervalUnion(open_limit=64)
    for i in range(0, len(spans), 16):  # shuffled within blocks: less than 64 out of order
        block = spans[i:i + 16]
        rng.shuffle(block)
        for lo, hi in block:
            u.add(lo, hi)
    calls = [BucketCall(0, 0, 0, "no_sync", None, 0, 0, lo, hi - lo) for lo, hi in spans]
    assert u.total() == pytest.approx(busy_seconds(calls), rel=1e-9) and len(u.spans) <= 64


def test_aggregates_give_the_figures_of_every_record():
    """Two tags and both modes, pooled and apart: the aggregates' figures equal those from every record."""
    rng = random.Random(2)
    a = synthetic_run(rng, steps=6, k=4, tag="a")
    b = synthetic_run(rng, steps=3, k=3, tag="b", t0=100.0, step0=6, sync0=6, micro0=24)
    e = synthetic_run(rng, steps=2, k=2, tag="b", mode="sync_each_batch", t0=200.0, step0=9, sync0=9, micro0=33,
                      hsdp=True)
    agg = RunningAggregates()
    for rec in (a, b, e):
        feed(agg, rec)
    every = ProfileRecords(*(x + y + z for x, y, z in zip(
        *((r.calls, r.micro_batches, r.steps, r.collectives, r.post_backwards) for r in (a, b, e)))))
    for mode, tag in ((None, None), ("no_sync", None), ("no_sync", "a"), ("no_sync", "b"), ("sync_each_batch", "b")):
        got, want = vars(agg.figures(mode=mode, tag=tag)), vars(from_records(every.select(mode=mode, tag=tag)))
        for key, w in want.items():
            if key == "ag_per_unit":
                assert got[key].keys() == w.keys()
                for u in w:
                    assert got[key][u] == pytest.approx(w[u], rel=1e-9), (mode, tag, key, u)
            else:
                assert got[key] == (w if w is None else pytest.approx(w, rel=1e-9, abs=1e-12)), (mode, tag, key)
    rows = agg.table()
    assert {(r["kind"], r["mode"], r["tag"], r["group"]) for r in rows} >= {
        ("all_gather", "no_sync", "a", "shard"), ("reduce_scatter", "sync_each_batch", "b", "shard"),
        ("allreduce", "no_sync", "b", "world"), ("all_reduce", "sync_each_batch", "b", "replicate")}
    counts = vars(agg.figures(mode="sync_each_batch", tag="b"))  # 2 windows of 2: a storing and an adding sync each
    assert (counts["pb_sync_micro_batches"], counts["pb_sync_adding_micro_batches"], counts["pb_no_sync_micro_batches"]) \
        == (2, 2, 0)
    counts = vars(agg.figures(mode="no_sync", tag="a"))  # 6 windows of 4: one sync, three deferred each
    assert (counts["pb_sync_micro_batches"], counts["pb_sync_adding_micro_batches"], counts["pb_no_sync_micro_batches"]) \
        == (6, 0, 18)
    assert sum(r["calls"] for r in rows if r["kind"] == "all_gather") == sum(
        c.kind == "all_gather" for c in every.collectives)


def test_what_the_aggregates_hold_stays_bounded_over_a_long_run():
    """2,000 windows of 4 micro-batches x 3 units: the open groups and spans stay small, every sketch bounded."""
    rng = random.Random(3)
    agg = RunningAggregates(exact_limit=128)
    feed(agg, synthetic_run(rng, steps=2000, k=4))
    (b,) = agg._bins.values()
    assert len(b.open_micro) <= agg.open_limit and len(b.open_syncs) <= 1 and len(b.ag_busy.spans) <= 64
    sketches = [*b.s.values(), *b.ag_units.values(), *(x for pair in b.kinds.values() for x in pair)]
    assert all(s._values is None or len(s._values) <= 128 for s in sketches)
    assert max(len(s._positive) for s in sketches) < 200
    f = agg.figures()
    assert (f.optimizer_steps, f.micro_batches, f.rs_syncs, f.ag_calls) == (2000, 8000, 2000, 24000)
