"""Figures of the one-process ``accum-kit bench``: every arm against the plain loop (and the kit), paired per repeat.

No torch, nothing from the sweep. Per preset, K and arm (:func:`summarize_one_process`): step seconds (median,
quartiles, range over every measured step of every repeat), CPU seconds per step, tokens per step and per second,
model FLOPs utilisation (:func:`mfu`), the paired ratio to ``plain`` (and to the kit) with its 95 % interval,
wall and CPU, peak memory and its rise over the run's start, that rise minus ``plain``'s (paired per repeat),
the rise of tensor memory (:func:`tensor_rise`) and its difference from ``plain``'s, and the loss difference
from ``plain``; for the kit's arms besides the first (``kit``), their ratio to it, their tensor rise minus its, and
the loss axis (:mod:`.report_loss`: the fused loss against the logits, step time and memory saved against the
prediction); per arm the tensor rise the memory model predicts and the measured one over it. The targets
(:func:`evaluate_one_process_targets`): each kit arm's step at most 1.02 x the plain loop's (the interval's upper
end); the shipped kit's (``kit_fused``) peak below the plain loop's by at least one float32 copy of the logits and
within 10 % of its prediction; the loss axis's two verdicts.
"""

from __future__ import annotations

from ..stats import interval_verdict, median, quartiles, ratio_interval
from .bench_report import MB, paired_ratios, target
from .report_loss import fused_axis_row, fused_axis_targets

#: The kit's arms (with the logits' formula, and with train_loop's default fused loss) and the plain loop's, as
#: ``--modes`` names them.
KIT, KIT_FUSED, PLAIN = "kit", "kit_fused", "plain"
#: The step-time target: the kit at most this times the plain loop (the whole 95 % interval).
KIT_OVER_PLAIN_AT_MOST = 1.02
#: The memory target: the measured tensor rise of the shipped kit within this fraction of its prediction.
PREDICTED_WITHIN = 0.10

ONE_PROCESS_CSV_FIELDS = (
    "preset", "K", "mode", "runs", "step_s_median", "step_s_q1", "step_s_q3", "step_s_min", "step_s_max",
    "step_cpu_s_median", "tokens_per_step", "tokens_per_s", "mfu",
    "over_plain", "over_plain_ci_low", "over_plain_ci_high", "over_plain_cpu", "over_plain_cpu_ci_low",
    "over_plain_cpu_ci_high", "over_kit", "over_kit_ci_low", "over_kit_ci_high",
    "peak_mb", "peak_increase_mb", "peak_increase_minus_plain_mb", "tensor_peak_increase_mb",
    "tensor_peak_minus_plain_mb", "tensor_peak_minus_kit_mb", "predicted_tensor_peak_increase_mb",
    "tensor_measured_over_predicted", "first_loss", "loss_first_rel_diff_vs_plain", "loss_max_abs_diff_vs_plain",
    "over_kit_cpu", "over_kit_cpu_ci_low", "over_kit_cpu_ci_high", "loss_first_rel_diff_vs_kit")


def mfu(parameters: int, tokens_per_s: float | None, flops_per_s: float | None) -> float | None:
    """Model FLOPs utilisation, ``6 x parameters x tokens_per_s / flops_per_s`` (None when either is missing).

    6 FLOP per parameter and token for a forward and backward pass (Kaplan et al. 2020, "Scaling Laws for Neural
    Language Models", section 2.1; the ratio's name is from the PaLM paper, Chowdhery et al. 2022, appendix B).
    """
    if tokens_per_s is None or not flops_per_s:
        return None
    return 6.0 * parameters * tokens_per_s / flops_per_s


def _by_repeat(runs: list[dict], key: str) -> dict:
    return {r["repeat"]: r[key] for r in runs if r.get(key) is not None}


def _ratio(num_runs, den_runs, key: str, prefix: str) -> dict:
    """``{prefix, prefix_ci_low, prefix_ci_high}`` plus the per-repeat ratios: the median over repeats of the
    ratio of the two runs' median steps, with its 95 % interval (:func:`accum_kit.stats.ratio_interval`)."""
    ratios = paired_ratios(num_runs, den_runs, key)
    ci = ratio_interval(ratios)
    return {prefix: ci["median"], f"{prefix}_ci_low": ci["low"], f"{prefix}_ci_high": ci["high"],
            f"{prefix}_per_repeat": ratios}


def tensor_rise(info: dict, K: int, arm: str, per_run_rise: float | None) -> float | None:
    """The rise of tensor memory over a run's start of ``arm`` at ``K``, MB: on the CPU the untimed run's
    (``info["tensor_peak"]``), on CUDA the timed runs' median ``max_memory_allocated`` rise (``per_run_rise``),
    None on a CPU run without it."""
    measured = info.get("tensor_peak")
    if measured:
        return measured["mb"].get(str(K), {}).get(arm)
    return per_run_rise if str(info.get("device", "")).startswith("cuda") else None


def summarize_one_process(preset: str, info: dict, runs: list[dict], modes: list, ks: list, kit: str = KIT) -> list[dict]:
    """One row per K and arm (in ``modes`` order) from the preset's runs.

    Args:
        info: the preset's info (``parameters``, ``tokens_per_micro_batch``, ``peak_flops``).
        runs: records with ``K``, ``mode``, ``repeat``, ``step_seconds`` and ``step_cpu_seconds`` (measured
            steps), ``losses``, ``peak_mb``, ``peak_increase_mb``.
        modes: the arms; ``plain`` and ``kit`` (if among them) are the ratios' denominators.
        ks: the K values.
        kit: the kit arm the ``over_kit`` ratios divide by.
    """
    flops = (info.get("peak_flops") or {}).get("flops_per_s")
    rows = []
    for K in ks:
        at_k = {m: [r for r in runs if r["K"] == K and r["mode"] == m] for m in modes}
        plain, base = at_k.get(PLAIN), at_k.get(kit)
        for m in modes:
            own = at_k[m]
            steps = [s for r in own for s in r["step_seconds"]]
            q1, q3 = quartiles(steps)
            step = median(steps)
            tokens = K * info["tokens_per_micro_batch"]
            tps = tokens / step if step else None
            row = {"preset": preset, "K": K, "mode": m, "runs": len(own), "step_s_median": step, "step_s_q1": q1,
                   "step_s_q3": q3, "step_s_min": min(steps, default=None), "step_s_max": max(steps, default=None),
                   "step_cpu_s_median": median(s for r in own for s in r["step_cpu_seconds"]),
                   "tokens_per_step": tokens, "tokens_per_s": tps, "mfu": mfu(info["parameters"], tps, flops),
                   "peak_mb": median(r["peak_mb"] for r in own if r["peak_mb"] is not None),
                   "peak_increase_mb": median(r["peak_increase_mb"] for r in own if r["peak_increase_mb"] is not None)}
            row["tensor_peak_increase_mb"] = tensor_rise(info, K, m, row["peak_increase_mb"])
            if plain and m != PLAIN:
                row.update(_ratio(own, plain, "step_seconds", "over_plain"))
                row.update(_ratio(own, plain, "step_cpu_seconds", "over_plain_cpu"))
                mine, theirs = _by_repeat(own, "peak_increase_mb"), _by_repeat(plain, "peak_increase_mb")
                diffs = [mine[rep] - theirs[rep] for rep in sorted(mine) if rep in theirs]
                row["peak_increase_minus_plain_mb"] = median(diffs)
                row["peak_increase_minus_plain_mb_per_repeat"] = diffs
                mine, theirs = _by_repeat(own, "losses"), _by_repeat(plain, "losses")
                pairs = [(a, b) for rep in sorted(mine) if rep in theirs for a, b in zip(mine[rep], theirs[rep])]
                firsts = [(mine[rep][0], theirs[rep][0]) for rep in sorted(mine) if rep in theirs and mine[rep] and theirs[rep]]
                row["loss_max_abs_diff_vs_plain"] = max((abs(a - b) for a, b in pairs), default=None)
                row["loss_first_rel_diff_vs_plain"] = max((abs(a - b) / abs(b) for a, b in firsts if b), default=None)
            if base and m != kit:
                row.update(_ratio(own, base, "step_seconds", "over_kit"))
                row.update(_ratio(own, base, "step_cpu_seconds", "over_kit_cpu"))
                mine, theirs = _by_repeat(own, "losses"), _by_repeat(base, "losses")
                firsts = [(mine[rep][0], theirs[rep][0]) for rep in sorted(mine) if rep in theirs and mine[rep] and theirs[rep]]
                row["loss_first_rel_diff_vs_kit"] = max((abs(a - b) / abs(b) for a, b in firsts if b), default=None)
            predicted = (info.get("predicted_tensor_peak_mb") or {}).get("mb", {}).get(m)
            row["predicted_tensor_peak_increase_mb"] = predicted
            row["tensor_measured_over_predicted"] = (row["tensor_peak_increase_mb"] / predicted
                                                     if (predicted and row["tensor_peak_increase_mb"] is not None) else None)
            row["first_loss"] = own[0]["losses"][0] if own and own[0]["losses"] else None
            rows.append(row)
    for row in rows:  # tensor memory against plain's and the kit's, same K
        mine = row["tensor_peak_increase_mb"]
        for name, arm in (("plain", PLAIN), ("kit", kit)):
            ref = next((r["tensor_peak_increase_mb"] for r in rows if r["K"] == row["K"] and r["mode"] == arm), None)
            row[f"tensor_peak_minus_{name}_mb"] = None if row["mode"] == arm or ref is None or mine is None else mine - ref
    return rows


def one_process_loss_axis(preset: str, info: dict, runs: list[dict], rows: list[dict], fused_arms: list[str],
                          kit: str = KIT) -> list[dict]:
    """The loss axis of one preset (:func:`accum_kit.bench.report_loss.fused_axis_row`): each of ``fused_arms`` (the
    kit arms running the fused loss) against ``kit``, per K; the memory saved is the tensor rise of ``kit`` minus
    the arm's (exact: the tensor peaks repeat), the prediction the memory model's difference of the two losses."""
    saved = ((info.get("predicted_tensor_peak_mb") or {}).get("loss") or {}).get("saved_mb")
    out = []
    for r in rows:
        if r["mode"] not in fused_arms:
            continue
        diff = r.get("tensor_peak_minus_kit_mb")
        at_k = [x for x in runs if x["K"] == r["K"]]
        out.append(fused_axis_row(preset, r["K"], r["mode"], kit, [x for x in at_k if x["mode"] == r["mode"]],
                                  [x for x in at_k if x["mode"] == kit], [] if diff is None else [-diff], saved,
                                  "tensor peak rise, one untimed run per arm"))
    return out


def evaluate_one_process_targets(rows: list[dict], presets: dict, kit_arms: tuple = (KIT,), shipped: str = KIT,
                                 loss_rows: list[dict] = ()) -> list[dict]:
    """Per preset and K, the verdicts (PASS / FAIL / UNRESOLVED / SKIP, :func:`accum_kit.bench.bench_report.target`):

    - ``<arm>_over_plain``, for every kit arm of ``kit_arms``: its paired step-time ratio to ``plain`` at most
      :data:`KIT_OVER_PLAIN_AT_MOST`, judged by its 95 % interval (:func:`accum_kit.stats.interval_verdict`). With
      the logits (``kit``) it is what the loop costs; with the default loss (``kit_fused``), the kit as it ships;
    - ``<shipped>_peak_below_plain``: ``plain``'s rise of tensor memory (:func:`tensor_rise`) minus the shipped
      arm's at least one float32 copy of the logits (``batch x block_size x vocabulary x 4`` bytes, the preset's
      ``logits_fp32_bytes``): PASS or FAIL (the tensor peaks repeat exactly). The shipped arm is the one judged
      because the targets are about what a user of :func:`accum_kit.train_loop` gets, and only a loss without
      the logits can be a logits copy below a loop that makes them;
    - ``<shipped>_peak_predicted``: its tensor rise within :data:`PREDICTED_WITHIN` of the memory model's;
    - the loss axis's verdicts on ``loss_rows`` (:func:`accum_kit.bench.report_loss.fused_axis_targets`).

    SKIP where an arm or ``plain`` did not run, or (memory) where the tensor peak was not measured.
    """
    out = []
    for r in rows:
        arm, preset, K = r["mode"], r["preset"], r["K"]
        if arm not in kit_arms:
            continue
        if r.get("over_plain") is None:
            out.append(target(preset, f"K={K} {arm}_over_plain", None, f"needs {arm} and plain in --modes"))
        else:
            lo, hi = r["over_plain_ci_low"], r["over_plain_ci_high"]
            verdict = interval_verdict(lo, hi, KIT_OVER_PLAIN_AT_MOST, at_most=True) or "UNRESOLVED"
            ci = "no interval (< 2 repeats)" if lo is None else f"95% interval {lo:.3f}-{hi:.3f}"
            out.append(target(preset, f"K={K} {arm}_over_plain", verdict, f"{arm} / plain s/step {r['over_plain']:.3f}, "
                              f"{ci}, upper end at most {KIT_OVER_PLAIN_AT_MOST}"))
        if arm != shipped:
            continue
        copy_mb = presets[preset]["logits_fp32_bytes"] / MB
        diff = r.get("tensor_peak_minus_plain_mb")
        out.append(target(preset, f"K={K} {arm}_peak_below_plain", None if diff is None else -diff >= copy_mb,
                          "no tensor peak measured" if diff is None else
                          f"plain's tensor peak rise minus {arm}'s: {-diff:.1f} MB, against one float32 copy of the "
                          f"logits, {copy_mb:.1f} MB"))
        ratio, pred = r.get("tensor_measured_over_predicted"), r.get("predicted_tensor_peak_increase_mb")
        out.append(target(preset, f"K={K} {arm}_peak_predicted", None if ratio is None else abs(ratio - 1) <= PREDICTED_WITHIN,
                          "no tensor peak measured or predicted" if ratio is None else
                          f"{arm}'s tensor peak rise {r['tensor_peak_increase_mb']:.1f} MB against {pred:.1f} MB "
                          f"predicted: {ratio:.3f}, within {PREDICTED_WITHIN:.0%}"))
    return out + fused_axis_targets(list(loss_rows))
