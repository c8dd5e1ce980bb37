"""The one writer of ``accum-kit bench``'s files, and what goes into them: JSON, CSV rows, the plots.

Every part of the sweep writes through :func:`write_files`: its files (``bench.json``, ``bench.csv`` and, for
the DDP modes and the FSDP2 policies, ``bench.png``; ``--tune``: ``tune.json`` and ``tune.csv``;
``--torch_compile``: ``compile.json``) are made in a staging directory next to ``--output_dir`` and moved
in only when every one of them exists, so a failure leaves ``--output_dir`` as it was and new data never
sits beside an old plot. The CSV columns are the part's (its ``report_<part>`` module); the plots are here.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from ..outputs import atomic_write_bytes, atomic_write_json, staged_output_dir


def csv_text(rows: list[dict], fields) -> str:
    """The rows as CSV with the columns ``fields`` (None as an empty cell, dicts as JSON)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else json.dumps(r[k], sort_keys=True) if isinstance(r[k], dict)
                        else r[k]) for k in fields})
    return buf.getvalue()


def write_files(output_dir: str, files: dict) -> list[Path]:
    """Write ``files`` (name -> contents: a dict as indented JSON, a str as UTF-8 text, bytes as they are)
    into ``output_dir``, staged: all of them or, on an error, none; returns their paths in ``files``' order.

    Make every file's contents (the plot included) before calling: an error while making one then leaves
    no partial output.
    """
    with staged_output_dir(output_dir) as staging:
        for name, data in files.items():
            if isinstance(data, dict):
                atomic_write_json(staging / name, data)
            else:
                atomic_write_bytes(staging / name, data.encode() if isinstance(data, str) else data)
    return [Path(output_dir) / name for name in files]


def png_bytes(fig) -> bytes:
    """A laid-out matplotlib figure as PNG bytes (110 dpi); the figure is closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


# --------------------------------------------------------------------------- plots

MODE_COLORS = {"sync_each_batch": "tab:red", "no_sync": "tab:blue", "raw_ddp": "tab:green", "trainer": "tab:purple",
               "accelerate_guide": "tab:orange", "manual_allreduce": "tab:brown", "manual_allreduce_flat": "tab:olive"}


def plot_modes_png(result: dict) -> bytes:
    """The DDP modes' plot, PNG bytes: per preset, step time against K per mode with the ideal (top), communication share (bottom)."""
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
            top.errorbar(x, y, yerr=err, marker="o", capsize=3, label=mode, color=MODE_COLORS.get(mode))
            share = [100 * (r["comm_share_exposed"] or 0.0) for r in rs]
            bottom.plot(x, share, marker="o", label=f"{mode} (exposed)", color=MODE_COLORS.get(mode))
            busy = [100 * (r["allreduce_busy_share"] or 0.0) for r in rs]
            bottom.plot(x, busy, marker="x", linestyle=":", color=MODE_COLORS.get(mode), alpha=0.6,
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


POLICY_COLORS = {"sync_each_batch": "tab:red", "no_sync": "tab:blue", "no_sync_no_reshard_after_backward": "tab:orange",
                 "no_sync_no_reshard": "tab:green"}
MARKERS = "os^Dv<>p*h"


def plot_policies_png(result: dict) -> bytes:
    """The FSDP2 / HSDP policies' plot, PNG bytes, per preset: seconds saved per step against memory added, per K and policy (left; 95 %
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
                              marker=MARKERS[j % len(MARKERS)], color=POLICY_COLORS.get(r["policy"]), linestyle="none")
            left.plot([], [], MARKERS[j % len(MARKERS)], color="0.3", label=f"K={K}")
            pts = sorted(((r["memory_added_mb"], r["seconds_saved_per_step"]) for r in rows
                          if r["K"] == K and r["seconds_saved_per_step"] is not None), key=lambda p: p[0])
            left.plot([p[0] for p in pts], [p[1] for p in pts], color="0.6", linewidth=0.8, zorder=0)
        for policy, color in POLICY_COLORS.items():
            left.plot([], [], "s", color=color, label=policy)
        left.axhline(0, color="k", linewidth=0.6)
        left.set_xlabel("memory added per process vs sync_each_batch, MB (gradients + gathered parameters)")
        left.set_ylabel("seconds saved per step vs sync_each_batch")
        left.set_title(f"{preset}: saving against memory (markers: K; colours: policy)", fontsize=10)
        left.legend(fontsize=7)
        for policy in result["config"]["accumulation_policies"]:
            rs = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["K"])
            if not rs:  # a fused arm: its figures are the loss axis's, not a policy row
                continue
            right.errorbar([r["K"] for r in rs], [r["step_s_median"] for r in rs],
                           yerr=[[r["step_s_median"] - r["step_s_q1"] for r in rs],
                                 [r["step_s_q3"] - r["step_s_median"] for r in rs]],
                           marker="o", capsize=3, color=POLICY_COLORS.get(policy), label=policy)
            if all(r["own_ideal_s"] is not None for r in rs):
                right.plot([r["K"] for r in rs], [r["own_ideal_s"] for r in rs], linestyle="--", color=POLICY_COLORS.get(policy),
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
