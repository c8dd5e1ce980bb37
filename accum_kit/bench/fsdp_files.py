"""The files of the FSDP2 bench: bench.json, bench.csv (one row per preset x K x policy), bench.png (the trade-off)."""

from __future__ import annotations

from pathlib import Path

from .files import csv_text, png_bytes, write_bench_files

CSV_FIELDS = (
    "preset", "K", "policy", "n_steps", "n_pairs", "step_s_median", "step_s_q1", "step_s_q3",
    "speedup_vs_sync_each_batch", "speedup_ci_low", "speedup_ci_high", "seconds_saved_per_step", "saved_ci_low",
    "saved_ci_high", "reduce_scatter_calls_per_step", "all_gather_calls_per_step", "reduce_scatter_mb_per_step",
    "all_gather_mb_per_step", "reduce_scatter_busbw_GBps", "all_gather_busbw_GBps", "gradient_mb_peak",
    "predicted_gradient_mb", "gradient_measured_over_predicted", "gathered_parameter_mb_peak",
    "predicted_gathered_mb", "memory_added_mb", "peak_rss_mb", "own_ideal_s", "over_ideal", "ideal_s",
    "over_shared_ideal", "estimated_saved_s",
    "estimated_over_measured", "cpu_seconds_saved_per_step", "cpu_saved_ci_low", "cpu_saved_ci_high",
    "estimated_cpu_saved_s", "estimated_over_measured_cpu",
)
COLORS = {"sync_each_batch": "tab:red", "no_sync": "tab:blue", "no_sync_no_reshard_after_backward": "tab:orange",
          "no_sync_no_reshard": "tab:green"}
MARKERS = "os^Dv<>p*h"


def plot_png(result: dict) -> bytes:
    """PNG bytes, per preset: seconds saved per step against memory added, per K and policy (left; 95 %
    intervals of the paired saving), and step time against K per policy with its ideal (right)."""
    import matplotlib

    matplotlib.use("Agg")  # here, not at import: a notebook may use another backend
    import matplotlib.pyplot as plt

    presets = list(result["presets"])
    fig, axes = plt.subplots(len(presets), 2, figsize=(13, 5 * len(presets)), squeeze=False)
    for i, preset in enumerate(presets):
        rows = [r for r in result["rows"] if r["preset"] == preset]
        ks = sorted({r["K"] for r in rows})
        left, right = axes[i]
        for j, K in enumerate(ks):
            for r in (r for r in rows if r["K"] == K and r["seconds_saved_per_step"] is not None):
                lo, hi = r["saved_ci_low"], r["saved_ci_high"]
                err = [[r["seconds_saved_per_step"] - lo], [hi - r["seconds_saved_per_step"]]] if lo is not None else None
                left.errorbar([r["memory_added_mb"]], [r["seconds_saved_per_step"]], yerr=err, capsize=3,
                              marker=MARKERS[j % len(MARKERS)], color=COLORS.get(r["policy"]), linestyle="none")
            left.plot([], [], MARKERS[j % len(MARKERS)], color="0.3", label=f"K={K}")
            pts = sorted(((r["memory_added_mb"], r["seconds_saved_per_step"]) for r in rows
                          if r["K"] == K and r["seconds_saved_per_step"] is not None), key=lambda p: p[0])
            left.plot([p[0] for p in pts], [p[1] for p in pts], color="0.6", linewidth=0.8, zorder=0)
        for policy, color in COLORS.items():
            left.plot([], [], "s", color=color, label=policy)
        left.axhline(0, color="k", linewidth=0.6)
        left.set_xlabel("memory added per process vs sync_each_batch, MB (gradients + gathered parameters)")
        left.set_ylabel("seconds saved per step vs sync_each_batch")
        left.set_title(f"{preset}: saving against memory (markers: K; colours: policy)", fontsize=10)
        left.legend(fontsize=7)
        for policy in result["config"]["accumulation_policies"]:
            rs = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["K"])
            right.errorbar([r["K"] for r in rs], [r["step_s_median"] for r in rs],
                           yerr=[[r["step_s_median"] - r["step_s_q1"] for r in rs],
                                 [r["step_s_q3"] - r["step_s_median"] for r in rs]],
                           marker="o", capsize=3, color=COLORS.get(policy), label=policy)
            if all(r["own_ideal_s"] is not None for r in rs):
                right.plot([r["K"] for r in rs], [r["own_ideal_s"] for r in rs], linestyle="--", color=COLORS.get(policy),
                           alpha=0.6)
        right.set_xscale("log", base=2)
        right.set_xticks(ks)
        right.set_xticklabels([str(k) for k in ks])
        right.set_xlabel("gradient accumulation steps K")
        right.set_ylabel("seconds per optimizer step (median, quartiles; dashed: ideal)")
        right.set_title(f"{preset}: {result['machine']['world_size']} processes, FSDP2", fontsize=10)
        right.legend(fontsize=7)
        for ax in (left, right):
            ax.grid(True, alpha=0.3)
    return png_bytes(fig)


def write_fsdp_outputs(output_dir: str, result: dict) -> list[Path]:
    """Write bench.json, bench.csv and bench.png into ``output_dir`` (staged, all or nothing); returns their paths."""
    png = plot_png(result)  # before anything is written: a plotting error leaves no partial output
    return write_bench_files(output_dir, result, csv_text(result["rows"], CSV_FIELDS), png)
