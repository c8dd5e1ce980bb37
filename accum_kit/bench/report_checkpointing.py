"""The figures of ``accum-kit bench --gradient_checkpointing_ab``: per arm and K, step time with / without
activation checkpointing (a paired ratio with its 95 % interval) and the peak memory of each.

No torch, nothing from the sweep (:mod:`.checkpointing_ab` runs the twins). Pairs are those of
:func:`accum_kit.bench.bench_report.paired_ratios`: per repeat under DDP (the arm's run and its twin's ran in
one block, back to back), per (repeat, cycle) of windows under FSDP2 (the two models' rotations ran in one
block, one after the other).
"""

from __future__ import annotations

from ..stats import median, ratio_interval
from .bench_report import _f, paired_ratios

#: what a twin's name adds to its arm's: ``no_sync+gc``
GC_SUFFIX = "+gc"
#: the columns of a row (``bench.json``'s ``presets.<preset>.checkpointing``)
CHECKPOINTING_FIELDS = ("preset", "K", "arm", "twin", "with_over_without", "ci_low", "ci_high", "n_pairs",
                        "cpu_with_over_without", "cpu_ci_low", "cpu_ci_high",
                        "step_seconds_without", "step_seconds_with", "peak_mb_without", "peak_mb_with",
                        "peak_saved_mb", "block_forwards_per_micro_batch_without", "block_forwards_per_micro_batch_with")


def twin_name(arm: str) -> str:
    """The checkpointed twin of ``arm``."""
    return arm + GC_SUFFIX


def _forwards_per_block(runs: list[dict]) -> float | None:
    """Block forwards per micro-batch and block over ``runs`` (their ``block_forwards``, ``micro_batches_run``,
    ``blocks``): 1 without checkpointing, 2 with it."""
    n = sum(r.get("block_forwards", 0) for r in runs)
    d = sum(r.get("micro_batches_run", 0) * r.get("blocks", 0) for r in runs)
    return n / d if d else None


def checkpointing_rows(preset: str, runs: list[dict], arm_key: str, arms: list[str], ks: list[int]) -> list[dict]:
    """One row per K and arm of ``arms`` that has a twin in ``runs`` (records named by ``arm_key``).

    ``with_over_without``: median over pairs of twin step / arm step, ``ci_low`` / ``ci_high`` its 95 %
    interval (:func:`accum_kit.stats.ratio_interval`; None with fewer than 2 pairs); ``cpu_*``: the same on the
    process's CPU seconds per step (the work done, which other jobs' load barely moves); ``step_seconds_*``:
    median step (s) over all measured steps; ``peak_mb_*``: median over runs of the run's peak (MB, the
    maximum over processes; under FSDP2 the highest window of the run); ``peak_saved_mb``: median over
    repeats of the arm's peak minus its twin's in that repeat; ``block_forwards_per_micro_batch_*``: forwards
    of each block per micro-batch (1 without checkpointing, 2 with).
    """
    rows = []
    for K in ks:
        for arm in arms:
            base = [r for r in runs if r["K"] == K and r[arm_key] == arm]
            twin = [r for r in runs if r["K"] == K and r[arm_key] == twin_name(arm)]
            if not base or not twin:
                continue
            ci = ratio_interval(paired_ratios(twin, base))
            cpu = ratio_interval(paired_ratios(twin, base, "step_cpu_seconds"))
            peaks = {side: {r["repeat"]: r.get("peak_rss_mb") for r in rs} for side, rs in (("base", base), ("twin", twin))}
            saved = [peaks["base"][k] - peaks["twin"][k] for k in peaks["base"]
                     if peaks["base"][k] is not None and peaks["twin"].get(k) is not None]
            rows.append({"preset": preset, "K": K, "arm": arm, "twin": twin_name(arm),
                         "with_over_without": ci["median"], "ci_low": ci["low"], "ci_high": ci["high"], "n_pairs": ci["n"],
                         "cpu_with_over_without": cpu["median"], "cpu_ci_low": cpu["low"], "cpu_ci_high": cpu["high"],
                         "step_seconds_without": median(t for r in base for t in r["step_seconds"]),
                         "step_seconds_with": median(t for r in twin for t in r["step_seconds"]),
                         "peak_mb_without": median(v for v in peaks["base"].values() if v is not None),
                         "peak_mb_with": median(v for v in peaks["twin"].values() if v is not None),
                         "peak_saved_mb": median(saved),
                         "block_forwards_per_micro_batch_without": _forwards_per_block(base),
                         "block_forwards_per_micro_batch_with": _forwards_per_block(twin)})
    return rows


def format_checkpointing_table(preset: str, rows: list[dict]) -> str:
    """The printed table of :func:`checkpointing_rows`."""
    lines = [f"activation checkpointing, {preset}: step time with / without [95 % interval], the same in CPU seconds, "
             "peak memory (MB)",
             f"{'K':>3} {'arm':<34} {'with/without':>12} {'interval':>17} {'CPU s ratio':>11} {'interval':>17} "
             f"{'s/step w/o':>10} {'s/step with':>11} "
             f"{'peak w/o':>9} {'peak with':>9} {'saved':>8} {'fwd/blk':>7}"]
    for r in rows:
        ci = "n/a" if r["ci_low"] is None else f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
        cpu = "n/a" if r["cpu_ci_low"] is None else f"[{r['cpu_ci_low']:.3f}, {r['cpu_ci_high']:.3f}]"
        lines.append(f"{r['K']:>3} {r['arm']:<34} {_f(r['with_over_without']):>12} {ci:>17} "
                     f"{_f(r['cpu_with_over_without']):>11} {cpu:>17} "
                     f"{_f(r['step_seconds_without']):>10} {_f(r['step_seconds_with']):>11} "
                     f"{_f(r['peak_mb_without'], '{:.0f}'):>9} {_f(r['peak_mb_with'], '{:.0f}'):>9} "
                     f"{_f(r['peak_saved_mb'], '{:.0f}'):>8} "
                     f"{_f(r['block_forwards_per_micro_batch_without'], '{:.0f}')}/"
                     f"{_f(r['block_forwards_per_micro_batch_with'], '{:.0f}')}")
    return "\n".join(lines)
