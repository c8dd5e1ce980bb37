"""Figures of ``accum-kit bench --tune``: per DDP setting, exposure against its limit, the paired ratio to the
base, the recommendation. No torch."""

from __future__ import annotations

from ..stats import median, ratio, ratio_interval
from .bench_report import paired_estimate


TUNE_BASE = "base"  # the label of the bench's own DDP settings (accum_kit.bench.part_tune.BASE)

TUNE_CSV_FIELDS = (
    "preset", "K", "setting", "ddp_kwargs", "n_steps", "step_s_median", "step_s_geomean", "step_s_ci_low", "step_s_ci_high",
    "over_base", "over_base_ci_low", "over_base_ci_high", "over_base_cpu", "over_base_cpu_ci_low",
    "over_base_cpu_ci_high", "allreduce_calls_per_step", "allreduce_s_per_sync",
    "backward_no_sync_s", "backward_sync_s", "exposed_comm_s_per_sync", "exposed_limit_s", "exposed_over_limit",
    "peak_rss_mb", "peak_increase_mb",
)


def summarize_tune(preset: str, runs: list[dict], settings: dict) -> list[dict]:
    """One row per setting (``settings``: label -> DDP kwargs, the base first).

    Input: the run dicts of the ``--tune`` part (:mod:`accum_kit.bench.part_tune`; the setting's label in
    ``mode``). Per setting (seconds; medians over the measured micro-batches / steps of all repeats):

    - ``step_s_median`` (over all measured steps), ``step_s_geomean`` (the
      geometric mean of the per-repeat median step times) and its 95 %
      t-interval ``step_s_ci_low`` / ``step_s_ci_high`` (it carries the
      machine's drift over the whole run; with bursts of outside load the
      geometric mean lies above the median);
    - ``over_base`` and its ``_ci_low`` / ``_ci_high``: the paired ratio of this
      setting's step time to the base's in the same repeat (drift cancels), with
      the interval of :func:`accum_kit.stats.ratio_interval`; ``over_base_cpu``
      the same in the process's CPU seconds per step (for the record: the
      recommendation judges step time);
    - ``exposed_comm_s_per_sync``: the boundary micro-batch's backward minus a
      backward without communication (this setting's no-sync micro-batches): the
      all-reduce time not hidden behind the backward;
    - ``exposed_limit_s``: ``max(0, allreduce_s_per_sync - backward_no_sync_s)``,
      the least exposure possible if every bucket's all-reduce ran in parallel
      with the backward and only the part longer than the backward showed;
      ``exposed_over_limit`` is the ratio of the two (None when the limit is 0);
    - ``peak_rss_mb``, ``peak_increase_mb``: the runs' resident-set high-water
      mark and its rise during the run (max over repeats and processes).
    """
    rows = []
    for label, kwargs in settings.items():
        rs = [r for r in runs if r["mode"] == label]
        K = rs[0]["K"] if rs else None
        mbs = [m for r in rs for m in r["micro_batches"]]
        steps = [s for r in rs for s in r["step_seconds"]]
        per_rep = ratio_interval(median(r["step_seconds"]) for r in rs)
        both = rs + [r for r in runs if r["mode"] == TUNE_BASE]
        vs = paired_estimate(both, K, label, TUNE_BASE)
        vs_cpu = paired_estimate(both, K, label, TUNE_BASE, key="step_cpu_seconds")
        bwd_free = median(m["backward_s"] for m in mbs if not m["sync"])
        bwd_sync = median(m["backward_s"] for m in mbs if m["sync"])
        per_sync = median(r["seconds_per_sync"] for r in rs if r["syncs"])
        exposed = max(bwd_sync - bwd_free, 0.0) if (bwd_sync is not None and bwd_free is not None) else None
        limit = max(per_sync - bwd_free, 0.0) if (per_sync is not None and bwd_free is not None) else None
        n_steps = len(steps)
        peaks = [r["peak_rss_mb"] for r in rs if r["peak_rss_mb"] is not None]
        incs = [r["peak_increase_mb"] for r in rs if r["peak_increase_mb"] is not None]
        rows.append({
            "preset": preset, "K": K, "setting": label, "ddp_kwargs": kwargs, "n_steps": n_steps,
            "step_s_median": median(steps), "step_s_geomean": per_rep["geometric_mean"],
            "step_s_ci_low": per_rep["low"], "step_s_ci_high": per_rep["high"],
            "over_base": vs["median"], "over_base_ci_low": vs["low"], "over_base_ci_high": vs["high"],
            "over_base_per_repeat": vs["per_repeat"], "over_base_cpu": vs_cpu["median"],
            "over_base_cpu_ci_low": vs_cpu["low"], "over_base_cpu_ci_high": vs_cpu["high"],
            "allreduce_calls_per_step": ratio(sum(r["allreduce_calls"] for r in rs), n_steps),
            "allreduce_s_per_sync": per_sync, "backward_no_sync_s": bwd_free, "backward_sync_s": bwd_sync,
            "exposed_comm_s_per_sync": exposed, "exposed_limit_s": limit,
            "exposed_over_limit": ratio(exposed, limit) if limit else None,
            "peak_rss_mb": max(peaks) if peaks else None, "peak_increase_mb": max(incs) if incs else None,
        })
    return rows


def recommend(rows: list[dict]) -> dict:
    """The setting to use, judged by the 95 % intervals of the paired ratios to the base.

    ``best``: the setting with the lowest ``over_base`` among those whose
    whole interval lies below 1 (resolvably faster than the base), or None:
    then no setting is resolvably better and the base stays. ``slower``: the
    settings whose whole interval lies above 1. ``text``: one sentence.
    """
    others = [r for r in rows if r["setting"] != TUNE_BASE]
    faster = [r for r in others if r["over_base_ci_high"] is not None and r["over_base_ci_high"] < 1]
    slower = [r["setting"] for r in others if r["over_base_ci_low"] is not None and r["over_base_ci_low"] > 1]
    best = min(faster, key=lambda r: r["over_base"]) if faster else None
    if best is not None:
        text = (f"use {best['setting']} ({best['ddp_kwargs']}): {best['over_base']:.3f}x the base's step time "
                f"[95% interval {best['over_base_ci_low']:.3f}-{best['over_base_ci_high']:.3f}]")
    else:
        text = "none of the settings is resolvably faster than the base (every interval of setting / base reaches 1): keep the base"
    if slower:
        text += f"; resolvably slower: {', '.join(slower)}"
    return {"best": best["setting"] if best else None, "slower": slower, "text": text}


