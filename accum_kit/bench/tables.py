"""The text ``accum-kit bench`` prints: a table per preset, its phase profile, and the bars' verdicts."""

from __future__ import annotations

import textwrap

from tabulate import tabulate

from ..stats import resolved

#: How a ratio whose 95 % interval contains 1 is marked.
NOT_RESOLVED = "not resolved"


def _f(x, fmt: str = "{:.3f}", none: str = "n/a") -> str:
    return none if x is None else fmt.format(x)


def fmt_ratio(point, low, high, fmt: str = "{:.3f}", suffix: str = "") -> str:
    """``point [low-high]`` (the 95 % interval), ``not resolved`` appended when the interval contains 1.

    The point is the median of the per-pass ratios and the interval is centred
    on their geometric mean (:func:`accum_kit.stats.ratio_interval`); when
    skewed ratios put the median outside the interval, ``(median outside)``
    is appended so that the pair is not read as one estimate.
    """
    if point is None:
        return "n/a"
    text = fmt.format(point) + suffix
    if low is None or high is None:
        return text + " [n<2]"
    text += f" [{fmt.format(low)}-{fmt.format(high)}]"
    text += f" {NOT_RESOLVED}" if resolved(low, high) is False else ""
    return text + (" (median outside)" if not low <= point <= high else "")


def _table(rows: list, headers: list, colalign: tuple) -> str:
    return tabulate(rows, headers=headers, tablefmt="simple", colalign=colalign, disable_numparse=True)


def format_preset_table(preset: str, info: dict, rows: list[dict], per_k: list[dict], modes: list) -> str:
    """Per K: median [min-max] step seconds per mode, ideal, speedup, raw ratio, peak memory, comm share."""
    head = (f"{preset}: {info['parameters'] / 1e6:.1f}M parameters ({info['gradient_bytes'] / 2**20:.0f} MB of gradients), "
            f"micro-batch {info['micro_batch']}; c = {_f(info['c_seconds'], '{:.4f}')} s compute / micro-batch, "
            f"a = {_f(info['a_seconds'], '{:.4f}')} s exposed all-reduce / sync")
    headers = ["K", *(f"{m} s/step" for m in modes), "Kc+a", "speedup", "ideal", "% ideal", "ns/raw", "ns/raw CPU",
               "peak MB", "comm% each/ns"]
    table = []
    for d in per_k:
        by_mode = {r["mode"]: r for r in rows if r["K"] == d["K"]}
        cells = [f"{_f(by_mode[m]['step_s_median'])} [{_f(by_mode[m]['step_s_min'])}-{_f(by_mode[m]['step_s_max'])}]"
                 for m in modes]
        peak = max((r["peak_rss_mb"] for r in by_mode.values() if r["peak_rss_mb"] is not None), default=None)
        share = "/".join(_f(by_mode[m]["comm_share_exposed"], "{:.0%}", "-") if m in by_mode else "-"
                         for m in ("sync_each_batch", "no_sync"))
        table.append([str(d["K"]), *cells, _f(d["ideal_no_sync_step_s"]),
                      fmt_ratio(d["speedup"], d["speedup_ci_low"], d["speedup_ci_high"], "{:.2f}", "x"),
                      _f(d["ideal_speedup"], "{:.2f}x"), _f(d["fraction_of_ideal"], "{:.0%}"),
                      fmt_ratio(d["no_sync_over_raw_ddp"], d["no_sync_over_raw_ddp_ci_low"], d["no_sync_over_raw_ddp_ci_high"]),
                      fmt_ratio(d.get("no_sync_over_raw_ddp_cpu"), d.get("no_sync_over_raw_ddp_cpu_ci_low"),
                                d.get("no_sync_over_raw_ddp_cpu_ci_high")),
                      _f(peak, "{:.0f}"), share])
    note = ("(s/step: median [min-max] over repeats x measured steps; Kc+a: ideal no_sync s/step; speedup: "
            "sync_each_batch / no_sync; ideal: (Kc+Ka)/(Kc+a); ns/raw: no_sync / raw_ddp, in step time and in the "
            "process's CPU seconds per step (the work done; other jobs' load barely moves it). Ratios: median over "
            "repeats of the ratio of the two modes' runs within each repeat, [95% interval: t-interval on the log "
            f"ratios over repeats], '{NOT_RESOLVED}' when it contains 1; peak MB: resident set high-water mark, max "
            "over modes and processes; comm%: exposed all-reduce share of the step)")
    return "\n".join([head, _table(table, headers, ("right",) * len(headers)), textwrap.indent(textwrap.fill(note, 118), "  ")])


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
    """One line per bar: PASS, FAIL, UNRESOLVED or SKIP (not measured), its description and the measured values.

    Verdicts come from the 95 % intervals (:func:`accum_kit.bench.report.evaluate_bars`).
    """
    lines = []
    for b in bars:
        verdict = "SKIP (not measured)" if b["verdict"] == "SKIP" else b["verdict"]
        lines.append(f"{verdict:4s}  {b['description']}: {b['detail'] or 'n/a'}")
    lines.append("(verdicts by the 95% interval of each ratio: PASS = the whole interval meets the bar, FAIL = "
                 "none of it does, UNRESOLVED = it straddles the bar or has < 2 repeats)")
    return "\n".join(lines)


def format_peer_table(rows: list[dict], modes: list, variable_targets: bool) -> str:
    """Per K and mode: s/step, accum-kit (no_sync) / mode with its interval, loss difference from no_sync,
    all-reduces and exposed communication per sync (for the peers and the manual all-reduce modes)."""
    headers = ["K", "mode", "s/step [min-max]", "no_sync / mode [95% CI]", "same, CPU s", "loss - no_sync: max |d|",
               "mean d", "all-reduces / step", "syncs / step", "exposed comm / sync"]
    table = []
    for r in sorted(rows, key=lambda r: (r["K"], modes.index(r["mode"]))):
        table.append([str(r["K"]), r["mode"], f"{_f(r['step_s_median'])} [{_f(r['step_s_min'])}-{_f(r['step_s_max'])}]",
                      fmt_ratio(r["no_sync_over_mode"], r.get("no_sync_over_mode_ci_low"), r.get("no_sync_over_mode_ci_high")),
                      fmt_ratio(r.get("no_sync_over_mode_cpu"), r.get("no_sync_over_mode_cpu_ci_low"),
                                r.get("no_sync_over_mode_cpu_ci_high")),
                      _f(r["loss_max_abs_diff_vs_no_sync"], "{:.2e}"),
                      _f(r["loss_mean_diff_vs_no_sync"], "{:+.2e}"), _f(r["allreduce_calls_per_step"], "{:g}"),
                      _f(r["syncs_per_step"], "{:g}"), _f(r.get("exposed_comm_s_per_sync"), "{:.4f} s")])
    text = _table(table, headers, ("right", "left") + ("right",) * (len(headers) - 2))
    data = ("rows with a random number of targets (--variable_targets)" if variable_targets else
            "every position a target: all micro-batches hold the same number of targets, so the guide's mean of "
            "micro-batch means equals the token mean here (pass --variable_targets to see it differ)")
    note = ("(no_sync / mode is the paired step-time ratio, < 1 = accum-kit faster, with its 95% interval, "
            f"'{NOT_RESOLVED}' when that contains 1; loss: per-step loss minus no_sync's, nats, same repeat and step; "
            f"data: {data}; all-reduces: DDP gradient buckets seen by the comm hook, or the manual modes' own "
            "dist.all_reduce calls; the token-count / loss collectives not included; exposed comm / sync: median "
            "backward of the synchronising micro-batch minus no_sync's median backward without sync)")
    return textwrap.indent(text + "\n" + textwrap.fill(note, 118), "  ")
