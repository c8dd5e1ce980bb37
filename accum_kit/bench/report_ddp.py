"""Figures and verdicts of the bench's DDP modes: ``c``, ``a``, the ideal speedup, the paired ratios of the
modes, the bars (definitions in :mod:`accum_kit.bench`'s docstring). No torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..engines.costs import ddp_costs
from ..planning.step_time import MeasuredCommunication, step_time
from ..stats import median, quartiles, ratio, ratio_interval
from .bench_report import INTERVAL_METHOD, bar, paired_estimate

if TYPE_CHECKING:
    from .bench_config import BenchConfig


COMM_HEAVY = "comm_heavy"
#: The modes that run accum-kit's exact arithmetic (their losses agree to float32 rounding).
EXACT_MODES = ("sync_each_batch", "no_sync", "raw_ddp", "manual_allreduce", "manual_allreduce_flat")
#: The three modes the default sweep runs; every other mode is compared with no_sync one by one.
_CORE = ("sync_each_batch", "no_sync", "raw_ddp")

# The bars a 2-process CPU (gloo) sweep must meet, checked on what it measured.
BAR_K = 8  # K of the speedup bars
BAR_MIN_SPEEDUP = 1.25  # no_sync at least this much faster than sync_each_batch on comm_heavy
BAR_MIN_FRACTION_OF_IDEAL = 0.90  # ... and at least this fraction of the ideal speedup
BAR_MAX_RAW_RATIO = 1.03  # no_sync step time at most this times raw DDP's, at every K
BAR_MEMORY_K = (1, 16)  # peak memory at the larger K at most ...
BAR_MAX_MEMORY_RATIO = 1.05  # ... this times that at the smaller K

#: bench.csv's columns under DDP (one row per preset x K x mode).
DDP_CSV_FIELDS = (
    "preset", "parameters", "K", "mode", "n_steps", "step_s_median", "step_s_min", "step_s_max", "step_s_q1",
    "step_s_q3", "micro_batch_s", "tokens_per_s", "forward_s", "backward_s", "optimizer_s", "other_s",
    "allreduce_calls_per_step", "allreduce_mb_per_step", "syncs_per_step", "allreduce_s_per_sync",
    "comm_share_exposed", "allreduce_busy_share", "peak_rss_mb", "peak_increase_mb",
    "c_s", "a_s", "ideal_no_sync_step_s", "ideal_sync_each_batch_step_s", "ideal_speedup", "speedup",
    "fraction_of_ideal", "overhead_s", "no_sync_over_raw_ddp",
    "no_sync_over_mode", "loss_max_abs_diff_vs_no_sync", "loss_mean_diff_vs_no_sync",
    # 95 % intervals of the paired ratios above (t-interval on the log per-repeat ratios), and per mode the
    # backward of the synchronising micro-batch and its exposed communication
    "speedup_ci_low", "speedup_ci_high", "fraction_of_ideal_ci_low", "fraction_of_ideal_ci_high",
    "no_sync_over_raw_ddp_ci_low", "no_sync_over_raw_ddp_ci_high", "no_sync_over_mode_ci_low",
    "no_sync_over_mode_ci_high", "backward_sync_s", "exposed_comm_s_per_sync",
    # the process's CPU seconds per step, and the ratios above in CPU seconds (see the bench's docstring)
    "step_cpu_s_median", "no_sync_over_raw_ddp_cpu", "no_sync_over_raw_ddp_cpu_ci_low", "no_sync_over_raw_ddp_cpu_ci_high",
    "no_sync_over_mode_cpu", "no_sync_over_mode_cpu_ci_low", "no_sync_over_mode_cpu_ci_high",
)


def compute_c_a(runs: list[dict]) -> dict:
    """``c`` and ``a`` of one preset (seconds) from its runs' per-micro-batch phase times."""
    compute = [m["forward_s"] + m["backward_s"] for r in runs if r["mode"] == "no_sync" for m in r["micro_batches"] if not m["sync"]]
    bwd_nosync = [m["backward_s"] for r in runs if r["mode"] == "no_sync" for m in r["micro_batches"] if not m["sync"]]
    bwd_sync = [m["backward_s"] for r in runs if r["mode"] == "sync_each_batch" for m in r["micro_batches"] if m["sync"]]
    c = median(compute)
    a = max(median(bwd_sync) - median(bwd_nosync), 0.0) if (bwd_sync and bwd_nosync) else None
    return {"c_seconds": c, "a_seconds": a, "c_samples": len(compute), "a_sync_samples": len(bwd_sync),
            "a_no_sync_samples": len(bwd_nosync), "backward_sync_median_s": median(bwd_sync),
            "backward_no_sync_median_s": median(bwd_nosync)}


def ideal_step_seconds(mode: str, K: int, c: float, a: float) -> float:
    """``K c + n a``: compute plus what no_sync cannot skip, one exposed all-reduce per sync, by the step-time
    model (:func:`accum_kit.planning.step_time.step_time`) with n syncs per window from DDP's row of the cost
    table (:func:`accum_kit.engines.costs.ddp_costs`: K with ``sync_each_batch``, 1 with ``no_sync``)."""
    return step_time(ddp_costs(mode, world_size=1, accumulation_steps=K, gradient_bytes=0.0), c,
                     MeasuredCommunication(a)).seconds


def ideal_speedup(K: int, c: float, a: float) -> float:
    """``(K c + K a) / (K c + a)``: sync_each_batch's ideal step time over no_sync's."""
    return ideal_step_seconds("sync_each_batch", K, c, a) / ideal_step_seconds("no_sync", K, c, a)


def _mode_row(preset: str, parameters: int, K: int, mode: str, rs: list[dict], a, tokens_per_micro: int,
              backward_free=None) -> dict:
    """One CSV row: the runs ``rs`` of one (K, mode), pooled over repeats.

    ``backward_free``: the preset's backward without communication (median
    no-sync backward of ``no_sync``), from which this mode's exposed
    communication per sync is measured.
    """
    steps = [s for r in rs for s in r["step_seconds"]]
    mbs = [m for r in rs for m in r["micro_batches"]]
    q1, q3 = quartiles(steps)
    n_steps = sum(len(r["step_seconds"]) for r in rs)
    med = median(steps)
    syncs = sum(r["syncs"] for r in rs) / n_steps if n_steps else None
    busy = sum(r["allreduce_busy_seconds"] for r in rs) / n_steps if n_steps else None
    peaks = [r["peak_rss_mb"] for r in rs if r["peak_rss_mb"] is not None]
    incs = [r["peak_increase_mb"] for r in rs if r["peak_increase_mb"] is not None]
    bwd_sync = median(m["backward_s"] for m in mbs if m["sync"])
    return {
        "preset": preset, "parameters": parameters, "K": K, "mode": mode, "n_steps": n_steps,
        "step_s_median": med, "step_s_min": min(steps) if steps else None,
        "step_cpu_s_median": median(c for r in rs for c in (r.get("step_cpu_seconds") or []) if c is not None),
        "step_s_max": max(steps) if steps else None, "step_s_q1": q1, "step_s_q3": q3,
        "micro_batch_s": ratio(med, K), "tokens_per_s": ratio(K * tokens_per_micro, med),
        "forward_s": median(m["forward_s"] for m in mbs),
        "backward_s": median(m["backward_s"] for m in mbs),
        "backward_sync_s": bwd_sync,
        "optimizer_s": median(s for r in rs for s in r["optimizer_seconds"]),
        "other_s": median(s for r in rs for s in r["other_seconds"]),
        "allreduce_calls_per_step": ratio(sum(r["allreduce_calls"] for r in rs), n_steps),
        "allreduce_mb_per_step": ratio(sum(r["allreduce_bytes"] for r in rs) / 2**20, n_steps),
        "syncs_per_step": syncs,
        "allreduce_s_per_sync": median(r["seconds_per_sync"] for r in rs if r["syncs"]),
        "exposed_comm_s_per_sync": (max(bwd_sync - backward_free, 0.0)
                                    if (bwd_sync is not None and backward_free is not None) else None),
        "comm_share_exposed": ratio(syncs * a, med) if (syncs is not None and a is not None) else None,
        "allreduce_busy_share": ratio(busy, med),
        "peak_rss_mb": max(peaks) if peaks else None,
        "peak_increase_mb": max(incs) if incs else None,
    }


def _put_ratio(d: dict, name: str, runs: list[dict], K: int, num: str, den: str, key: str = "step_seconds") -> dict:
    """Store the paired ratio ``num / den`` at K in ``d``: ``name``, ``name_per_repeat``, ``name_ci_low``, ``name_ci_high``."""
    est = paired_estimate(runs, K, num, den, key)
    d[name], d[f"{name}_per_repeat"] = est["median"], est["per_repeat"]
    d[f"{name}_ci_low"], d[f"{name}_ci_high"] = est["low"], est["high"]
    return est


def _per_k(preset: str, K: int, c, a, med: dict, runs: list[dict]) -> dict:
    """The derived figures of one K: ideal step times and speedup, measured (paired) ratios with intervals, overhead."""
    d = {"preset": preset, "K": K, "c_s": c, "a_s": a}
    if c is not None and a is not None:
        d.update(ideal_no_sync_step_s=ideal_step_seconds("no_sync", K, c, a),
                 ideal_sync_each_batch_step_s=ideal_step_seconds("sync_each_batch", K, c, a),
                 ideal_speedup=ideal_speedup(K, c, a))
    else:
        d.update(ideal_no_sync_step_s=None, ideal_sync_each_batch_step_s=None, ideal_speedup=None)
    _put_ratio(d, "speedup", runs, K, "sync_each_batch", "no_sync")
    d["speedup_of_pooled_medians"] = ratio(med.get("sync_each_batch"), med.get("no_sync"))
    # The ideal is taken as known (it comes from medians over every micro-batch of the preset): the
    # fraction's interval is the speedup's divided by it.
    d["fraction_of_ideal"] = ratio(d["speedup"], d["ideal_speedup"])
    d["fraction_of_ideal_ci_low"] = ratio(d["speedup_ci_low"], d["ideal_speedup"])
    d["fraction_of_ideal_ci_high"] = ratio(d["speedup_ci_high"], d["ideal_speedup"])
    d["overhead_s"] = (med["no_sync"] - d["ideal_no_sync_step_s"]) if (
        med.get("no_sync") is not None and d["ideal_no_sync_step_s"] is not None) else None
    d["ideal_speedup_with_overhead"] = ratio(d["ideal_sync_each_batch_step_s"] + d["overhead_s"],
                                             d["ideal_no_sync_step_s"] + d["overhead_s"]) if d["overhead_s"] is not None else None
    _put_ratio(d, "no_sync_over_raw_ddp", runs, K, "no_sync", "raw_ddp")
    # The same ratio in CPU seconds per step: the work each loop does, which other jobs' load barely moves
    _put_ratio(d, "no_sync_over_raw_ddp_cpu", runs, K, "no_sync", "raw_ddp", key="step_cpu_seconds")
    d["no_sync_over_raw_ddp_of_pooled_medians"] = ratio(med.get("no_sync"), med.get("raw_ddp"))
    d["loss_max_abs_diff_between_modes"] = _loss_spread([r for r in runs if r["mode"] in EXACT_MODES], K)
    for other in sorted({r["mode"] for r in runs} - set(_CORE)):  # peers and the manual all-reduce modes
        _put_ratio(d, f"no_sync_over_{other}", runs, K, "no_sync", other)
        _put_ratio(d, f"no_sync_over_{other}_cpu", runs, K, "no_sync", other, key="step_cpu_seconds")
        d[f"loss_diff_{other}"] = loss_differences(runs, K, other)
    return d


def loss_differences(runs: list[dict], K: int, mode: str, reference: str = "no_sync") -> dict | None:
    """Per-step loss of ``mode`` minus ``reference``'s, same (K, repeat, step), in nats.

    Returns ``max_abs``, ``mean`` (signed), ``mean_relative`` (signed mean of
    difference / reference loss) and ``n`` (steps compared), or None when
    nothing pairs up.
    """
    diffs, rel = [], []
    for rep in sorted({r["repeat"] for r in runs}):
        a = next((r["losses"] for r in runs if r["K"] == K and r["repeat"] == rep and r["mode"] == mode), None)
        b = next((r["losses"] for r in runs if r["K"] == K and r["repeat"] == rep and r["mode"] == reference), None)
        if a is None or b is None:
            continue
        for x, y in zip(a, b):
            diffs.append(x - y)
            rel.append((x - y) / y if y else 0.0)
    if not diffs:
        return None
    return {"max_abs": max(abs(d) for d in diffs), "mean": sum(diffs) / len(diffs),
            "mean_relative": sum(rel) / len(rel), "n": len(diffs)}


#: Per-K figures copied onto every row of that K (so the CSV stands alone).
ROW_FROM_PER_K = ("c_s", "a_s", "ideal_no_sync_step_s", "ideal_sync_each_batch_step_s", "ideal_speedup", "speedup",
                  "speedup_ci_low", "speedup_ci_high", "fraction_of_ideal", "fraction_of_ideal_ci_low",
                  "fraction_of_ideal_ci_high", "overhead_s", "no_sync_over_raw_ddp", "no_sync_over_raw_ddp_ci_low",
                  "no_sync_over_raw_ddp_ci_high", "no_sync_over_raw_ddp_cpu", "no_sync_over_raw_ddp_cpu_ci_low",
                  "no_sync_over_raw_ddp_cpu_ci_high")


def summarize_preset(preset: str, info: dict, runs: list[dict], cfg: BenchConfig, world: int) -> tuple[list, list]:
    """Rows (one per K x mode) and per-K derived figures of one preset; adds ``c``, ``a`` and ``profile`` to ``info``.

    Input: the run dicts the DDP part records (:func:`accum_kit.bench.run_records.run_record` for the
    profiler's part; each also has ``preset``, ``K``, ``mode``, ``repeat``, ``losses``, ``peak_rss_mb``,
    ``peak_increase_mb``). The definitions of ``c``, ``a``, the ideal speedup and the paired ratios are in
    :mod:`accum_kit.bench`'s docstring.
    """
    ca = compute_c_a(runs)
    c, a = ca["c_seconds"], ca["a_seconds"]
    tokens_per_micro = info.get("targets_per_micro_batch")  # targets, all processes
    if tokens_per_micro is None:
        tokens_per_micro = cfg.per_device_train_batch_size * (cfg.block_size - 1) * world
    rows, per_k = [], []
    backward_free = ca["backward_no_sync_median_s"]
    for K in cfg.accumulation_steps:
        block = [_mode_row(preset, info["parameters"], K, mode, [r for r in runs if r["K"] == K and r["mode"] == mode],
                           a, tokens_per_micro, backward_free) for mode in cfg.modes]
        d = _per_k(preset, K, c, a, {row["mode"]: row["step_s_median"] for row in block}, runs)
        per_k.append(d)
        for row in block:
            row.update({k: d[k] for k in ROW_FROM_PER_K})
            # accum-kit (no_sync) against this mode: paired step-time ratio and per-step loss difference
            for suffix, key in (("", "step_seconds"), ("_cpu", "step_cpu_seconds")):
                est = paired_estimate(runs, K, "no_sync", row["mode"], key)
                row[f"no_sync_over_mode{suffix}"], row[f"no_sync_over_mode{suffix}_ci_low"] = est["median"], est["low"]
                row[f"no_sync_over_mode{suffix}_ci_high"] = est["high"]
            diff = loss_differences(runs, K, row["mode"])
            row["loss_max_abs_diff_vs_no_sync"] = diff["max_abs"] if diff else None
            row["loss_mean_diff_vs_no_sync"] = diff["mean"] if diff else None
            rows.append(row)
    info.update(ca)
    info["profile"] = phase_profile(runs, cfg.modes, info["gradient_bytes"])
    info["interval_method"] = INTERVAL_METHOD
    return rows, per_k


def phase_profile(runs: list[dict], modes: list, gradient_bytes: int) -> dict:
    """Per mode, pooled over K and repeats: median phase times (s) and the all-reduce's time in flight."""
    out = {}
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        mbs = [m for r in rs for m in r["micro_batches"]]
        per_sync = median(r["seconds_per_sync"] for r in rs if r["syncs"])
        out[mode] = {
            "forward_s": median(m["forward_s"] for m in mbs),
            "backward_no_sync_s": median(m["backward_s"] for m in mbs if not m["sync"]),
            "backward_sync_s": median(m["backward_s"] for m in mbs if m["sync"]),
            "optimizer_s": median(x for r in rs for x in r["optimizer_seconds"]),
            "other_s": median(x for r in rs for x in r["other_seconds"]),
            "allreduce_s_per_sync": per_sync,
            "allreduce_GBps": ratio(gradient_bytes / 1e9, per_sync),
        }
    return out


def _loss_spread(runs: list[dict], K: int) -> float | None:
    """Largest |loss difference| between modes over the same (K, repeat, step): equal math gives ~1e-6."""
    worst = None
    for rep in {r["repeat"] for r in runs}:
        losses = [r["losses"] for r in runs if r["K"] == K and r["repeat"] == rep]
        for other in losses[1:]:
            for x, y in zip(losses[0], other):
                d = abs(x - y)
                worst = d if worst is None else max(worst, d)
    return worst


def memory_ratios(runs: list[dict], preset: str, mode: str, k_hi: int, k_lo: int) -> list[float]:
    """Per repeat: peak memory of ``mode``'s run at ``k_hi`` / that at ``k_lo`` (same preset, same repeat)."""
    out = []
    for rep in sorted({r["repeat"] for r in runs}):
        hi = next((r["peak_rss_mb"] for r in runs if (r["preset"], r["mode"], r["K"], r["repeat"]) == (preset, mode, k_hi, rep)), None)
        lo = next((r["peak_rss_mb"] for r in runs if (r["preset"], r["mode"], r["K"], r["repeat"]) == (preset, mode, k_lo, rep)), None)
        if hi is not None and lo:
            out.append(hi / lo)
    return out


def evaluate_bars(rows: list[dict], per_k: list[dict], runs: list[dict] | None = None) -> list[dict]:
    """The four bars, judged by the 95 % intervals of what this sweep measured (see :func:`bar`).

    1. ``speedup``: on the communication-heavy preset at K = 8, no_sync is at
       least 1.25x faster than sync_each_batch (paired ratio's interval);
    2. ``fraction_of_ideal``: that speedup is at least 90 % of the ideal
       ``(Kc + Ka) / (Kc + a)`` (the speedup's interval over the ideal);
    3. ``no_sync_vs_raw_ddp``: no_sync's step time is at most 1.03x the raw
       DDP loop's, at every K of every preset;
    4. ``memory``: peak memory at K = 16 is at most 1.05x that at K = 1, for
       every preset and mode (interval of the per-repeat ratio of the two
       runs' peaks; needs ``runs``).
    """
    bars = []
    ck = next((d for d in per_k if d["preset"] == COMM_HEAVY and d["K"] == BAR_K), None)
    items = [(ck["speedup"], ck["speedup_ci_low"], ck["speedup_ci_high"], f"{COMM_HEAVY} K={BAR_K}")] if (
        ck and ck["speedup"] is not None) else []
    bars.append(bar("speedup", f"{COMM_HEAVY} K={BAR_K}: no_sync >= {BAR_MIN_SPEEDUP}x faster than sync_each_batch",
                    items, BAR_MIN_SPEEDUP, at_most=False))
    items = [(ck["fraction_of_ideal"], ck["fraction_of_ideal_ci_low"], ck["fraction_of_ideal_ci_high"],
              f"{COMM_HEAVY} K={BAR_K} (ideal {ck['ideal_speedup']:.3f}x)")] if (ck and ck["fraction_of_ideal"] is not None) else []
    bars.append(bar("fraction_of_ideal",
                    f"{COMM_HEAVY} K={BAR_K}: speedup >= {BAR_MIN_FRACTION_OF_IDEAL:.0%} of the ideal (Kc+Ka)/(Kc+a)",
                    items, BAR_MIN_FRACTION_OF_IDEAL, at_most=False))
    items = [(d["no_sync_over_raw_ddp"], d["no_sync_over_raw_ddp_ci_low"], d["no_sync_over_raw_ddp_ci_high"],
              f'{d["preset"]} K={d["K"]}') for d in per_k if d["no_sync_over_raw_ddp"] is not None]
    raw = bar("no_sync_vs_raw_ddp", f"no_sync / raw_ddp step time <= {BAR_MAX_RAW_RATIO} at every K",
              items, BAR_MAX_RAW_RATIO, at_most=True)
    # The same ratio in CPU seconds per step, for the record (the bar judges step time): on a loaded machine
    # other jobs lengthen the wall clock of both loops erratically, but barely the work each loop does.
    cpu_items = [(d["no_sync_over_raw_ddp_cpu"], d["no_sync_over_raw_ddp_cpu_ci_low"], d["no_sync_over_raw_ddp_cpu_ci_high"],
                  f'{d["preset"]} K={d["K"]}') for d in per_k if d.get("no_sync_over_raw_ddp_cpu") is not None]
    cpu = bar("no_sync_vs_raw_ddp_cpu", "", cpu_items, BAR_MAX_RAW_RATIO, at_most=True)
    raw["cpu_verdict"] = cpu["verdict"]
    if cpu_items:
        raw["cpu_detail"] = cpu["detail"]
    if cpu_items and items:
        raw["detail"] += f". CPU seconds per step (for the record; the verdict is on step time): {cpu['verdict']}, {cpu['detail']}"
    bars.append(raw)
    lo, hi = BAR_MEMORY_K
    items = []
    for r_hi in rows:
        if r_hi["K"] != hi or r_hi["peak_rss_mb"] is None or runs is None:
            continue
        est = ratio_interval(memory_ratios(runs, r_hi["preset"], r_hi["mode"], hi, lo))
        if est["median"] is not None:
            items.append((est["median"], est["low"], est["high"], f'{r_hi["preset"]} {r_hi["mode"]}'))
    bars.append(bar("memory", f"peak memory at K={hi} <= {BAR_MAX_MEMORY_RATIO}x that at K={lo}",
                    items, BAR_MAX_MEMORY_RATIO, at_most=True))
    return bars


