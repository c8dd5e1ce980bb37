"""Reporting for ``accum-kit bench``: derived figures, the bars, tables, CSV, plot and output files.

The sweep itself (running the modes and recording them) is :mod:`accum_kit.bench`;
this module only turns its records into figures. The definitions of ``c``,
``a``, the ideal speedup and the paired ratios are in that module's docstring.
"""

from __future__ import annotations

import csv
import io
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from .outputs import atomic_write_bytes, atomic_write_json, staged_output_dir

if TYPE_CHECKING:
    from .bench import BenchConfig

MODES = ("sync_each_batch", "no_sync", "raw_ddp")
COMM_HEAVY = "comm_heavy"

# The bars of issue 5 (2 CPU processes, gloo).
BAR_K = 8
BAR_MIN_SPEEDUP = 1.25
BAR_MIN_FRACTION_OF_IDEAL = 0.90
BAR_MAX_RAW_RATIO = 1.03
BAR_MEMORY_K = (1, 16)
BAR_MAX_MEMORY_RATIO = 1.05

CSV_FIELDS = (
    "preset", "parameters", "K", "mode", "n_steps", "step_s_median", "step_s_min", "step_s_max", "step_s_q1",
    "step_s_q3", "micro_batch_s", "tokens_per_s", "forward_s", "backward_s", "optimizer_s", "other_s",
    "allreduce_calls_per_step", "allreduce_mb_per_step", "syncs_per_step", "allreduce_s_per_sync",
    "comm_share_exposed", "allreduce_busy_share", "peak_rss_mb", "peak_increase_mb",
    "c_s", "a_s", "ideal_no_sync_step_s", "ideal_sync_each_batch_step_s", "ideal_speedup", "speedup",
    "fraction_of_ideal", "overhead_s", "no_sync_over_raw_ddp",
)


def _median(xs):
    return statistics.median(xs) if xs else None


def _quartiles(xs):
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (None, None)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _div(a, b):
    return a / b if (a is not None and b not in (None, 0)) else None


def compute_c_a(runs: list[dict]) -> dict:
    """``c`` and ``a`` of one preset from its runs' per-micro-batch phase times (see the module docstring)."""
    compute = [m["forward_s"] + m["backward_s"] for r in runs if r["mode"] == "no_sync" for m in r["micro_batches"] if not m["sync"]]
    bwd_nosync = [m["backward_s"] for r in runs if r["mode"] == "no_sync" for m in r["micro_batches"] if not m["sync"]]
    bwd_sync = [m["backward_s"] for r in runs if r["mode"] == "sync_each_batch" for m in r["micro_batches"] if m["sync"]]
    c = _median(compute)
    a = max(_median(bwd_sync) - _median(bwd_nosync), 0.0) if (bwd_sync and bwd_nosync) else None
    return {"c_seconds": c, "a_seconds": a, "c_samples": len(compute), "a_sync_samples": len(bwd_sync),
            "a_no_sync_samples": len(bwd_nosync), "backward_sync_median_s": _median(bwd_sync),
            "backward_no_sync_median_s": _median(bwd_nosync)}


def ideal_speedup(K: int, c: float, a: float) -> float:
    """``(K c + K a) / (K c + a)``: sync_each_batch's ideal step time over no_sync's."""
    return (K * c + K * a) / (K * c + a)


def summarize_preset(preset: str, info: dict, runs: list[dict], cfg: BenchConfig, world: int) -> tuple[list, list]:
    """Rows (one per K x mode) and per-K derived figures of one preset."""
    ca = compute_c_a(runs)
    c, a = ca["c_seconds"], ca["a_seconds"]
    tokens_per_micro = cfg.per_device_train_batch_size * (cfg.block_size - 1) * world  # targets, all processes
    rows, per_k = [], []
    for K in cfg.accumulation_steps:
        med = {}
        block = []
        for mode in cfg.modes:
            rs = [r for r in runs if r["K"] == K and r["mode"] == mode]
            steps = [s for r in rs for s in r["step_seconds"]]
            mbs = [m for r in rs for m in r["micro_batches"]]
            q1, q3 = _quartiles(steps)
            n_steps = sum(len(r["step_seconds"]) for r in rs)
            median = _median(steps)
            med[mode] = median
            syncs = sum(r["syncs"] for r in rs) / n_steps if n_steps else None
            busy = sum(r["allreduce_busy_seconds"] for r in rs) / n_steps if n_steps else None
            peaks = [r["peak_rss_mb"] for r in rs if r["peak_rss_mb"] is not None]
            incs = [r["peak_increase_mb"] for r in rs if r["peak_increase_mb"] is not None]
            block.append({
                "preset": preset, "parameters": info["parameters"], "K": K, "mode": mode, "n_steps": n_steps,
                "step_s_median": median, "step_s_min": min(steps) if steps else None,
                "step_s_max": max(steps) if steps else None, "step_s_q1": q1, "step_s_q3": q3,
                "micro_batch_s": _div(median, K), "tokens_per_s": _div(K * tokens_per_micro, median),
                "forward_s": _median([m["forward_s"] for m in mbs]),
                "backward_s": _median([m["backward_s"] for m in mbs]),
                "optimizer_s": _median([s for r in rs for s in r["optimizer_seconds"]]),
                "other_s": _median([s for r in rs for s in r["other_seconds"]]),
                "allreduce_calls_per_step": _div(sum(r["allreduce_calls"] for r in rs), n_steps),
                "allreduce_mb_per_step": _div(sum(r["allreduce_bytes"] for r in rs) / 2**20, n_steps),
                "syncs_per_step": syncs,
                "allreduce_s_per_sync": _median([r["seconds_per_sync"] for r in rs if r["syncs"]]),
                "comm_share_exposed": _div(syncs * a, median) if (syncs is not None and a is not None) else None,
                "allreduce_busy_share": _div(busy, median),
                "peak_rss_mb": max(peaks) if peaks else None,
                "peak_increase_mb": max(incs) if incs else None,
            })
        d = {"preset": preset, "K": K, "c_s": c, "a_s": a}
        if c is not None and a is not None:
            d.update(ideal_no_sync_step_s=K * c + a, ideal_sync_each_batch_step_s=K * c + K * a,
                     ideal_speedup=ideal_speedup(K, c, a))
        else:
            d.update(ideal_no_sync_step_s=None, ideal_sync_each_batch_step_s=None, ideal_speedup=None)
        d["speedup"], d["speedup_per_repeat"] = paired_ratio(runs, K, "sync_each_batch", "no_sync")
        d["speedup_of_pooled_medians"] = _div(med.get("sync_each_batch"), med.get("no_sync"))
        d["fraction_of_ideal"] = _div(d["speedup"], d["ideal_speedup"])
        d["overhead_s"] = (med["no_sync"] - d["ideal_no_sync_step_s"]) if (
            med.get("no_sync") is not None and d["ideal_no_sync_step_s"] is not None) else None
        d["ideal_speedup_with_overhead"] = _div(d["ideal_sync_each_batch_step_s"] + d["overhead_s"],
                                                d["ideal_no_sync_step_s"] + d["overhead_s"]) if d["overhead_s"] is not None else None
        d["no_sync_over_raw_ddp"], d["no_sync_over_raw_ddp_per_repeat"] = paired_ratio(runs, K, "no_sync", "raw_ddp")
        d["no_sync_over_raw_ddp_of_pooled_medians"] = _div(med.get("no_sync"), med.get("raw_ddp"))
        d["loss_max_abs_diff_between_modes"] = _loss_spread(runs, K)
        per_k.append(d)
        for row in block:
            row.update({k: d[k] for k in ("c_s", "a_s", "ideal_no_sync_step_s", "ideal_sync_each_batch_step_s",
                                          "ideal_speedup", "speedup", "fraction_of_ideal", "overhead_s",
                                          "no_sync_over_raw_ddp")})
            rows.append(row)
    info.update(ca)
    info["profile"] = phase_profile(runs, cfg.modes, info["gradient_bytes"])
    return rows, per_k


def phase_profile(runs: list[dict], modes: list, gradient_bytes: int) -> dict:
    """Per mode, pooled over K and repeats: median phase times (s) and the all-reduce's time in flight."""
    out = {}
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        mbs = [m for r in rs for m in r["micro_batches"]]
        per_sync = _median([r["seconds_per_sync"] for r in rs if r["syncs"]])
        out[mode] = {
            "forward_s": _median([m["forward_s"] for m in mbs]),
            "backward_no_sync_s": _median([m["backward_s"] for m in mbs if not m["sync"]]),
            "backward_sync_s": _median([m["backward_s"] for m in mbs if m["sync"]]),
            "optimizer_s": _median([x for r in rs for x in r["optimizer_seconds"]]),
            "other_s": _median([x for r in rs for x in r["other_seconds"]]),
            "allreduce_s_per_sync": per_sync,
            "allreduce_GBps": _div(gradient_bytes / 1e9, per_sync),
        }
    return out


def format_profile(profile: dict) -> str:
    lines = [f"  {'profile (medians, s)':22s} {'forward':>8s} {'bwd no-sync':>11s} {'bwd sync':>9s} {'optimizer':>9s} "
             f"{'other':>7s} {'all-reduce in flight/sync':>26s}"]
    for mode, p in profile.items():
        bw = f" ({p['allreduce_GBps']:.2f} GB/s)" if p["allreduce_GBps"] else ""
        lines.append(f"  {mode:22s} {_f(p['forward_s'], '{:.4f}'):>8s} {_f(p['backward_no_sync_s'], '{:.4f}', '-'):>11s} "
                     f"{_f(p['backward_sync_s'], '{:.4f}', '-'):>9s} {_f(p['optimizer_s'], '{:.4f}'):>9s} "
                     f"{_f(p['other_s'], '{:.4f}'):>7s} {(_f(p['allreduce_s_per_sync'], '{:.4f}') + bw):>26s}")
    lines.append("  (forward/backward: per micro-batch; optimizer (incl. rescale and token-count all-reduce) and other "
                 "(batches, loop code): per step)")
    return "\n".join(lines)


def paired_ratio(runs: list[dict], K: int, num: str, den: str) -> tuple[float | None, list]:
    """Median over repeats of (median step of ``num``'s run / median step of ``den``'s run) at this K.

    Runs of one (repeat, K) block ran back to back, so a burst of load from
    outside that hits one block (or one repeat) moves both sides of its ratio
    or is voted out by the other repeats; a ratio of pooled medians has no
    such protection.
    """
    ratios = []
    for rep in sorted({r["repeat"] for r in runs}):
        t = {r["mode"]: _median(r["step_seconds"]) for r in runs if r["K"] == K and r["repeat"] == rep}
        if num in t and den in t and t[den]:
            ratios.append(t[num] / t[den])
    return _median(ratios), ratios


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


def _worst_bar(name: str, description: str, items: list, threshold: float) -> dict:
    """A bar that every ``(ratio, label)`` in ``items`` must meet (ratio <= threshold); None when nothing was measured."""
    worst = max(items) if items else None
    return {"name": name, "description": description, "value": worst[0] if worst else None, "threshold": threshold,
            "passed": None if worst is None else all(r <= threshold for r, _ in items),
            "detail": None if worst is None else f"worst {worst[0]:.3f} ({worst[1]}); all: "
            + ", ".join(f"{label}: {r:.3f}" for r, label in items)}


def evaluate_bars(rows: list[dict], per_k: list[dict], cfg: BenchConfig) -> list[dict]:
    """The four bars of issue 5 on what this run measured (``passed`` None = not measured)."""
    bars = []
    ck = next((d for d in per_k if d["preset"] == COMM_HEAVY and d["K"] == BAR_K), None)
    sp = ck["speedup"] if ck else None
    bars.append({"name": "speedup", "description": f"{COMM_HEAVY} K={BAR_K}: no_sync >= {BAR_MIN_SPEEDUP}x faster than sync_each_batch",
                 "value": sp, "threshold": BAR_MIN_SPEEDUP, "passed": None if sp is None else sp >= BAR_MIN_SPEEDUP,
                 "detail": None if sp is None else f"{sp:.3f}x"})
    fr = ck["fraction_of_ideal"] if ck else None
    bars.append({"name": "fraction_of_ideal",
                 "description": f"{COMM_HEAVY} K={BAR_K}: speedup >= {BAR_MIN_FRACTION_OF_IDEAL:.0%} of the ideal (Kc+Ka)/(Kc+a)",
                 "value": fr, "threshold": BAR_MIN_FRACTION_OF_IDEAL,
                 "passed": None if fr is None else fr >= BAR_MIN_FRACTION_OF_IDEAL,
                 "detail": None if fr is None else f"{fr:.1%} ({sp:.3f}x of ideal {ck['ideal_speedup']:.3f}x)"})
    ratios = [(d["no_sync_over_raw_ddp"], f'{d["preset"]} K={d["K"]}') for d in per_k if d["no_sync_over_raw_ddp"] is not None]
    bars.append(_worst_bar("no_sync_vs_raw_ddp", f"no_sync / raw_ddp step time <= {BAR_MAX_RAW_RATIO} at every K",
                           ratios, BAR_MAX_RAW_RATIO))
    lo, hi = BAR_MEMORY_K
    mem = []
    for r_hi in rows:
        if r_hi["K"] != hi or r_hi["peak_rss_mb"] is None:
            continue
        r_lo = next((r for r in rows if r["preset"] == r_hi["preset"] and r["mode"] == r_hi["mode"] and r["K"] == lo), None)
        if r_lo and r_lo["peak_rss_mb"]:
            mem.append((r_hi["peak_rss_mb"] / r_lo["peak_rss_mb"], f'{r_hi["preset"]} {r_hi["mode"]}'))
    bars.append(_worst_bar("memory", f"peak memory at K={hi} <= {BAR_MAX_MEMORY_RATIO}x that at K={lo}",
                           mem, BAR_MAX_MEMORY_RATIO))
    return bars


# --------------------------------------------------------------------------- text, CSV, plot


def _f(x, fmt="{:.3f}", none="n/a"):
    return none if x is None else fmt.format(x)


def format_preset_table(preset: str, info: dict, rows: list[dict], per_k: list[dict], modes: list) -> str:
    """The table printed per preset: median [min-max] step seconds per mode, ideal, speedup, memory, comm."""
    head = (f"{preset}: {info['parameters'] / 1e6:.1f}M parameters ({info['gradient_bytes'] / 2**20:.0f} MB of gradients), "
            f"micro-batch {info['micro_batch']}; c = {_f(info['c_seconds'], '{:.4f}')} s compute / micro-batch, "
            f"a = {_f(info['a_seconds'], '{:.4f}')} s exposed all-reduce / sync")
    cols = [f"{m + ' s/step':>25s}" for m in modes]
    lines = [head, f"{'K':>3s} " + " ".join(cols) + f" {'Kc+a':>7s} {'speedup':>8s} {'ideal':>7s} {'% ideal':>8s}"
             f" {'ns/raw':>7s} {'peak MB':>8s} {'comm% each/ns':>13s}"]
    for d in per_k:
        K = d["K"]
        by_mode = {r["mode"]: r for r in rows if r["K"] == K}
        cells = []
        for m in modes:
            r = by_mode[m]
            cells.append(f"{_f(r['step_s_median'])} [{_f(r['step_s_min'])}-{_f(r['step_s_max'])}]".rjust(25))
        peak = max((r["peak_rss_mb"] for r in by_mode.values() if r["peak_rss_mb"] is not None), default=None)
        share = "/".join(_f(by_mode[m]["comm_share_exposed"], "{:.0%}", "-") if m in by_mode else "-" for m in ("sync_each_batch", "no_sync"))
        lines.append(f"{K:>3d} " + " ".join(cells) + f" {_f(d['ideal_no_sync_step_s']):>7s} {_f(d['speedup'], '{:.2f}x'):>8s}"
                     f" {_f(d['ideal_speedup'], '{:.2f}x'):>7s} {_f(d['fraction_of_ideal'], '{:.0%}'):>8s}"
                     f" {_f(d['no_sync_over_raw_ddp']):>7s} {_f(peak, '{:.0f}'):>8s} {share:>13s}")
    lines.append("  (s/step: median [min-max] over repeats x measured steps; Kc+a: ideal no_sync s/step; speedup: "
                 "sync_each_batch / no_sync; ideal: (Kc+Ka)/(Kc+a); ns/raw: no_sync / raw_ddp (ratios: median over "
                 "repeats of the ratio within each repeat); peak MB: resident "
                 "set high-water mark, max over modes and processes; comm%: exposed all-reduce share of the step)")
    return "\n".join(lines)


def format_bars(bars: list[dict]) -> str:
    lines = []
    for b in bars:
        verdict = "SKIP (not measured)" if b["passed"] is None else ("PASS" if b["passed"] else "FAIL")
        lines.append(f"{verdict:4s}  {b['description']}: {b['detail'] or 'n/a'}")
    return "\n".join(lines)


def csv_text(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    return buf.getvalue()


_COLORS = {"sync_each_batch": "tab:red", "no_sync": "tab:blue", "raw_ddp": "tab:green"}


def plot_png(result: dict) -> bytes | None:
    """Step time against K per mode with the ideal (top), exposed communication share (bottom); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    presets = list(result["presets"])
    fig, axes = plt.subplots(2, len(presets), figsize=(6 * len(presets), 8), squeeze=False)
    for j, preset in enumerate(presets):
        info = result["presets"][preset]
        rows = [r for r in result["rows"] if r["preset"] == preset]
        per_k = [d for d in result["per_k"] if d["preset"] == preset]
        ks = [d["K"] for d in per_k]
        top, bottom = axes[0][j], axes[1][j]
        for mode in result["config"]["modes"]:
            rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["K"])
            x = [r["K"] for r in rs]
            y = [r["step_s_median"] for r in rs]
            err = [[r["step_s_median"] - r["step_s_min"] for r in rs], [r["step_s_max"] - r["step_s_median"] for r in rs]]
            top.errorbar(x, y, yerr=err, marker="o", capsize=3, label=mode, color=_COLORS.get(mode))
            share = [100 * (r["comm_share_exposed"] or 0.0) for r in rs]
            bottom.plot(x, share, marker="o", label=f"{mode} (exposed)", color=_COLORS.get(mode))
            busy = [100 * (r["allreduce_busy_share"] or 0.0) for r in rs]
            bottom.plot(x, busy, marker="x", linestyle=":", color=_COLORS.get(mode), alpha=0.6,
                        label=f"{mode} (all-reduce in flight)")
        if all(d["ideal_no_sync_step_s"] is not None for d in per_k):
            top.plot(ks, [d["ideal_no_sync_step_s"] for d in per_k], "k--", label="ideal no_sync: K c + a")
            top.plot(ks, [d["ideal_sync_each_batch_step_s"] for d in per_k], color="0.5", linestyle=":",
                     label="ideal sync each: K (c + a)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks)
            ax.set_xticklabels([str(k) for k in ks])
            ax.set_xlabel("gradient accumulation steps K")
            ax.grid(True, alpha=0.3)
        top.set_ylabel("seconds per optimizer step (median, min-max)")
        top.set_title(f"{preset}: {info['parameters'] / 1e6:.1f}M params, micro-batch {info['micro_batch']}, "
                      f"{result['machine']['world_size']} procs", fontsize=10)
        top.legend(fontsize=8)
        bottom.set_ylabel("% of step time in communication")
        bottom.set_ylim(0, 100)
        bottom.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_outputs(output_dir: str, result: dict) -> list[Path]:
    """bench.json, bench.csv and bench.png (if matplotlib is present); returns the paths.

    All three are made in a staging directory first and moved in only when
    every one of them exists, so a failure leaves ``output_dir`` as it was and
    new data never sits beside an old plot.
    """
    png = plot_png(result)
    names = ["bench.json", "bench.csv"] + (["bench.png"] if png is not None else [])
    with staged_output_dir(output_dir) as staging:
        atomic_write_json(staging / "bench.json", result)
        atomic_write_bytes(staging / "bench.csv", csv_text(result["rows"]).encode())
        if png is not None:
            atomic_write_bytes(staging / "bench.png", png)
    stale = Path(output_dir) / "bench.png"
    if png is None and stale.exists():
        stale.unlink()  # a plot of an earlier run must not pass for this one
    return [Path(output_dir) / n for n in names]


