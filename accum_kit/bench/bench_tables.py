"""The text ``accum-kit bench`` prints: per part a table per preset, and the verdicts (from the rows of the parts' report modules).

- one process: a table per preset of every arm against the plain loop, and one line per target;
- the DDP modes: a table per preset, its phase profile, the peers' table, the bars' verdicts;
- ``--tune``: a table per preset with its recommendation;
- the FSDP2 / HSDP policies and the ZeRO stages: a table per preset and one line per target;
- ``--torch_compile``: compiled against eager per K.

Every ratio is printed with its 95 % interval (:func:`fmt_ratio`), marked ``not resolved`` when that contains 1.
"""

from __future__ import annotations

import textwrap

from tabulate import tabulate

from ..stats import resolved
from .bench_report import _f
from .report_fsdp2 import POLICY_BASE
from .report_tune import TUNE_BASE
from .report_zero import KINDS

#: How a ratio whose 95 % interval contains 1 is marked.
NOT_RESOLVED = "not resolved"


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
    lora = info.get("adapter")  # --use_peft: the trainable parameters are the adapters'
    trained = (f"{info['parameters'] / 1e6:.2f}M trainable (LoRA r {lora['r']}) of {info['all_parameters'] / 1e6:.1f}M "
               "parameters" if lora else f"{info['parameters'] / 1e6:.1f}M parameters")
    head = (f"{preset}: {trained} ({info['gradient_bytes'] / 2**20:.0f} MB of gradients), "
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

    Verdicts come from the 95 % intervals (:func:`accum_kit.bench.report_ddp.evaluate_bars`).
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


# --------------------------------------------------------------------------- one process


def format_one_process_table(preset: str, info: dict, rows: list[dict], modes: list) -> str:
    """Per K and arm: s/step [quartiles], / plain and / plain in CPU seconds [95% CI], tokens/s, MFU, peak memory,
    its rise over the run's start and that rise minus plain's, the loss difference from plain (one process)."""
    peak = info["peak_flops"]
    clip = f"clipping {info['max_grad_norm']:g}" if info["max_grad_norm"] else "no clipping"
    head = (f"{preset}: {info['parameters'] / 1e6:.1f}M parameters, micro-batch {info['micro_batch']}, vocabulary "
            f"{info['vocab_size']}, one process on {info['device']}, mixed precision {info['mixed_precision']}, "
            f"{info['optim']}, {clip}; MFU peak {peak['flops_per_s'] / 1e12:.4g} TFLOP/s ({peak['source']})")
    headers = ["K", "arm", "s/step [q1-q3]", "/ plain [95% CI]", "/ plain, CPU s", "/ kit [95% CI]", "tokens/s", "MFU",
               "peak MB", "+MB in run", "tensors +MB", "predicted", "tensors - plain", "loss - plain: max |d|"]
    table = []
    for r in sorted(rows, key=lambda r: (r["K"], modes.index(r["mode"]))):
        plain = r["mode"] == "plain"
        table.append([str(r["K"]), r["mode"], f"{_f(r['step_s_median'], '{:.4f}')} [{_f(r['step_s_q1'], '{:.4f}')}-"
                      f"{_f(r['step_s_q3'], '{:.4f}')}]",
                      "1 (reference)" if plain else fmt_ratio(r.get("over_plain"), r.get("over_plain_ci_low"),
                                                              r.get("over_plain_ci_high")),
                      "1" if plain else fmt_ratio(r.get("over_plain_cpu"), r.get("over_plain_cpu_ci_low"),
                                                  r.get("over_plain_cpu_ci_high")),
                      "-" if r.get("over_kit") is None else fmt_ratio(r["over_kit"], r.get("over_kit_ci_low"),
                                                                      r.get("over_kit_ci_high")),
                      _f(r["tokens_per_s"], "{:.0f}"), _f(r["mfu"], "{:.1%}"), _f(r["peak_mb"], "{:.0f}"),
                      _f(r["peak_increase_mb"], "{:.1f}"), _f(r["tensor_peak_increase_mb"], "{:.1f}"),
                      _f(r.get("predicted_tensor_peak_increase_mb"), "{:.1f}"),
                      "-" if plain else _f(r.get("tensor_peak_minus_plain_mb"), "{:+.1f}"),
                      "-" if plain else _f(r.get("loss_max_abs_diff_vs_plain"), "{:.2e}")])
    text = _table(table, headers, ("right", "left") + ("right",) * (len(headers) - 2))
    tensors = ((info.get("tensor_peak") or {}).get("method") or
               ("the same rise (CUDA counts tensors)" if str(info["device"]).startswith("cuda") else "not measured"))
    note = ("(s/step: median [quartiles] over repeats x measured steps; / plain: median over repeats of the ratio of "
            "the two arms' runs within each repeat [95% t-interval on the log ratios], "
            f"'{NOT_RESOLVED}' when it contains 1, also in the process's CPU seconds per step; tokens: input tokens, "
            "K x batch x block; MFU: 6 x parameters x tokens/s / the peak above; peak MB: "
            f"{info['memory_method']}, median over runs; +MB in run: its rise over the run's start; tensors +MB: "
            f"{tensors}, the memory model's prediction of it, and that rise minus plain's; / kit: the same ratio to "
            "the first kit arm (the logits' formula); one float32 copy of the logits is "
            f"{info['logits_fp32_bytes'] / 2**20:.1f} MB; loss: per-step loss minus plain's, nats)")
    return "\n".join([head, textwrap.indent(text + "\n" + textwrap.fill(note, 118), "  ")])


def format_loss_axis_table(preset: str, rows: list[dict]) -> str:
    """The loss axis of one preset (:mod:`.report_loss`): per K and fused arm, its step-time ratio to the same loop
    with the logits [95% CI] (wall and CPU seconds), the memory it saved against the prediction, the first losses."""
    headers = ["K", "arm", "against", "s/step ratio [95% CI]", "CPU s ratio", "saved MB [95% CI]", "predicted MB",
               "saved / predicted", "first loss (fused, logits)", "rel. diff"]
    table = []
    for r in rows:
        lo, hi = r["memory_saved_ci_low"], r["memory_saved_ci_high"]
        saved = _f(r["memory_saved_mb"], "{:.1f}") + (f" [{lo:.1f}-{hi:.1f}]" if lo is not None else "")
        firsts = ("-" if r["first_loss_fused"] is None else
                  f"{r['first_loss_fused']:.7f}, {r['first_loss_logits']:.7f}")
        table.append([str(r["K"]), r["arm"], r["against"],
                      fmt_ratio(r["fused_over_logits"], r["fused_over_logits_ci_low"], r["fused_over_logits_ci_high"]),
                      fmt_ratio(r["fused_over_logits_cpu"], r["fused_over_logits_cpu_ci_low"],
                                r["fused_over_logits_cpu_ci_high"]),
                      saved, _f(r["predicted_saved_mb"], "{:.1f}"), _f(r["saved_over_predicted"]), firsts,
                      _f(r["first_loss_rel_diff"], "{:.1e}", "-")])
    text = _table(table, headers, ("right", "left", "left") + ("right",) * (len(headers) - 3))
    method = rows[0]["memory_method"] if rows else ""
    note = ("(the fused loss, train_loop's default, against the same loop with the loss from the logits: step-time "
            f"ratio paired per repeat or per cycle of windows [95% t-interval on the log ratios], '{NOT_RESOLVED}' when "
            f"it contains 1; saved: the logits arm's peak minus the fused arm's ({method}), mean over pairs [95% "
            "t-interval], against the memory model's difference of the two losses; first loss: the first optimizer "
            "step's, same weights and data)")
    return "\n".join([f"{preset}: the fused loss as its own axis",
                      textwrap.indent(text + "\n" + textwrap.fill(note, 118), "  ")])


# --------------------------------------------------------------------------- --tune


def format_tune_table(preset: str, info: dict, rows: list[dict], rec: dict) -> str:
    """Per setting: s/step [interval], / base [interval], exposed comm vs its limit, buckets, peak memory."""
    head = (f"{preset} --tune at K={info['K']}: {info['parameters'] / 1e6:.1f}M parameters "
            f"({info['gradient_bytes'] / 2**20:.0f} MB of gradients), micro-batch {info['micro_batch']}, no_sync loop")
    headers = ["setting", "s/step", "geo. mean [95% CI]", "/ base [95% CI]", "exposed comm / sync", "limit", "exposed / limit",
               "all-reduces / step", "all-reduce / sync", "peak MB (+run)"]
    table = []
    for r in rows:
        step = f"{_f(r['step_s_geomean'])} [{_f(r['step_s_ci_low'])}-{_f(r['step_s_ci_high'])}]"
        vs = "1 (reference)" if r["setting"] == TUNE_BASE else fmt_ratio(r["over_base"], r["over_base_ci_low"], r["over_base_ci_high"])
        peak = f"{_f(r['peak_rss_mb'], '{:.0f}')} (+{_f(r['peak_increase_mb'], '{:.0f}')})"
        table.append([r["setting"], _f(r["step_s_median"]), step, vs, _f(r["exposed_comm_s_per_sync"], "{:.4f}"), _f(r["exposed_limit_s"], "{:.4f}"),
                      _f(r["exposed_over_limit"], "{:.2f}x", "-"), _f(r["allreduce_calls_per_step"], "{:g}"),
                      _f(r["allreduce_s_per_sync"], "{:.4f}"), peak])
    text = _table(table, headers, ("left",) + ("right",) * (len(headers) - 1))
    note = ("(s/step: median of all measured steps; geo. mean: of the per-repeat medians, [95% t-interval]; / base: paired ratio to the base in the same "
            f"repeat [95% interval on the log ratios], '{NOT_RESOLVED}' when it contains 1; exposed comm: boundary "
            "backward minus a backward without sync; limit: max(0, all-reduce in flight per sync - backward without "
            "sync), s; peak MB: resident-set high-water mark (+ its rise during the run), max over repeats and processes)")
    return "\n".join([head, textwrap.indent(text + "\n" + textwrap.fill(note, 118), "  "),
                      f"  recommendation: {rec['text']}"])


# --------------------------------------------------------------------------- FSDP2 / HSDP and ZeRO


def format_fsdp_table(preset: str, info: dict, rows: list[dict]) -> str:
    """Text table of one preset: per K and policy, step time, speedup (interval), collectives, memory, ideal."""
    mesh = info.get("mesh") or {}
    hybrid = mesh.get("dp_replicate_size", 1) > 1
    table = [(r["K"], r["policy"], _f(r["step_s_median"]),
              "1 (reference)" if r["policy"] == POLICY_BASE else
              fmt_ratio(r["speedup_vs_sync_each_batch"], r["speedup_ci_low"], r["speedup_ci_high"], suffix="x"),
              _f(r["seconds_saved_per_step"]), _f(r["reduce_scatter_calls_per_step"], "{:g}"),
              *((_f(r.get("all_reduce_calls_per_step"), "{:g}"),) if hybrid else ()),
              _f(r["all_gather_calls_per_step"], "{:g}"), _f(r["all_gather_mb_per_step"], "{:.1f}"),
              _f(r["gradient_mb_peak"], "{:.2f}"), _f(r["predicted_gradient_mb"], "{:.2f}"),
              _f(r["gathered_parameter_mb_peak"], "{:.2f}"), _f(r["memory_added_mb"], "{:.2f}"),
              _f(r["own_ideal_s"]), _f(r["over_ideal"]), _f(r["ideal_s"])) for r in rows]
    headers = ("K", "policy", "s/step", "speedup vs sync_each [95% CI]", "saved s/step", "RS/step",
               *(("AR/step (replicas)",) if hybrid else ()), "AG/step",
               "AG MB/step", "grad MB held", "predicted", "gathered MB", "MB added", "own ideal s", "over ideal",
               "shared ideal s")
    m = info["model"]
    engine = "FSDP2"
    if hybrid:
        engine = f"HSDP {mesh['dp_replicate_size']} replicas x {mesh['dp_shard_size']} shards"
        if info.get("emulated_inter_node_GBps"):
            engine += (f", EMULATED inter-node link {info['emulated_inter_node_GBps']:g} GB/s "
                       f"({info.get('emulated_seconds_added', 0):.1f} s of delay added)")
    head = (f"{preset} ({engine}, P = {m['P']}: P_f = {m['P_f']} in {m['U_f']} layer units, P_0 = {m['P_0']} in "
            f"{m['U_0']} others; {info['micro_batch']}): c = {_f(info['c_seconds'], '{:.4f}')} s per micro-batch, "
            f"exposed reduce-scatter a = {_f(info['a_seconds'], '{:.4f}')} s per sync, noise floor "
            f"{_f(info['noise_floor'], '{:.1%}')}")
    return head + "\n" + tabulate(table, headers=headers, tablefmt="simple", disable_numparse=True)


def format_zero_table(preset: str, info: dict, rows: list[dict]) -> str:
    """Text table of one preset: per K and stage, step time, ratio to ZeRO-1, collectives, reduction path, memory."""
    table = [(r["K"], f"ZeRO-{r['stage']}", _f(r["step_s_median"]),
              "1 (reference)" if r["stage"] == 1 else
              fmt_ratio(r["ratio_vs_zero1"], r["ratio_ci_low"], r["ratio_ci_high"], suffix="x"),
              "1" if r["stage"] == 1 else
              fmt_ratio(r["cpu_ratio_vs_zero1"], r["cpu_ratio_ci_low"], r["cpu_ratio_ci_high"], suffix="x"),
              " / ".join(f"{_f(r[f'{k}_calls_per_step'], '{:g}')} ({r[f'{k}_mb_per_step']:.1f})" for k in KINDS),
              _f(r["collective_s"]), _f(r["reduction_s"]),
              f"{_f(r['gradient_mb'], '{:.1f}')} / {_f(r['predicted_gradient_mb'], '{:.1f}')}",
              f"{_f(r['parameter_mb'], '{:.1f}')} / {_f(r['predicted_parameter_mb'], '{:.1f}')}",
              _f(r["estimated_saved_s"]), _f(r["estimated_over_measured"])) for r in rows]
    headers = ("K", "stage", "s/step", "vs ZeRO-1 [95% CI]", "CPU s vs ZeRO-1", "AR / RS / AG per step (MiB)", "coll. s", "reduction s",
               "grad MiB held / pred.", "param MiB / pred.", "est. ZeRO-1 saving s", "est./measured")
    head = (f"{preset} (DeepSpeed, P = {info['engine_parameters']}, {info['param_groups']} parameter group(s), "
            f"{info['micro_batch']} per micro-batch)")
    return head + "\n" + tabulate(table, headers=headers, tablefmt="simple", disable_numparse=True)


def format_targets(targets: list[dict]) -> str:
    """One line per target: status, preset, target, what was measured."""
    return "\n".join(f"{t['status']:>12}  {t['preset']}: {t['target']}: {t['detail']}" for t in targets)


# --------------------------------------------------------------------------- --torch_compile


def format_compiled_table(presets: list[dict]) -> str:
    """The per-K figures as text: step times, the paired ratio with its interval, break-even steps."""
    lines = []
    for p in presets:
        lines.append(f"{p['preset']} ({p['parameters'] / 1e6:.2f}M parameters): compile {p['compile_seconds']:.1f} s "
                     f"(first window {p['first_window_seconds']:.1f} s), {p['compile']['graphs']} graphs, "
                     f"recompiles after the first window: {p['recompiles_after_first_window']}")
        lines.append(f"{'K':>3} {'eager s/step':>13} {'compiled s/step':>16} {'compiled/eager [95% CI]':>28} "
                     f"{'saved s/step':>13} {'break-even steps [95% CI]':>26}")
        for r in p["per_k"]:
            ci = r["compiled_over_eager"]
            interval = (f"{ci['geometric_mean']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}]" if ci["low"] is not None
                        else f"{ci['geometric_mean']:.3f} [n/a]")
            lo, hi = r["break_even_steps_interval"]
            even = f"{r['break_even_steps']:.0f}" if r["break_even_steps"] is not None else "never"
            even += f" [{lo:.0f}, {hi:.0f}]" if lo is not None and hi is not None else (
                f" [{lo:.0f}, never]" if lo is not None else "")
            lines.append(f"{r['K']:>3} {r['eager_step_seconds']:>13.4f} {r['compiled_step_seconds']:>16.4f} "
                         f"{interval:>28} {r['seconds_saved_per_step']:>13.4f} {even:>26}")
    return "\n".join(lines)
