"""The files ``accum-kit bench`` writes: bench.json, bench.csv (one row per preset x K x mode), bench.png."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from ..outputs import atomic_write_bytes, atomic_write_json, staged_output_dir
from .tune_report import TUNE_CSV_FIELDS

CSV_FIELDS = (
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

_COLORS = {"sync_each_batch": "tab:red", "no_sync": "tab:blue", "raw_ddp": "tab:green", "trainer": "tab:purple",
           "accelerate_guide": "tab:orange", "manual_allreduce": "tab:brown", "manual_allreduce_flat": "tab:olive"}


def csv_text(rows: list[dict], fields=CSV_FIELDS) -> str:
    """The rows as CSV with the columns ``fields`` (None as an empty cell, dicts as JSON)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else json.dumps(r[k], sort_keys=True) if isinstance(r[k], dict)
                        else r[k]) for k in fields})
    return buf.getvalue()


def plot_png(result: dict) -> bytes:
    """PNG bytes: per preset, step time against K per mode with the ideal (top), communication share (bottom)."""
    import matplotlib

    matplotlib.use("Agg")  # here, not at import: choosing a backend is global, a notebook may use another
    import matplotlib.pyplot as plt

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
    return png_bytes(fig)


def png_bytes(fig) -> bytes:
    """A laid-out matplotlib figure as PNG bytes (110 dpi); the figure is closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_bench_files(output_dir: str, result: dict, csv: str, png: bytes | None) -> list[Path]:
    """Write bench.json (``result``), bench.csv and bench.png (none when ``png`` is None) into ``output_dir``;
    returns their paths.

    All three are made in a staging directory first and moved in only when
    every one of them exists, so a failure leaves ``output_dir`` as it was and
    new data never sits beside an old plot.
    """
    names = ["bench.json", "bench.csv"] + (["bench.png"] if png is not None else [])
    with staged_output_dir(output_dir) as staging:
        atomic_write_json(staging / "bench.json", result)
        atomic_write_bytes(staging / "bench.csv", csv.encode())
        if png is not None:
            atomic_write_bytes(staging / "bench.png", png)
    return [Path(output_dir) / n for n in names]


def write_outputs(output_dir: str, result: dict) -> list[Path]:
    """The DDP bench's bench.json, bench.csv and bench.png in ``output_dir``, via :func:`write_bench_files`."""
    png = plot_png(result)  # before anything is written: a plotting error leaves no partial output
    return write_bench_files(output_dir, result, csv_text(result["rows"]), png)


def write_tune_outputs(output_dir: str, result: dict) -> list[Path]:
    """``--tune``: write tune.json (everything) and tune.csv (one row per preset x setting); returns their paths.

    Staged and moved in together, as :func:`write_outputs`.
    """
    names = ["tune.json", "tune.csv"]
    with staged_output_dir(output_dir) as staging:
        atomic_write_json(staging / "tune.json", result)
        atomic_write_bytes(staging / "tune.csv", csv_text(result["rows"], TUNE_CSV_FIELDS).encode())
    return [Path(output_dir) / n for n in names]
