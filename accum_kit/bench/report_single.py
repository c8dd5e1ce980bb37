"""Figures of the one-process ``accum-kit bench``: every arm against the plain loop (and the kit), paired per repeat.

No torch, nothing from the sweep. Per preset, K and arm (:func:`summarize_one_process`): step seconds (median,
quartiles, range over every measured step of every repeat), CPU seconds per step, tokens per step and per second,
model FLOPs utilisation (:func:`mfu`), the paired ratio to ``plain`` (and to the kit) with its 95 % interval,
wall and CPU, peak memory and its rise over the run's start, that rise minus ``plain``'s (paired per repeat),
the rise of tensor memory (:func:`tensor_rise`) and its difference from ``plain``'s, and the loss difference
from ``plain``. The targets (:func:`evaluate_one_process_targets`): the kit's step at most
1.02 x the plain loop's (the interval's upper end), and the kit's peak below the plain loop's by at least one
float32 copy of the logits.
"""

from __future__ import annotations

from ..stats import interval_verdict, median, quartiles, ratio_interval
from .bench_report import MB, paired_ratios, target

#: The kit's arm and the plain loop's, as ``--modes`` names them.
KIT, PLAIN = "kit", "plain"
#: The step-time target: the kit at most this times the plain loop (the whole 95 % interval).
KIT_OVER_PLAIN_AT_MOST = 1.02

ONE_PROCESS_CSV_FIELDS = (
    "preset", "K", "mode", "runs", "step_s_median", "step_s_q1", "step_s_q3", "step_s_min", "step_s_max",
    "step_cpu_s_median", "tokens_per_step", "tokens_per_s", "mfu",
    "over_plain", "over_plain_ci_low", "over_plain_ci_high", "over_plain_cpu", "over_plain_cpu_ci_low",
    "over_plain_cpu_ci_high", "over_kit", "over_kit_ci_low", "over_kit_ci_high",
    "peak_mb", "peak_increase_mb", "peak_increase_minus_plain_mb", "tensor_peak_increase_mb",
    "tensor_peak_minus_plain_mb", "first_loss", "loss_first_rel_diff_vs_plain", "loss_max_abs_diff_vs_plain")


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
            row["first_loss"] = own[0]["losses"][0] if own and own[0]["losses"] else None
            rows.append(row)
    for row in rows:  # tensor memory against plain's, same K
        ref = next((r["tensor_peak_increase_mb"] for r in rows if r["K"] == row["K"] and r["mode"] == PLAIN), None)
        mine = row["tensor_peak_increase_mb"]
        row["tensor_peak_minus_plain_mb"] = (None if row["mode"] == PLAIN or ref is None or mine is None
                                             else mine - ref)
    return rows


def evaluate_one_process_targets(rows: list[dict], presets: dict, kit: str = KIT) -> list[dict]:
    """Per preset and K, two verdicts (PASS / FAIL / UNRESOLVED / SKIP, :func:`accum_kit.bench.bench_report.target`):

    - ``kit_over_plain``: the kit's paired step-time ratio to ``plain`` at most :data:`KIT_OVER_PLAIN_AT_MOST`,
      judged by its 95 % interval (:func:`accum_kit.stats.interval_verdict`);
    - ``kit_peak_below_plain``: ``plain``'s rise of tensor memory (:func:`tensor_rise`) minus the kit's at least
      one float32 copy of the logits (``batch x block_size x vocabulary x 4`` bytes, the preset's
      ``logits_fp32_bytes``): PASS or FAIL (the tensor peaks repeat exactly).

    SKIP where the kit or ``plain`` did not run, or (memory) where the tensor peak was not measured.
    """
    out = []
    for r in rows:
        if r["mode"] != kit:
            continue
        preset, K = r["preset"], r["K"]
        if r.get("over_plain") is None:
            out.append(target(preset, f"K={K} kit_over_plain", None, "needs the kit and plain in --modes"))
            continue
        lo, hi = r["over_plain_ci_low"], r["over_plain_ci_high"]
        verdict = interval_verdict(lo, hi, KIT_OVER_PLAIN_AT_MOST, at_most=True) or "UNRESOLVED"
        ci = "no interval (< 2 repeats)" if lo is None else f"95% interval {lo:.3f}-{hi:.3f}"
        out.append(target(preset, f"K={K} kit_over_plain", verdict, f"{kit} / plain s/step {r['over_plain']:.3f}, {ci}, "
                          f"upper end at most {KIT_OVER_PLAIN_AT_MOST}"))
        copy_mb = presets[preset]["logits_fp32_bytes"] / MB
        diff = r.get("tensor_peak_minus_plain_mb")
        out.append(target(preset, f"K={K} kit_peak_below_plain", None if diff is None else -diff >= copy_mb,
                          "no tensor peak measured" if diff is None else
                          f"plain's tensor peak rise minus {kit}'s: {-diff:.1f} MB, against one float32 copy of the "
                          f"logits, {copy_mb:.1f} MB"))
    return out
