"""The text ``accum-kit bench`` prints: a table per preset, its phase profile, and the bars' verdicts."""

from __future__ import annotations

import textwrap

from tabulate import tabulate


def _f(x, fmt: str = "{:.3f}", none: str = "n/a") -> str:
    return none if x is None else fmt.format(x)


def _table(rows: list, headers: list, colalign: tuple) -> str:
    return tabulate(rows, headers=headers, tablefmt="simple", colalign=colalign, disable_numparse=True)


def format_preset_table(preset: str, info: dict, rows: list[dict], per_k: list[dict], modes: list) -> str:
    """Per K: median [min-max] step seconds per mode, ideal, speedup, raw ratio, peak memory, comm share."""
    head = (f"{preset}: {info['parameters'] / 1e6:.1f}M parameters ({info['gradient_bytes'] / 2**20:.0f} MB of gradients), "
            f"micro-batch {info['micro_batch']}; c = {_f(info['c_seconds'], '{:.4f}')} s compute / micro-batch, "
            f"a = {_f(info['a_seconds'], '{:.4f}')} s exposed all-reduce / sync")
    headers = ["K", *(f"{m} s/step" for m in modes), "Kc+a", "speedup", "ideal", "% ideal", "ns/raw", "peak MB",
               "comm% each/ns"]
    table = []
    for d in per_k:
        by_mode = {r["mode"]: r for r in rows if r["K"] == d["K"]}
        cells = [f"{_f(by_mode[m]['step_s_median'])} [{_f(by_mode[m]['step_s_min'])}-{_f(by_mode[m]['step_s_max'])}]"
                 for m in modes]
        peak = max((r["peak_rss_mb"] for r in by_mode.values() if r["peak_rss_mb"] is not None), default=None)
        share = "/".join(_f(by_mode[m]["comm_share_exposed"], "{:.0%}", "-") if m in by_mode else "-"
                         for m in ("sync_each_batch", "no_sync"))
        table.append([str(d["K"]), *cells, _f(d["ideal_no_sync_step_s"]), _f(d["speedup"], "{:.2f}x"),
                      _f(d["ideal_speedup"], "{:.2f}x"), _f(d["fraction_of_ideal"], "{:.0%}"),
                      _f(d["no_sync_over_raw_ddp"]), _f(peak, "{:.0f}"), share])
    note = ("  (s/step: median [min-max] over repeats x measured steps; Kc+a: ideal no_sync s/step; speedup: "
            "sync_each_batch / no_sync; ideal: (Kc+Ka)/(Kc+a); ns/raw: no_sync / raw_ddp (ratios: median over "
            "repeats of the ratio within each repeat); peak MB: resident "
            "set high-water mark, max over modes and processes; comm%: exposed all-reduce share of the step)")
    return "\n".join([head, _table(table, headers, ("right",) * len(headers)), note])


def format_profile(profile: dict) -> str:
    """Per mode: median forward, backward (no-sync / sync), optimizer and other seconds, all-reduce per sync."""
    headers = ["profile (medians, s)", "forward", "bwd no-sync", "bwd sync", "optimizer", "other",
               "all-reduce in flight/sync"]
    table = []
    for mode, p in profile.items():
        bw = f" ({p['allreduce_GBps']:.2f} GB/s)" if p["allreduce_GBps"] else ""
        table.append([mode, _f(p["forward_s"], "{:.4f}"), _f(p["backward_no_sync_s"], "{:.4f}", "-"),
                      _f(p["backward_sync_s"], "{:.4f}", "-"), _f(p["optimizer_s"], "{:.4f}"),
                      _f(p["other_s"], "{:.4f}"), _f(p["allreduce_s_per_sync"], "{:.4f}") + bw])
    text = _table(table, headers, ("left",) + ("right",) * (len(headers) - 1))
    note = ("(forward/backward: per micro-batch; optimizer (incl. rescale and token-count all-reduce) and other "
            "(batches, loop code): per step)")
    return textwrap.indent(text + "\n" + note, "  ")


def format_bars(bars: list[dict]) -> str:
    """One line per bar: PASS, FAIL or SKIP (not measured), its description and the measured value."""
    lines = []
    for b in bars:
        verdict = "SKIP (not measured)" if b["passed"] is None else ("PASS" if b["passed"] else "FAIL")
        lines.append(f"{verdict:4s}  {b['description']}: {b['detail'] or 'n/a'}")
    return "\n".join(lines)


def format_peer_table(rows: list[dict], modes: list, variable_targets: bool) -> str:
    """Per K and mode: s/step, accum-kit (no_sync) / mode, per-step loss difference from no_sync, all-reduces."""
    headers = ["K", "mode", "s/step [min-max]", "no_sync / mode", "loss - no_sync: max |d|", "mean d",
               "bucket all-reduces / step", "syncs / step"]
    table = []
    for r in sorted(rows, key=lambda r: (r["K"], modes.index(r["mode"]))):
        table.append([str(r["K"]), r["mode"], f"{_f(r['step_s_median'])} [{_f(r['step_s_min'])}-{_f(r['step_s_max'])}]",
                      _f(r["no_sync_over_mode"]), _f(r["loss_max_abs_diff_vs_no_sync"], "{:.2e}"),
                      _f(r["loss_mean_diff_vs_no_sync"], "{:+.2e}"), _f(r["allreduce_calls_per_step"], "{:g}"),
                      _f(r["syncs_per_step"], "{:g}")])
    text = _table(table, headers, ("right", "left") + ("right",) * (len(headers) - 2))
    data = ("rows with a random number of targets (--variable_targets)" if variable_targets else
            "every position a target: all micro-batches hold the same number of targets, so the guide's mean of "
            "micro-batch means equals the token mean here (pass --variable_targets to see it differ)")
    note = ("(peers: no_sync / mode is the paired step-time ratio, < 1 = accum-kit faster; loss: per-step loss "
            f"minus no_sync's, nats, same repeat and step; data: {data}; bucket all-reduces: DDP gradient buckets "
            "seen by the comm hook, the token-count / loss collectives not included)")
    return textwrap.indent(text + "\n" + textwrap.fill(note, 118), "  ")
