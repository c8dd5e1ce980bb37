"""Figures and verdicts of the loss axis (:mod:`.loss_axis`): a fused arm against the same loop with the logits.

No torch, nothing from the sweep. Per preset, K and fused arm (:func:`fused_axis_row`): the step-time ratio
fused / logits paired per repeat (or per cycle of windows) with its 95 % interval, in wall and in CPU seconds; the
memory the fused loss saves, measured (paired, with its interval) against the memory model's prediction; the
first step's loss of each arm and their relative difference (same weights and data: equal up to float32
rounding). The verdicts (:func:`fused_axis_targets`): the fused arm's step at most :data:`FUSED_OVER_LOGITS_AT_MOST`
times the logits arm's (its whole interval), and the memory saved within :data:`SAVED_WITHIN` of the prediction.
"""

from __future__ import annotations

from ..stats import interval_verdict, mean_interval, ratio_interval
from .bench_report import _f, paired_ratios, target

#: Step time: the fused arm at most this times the logits arm (the whole 95 % interval): the one-process bench's
#: kit / plain bar, so "not worse" means not resolvably more than 2 % slower.
FUSED_OVER_LOGITS_AT_MOST = 1.02
#: Memory: the measured saving within this fraction of the predicted one.
SAVED_WITHIN = 0.10

#: The columns of a loss-axis row (``bench.json`` -> ``fused_loss``; the one-process CSV has them on its rows).
FUSED_AXIS_FIELDS = (
    "preset", "K", "arm", "against", "n_pairs", "fused_over_logits", "fused_over_logits_ci_low",
    "fused_over_logits_ci_high", "fused_over_logits_cpu", "fused_over_logits_cpu_ci_low",
    "fused_over_logits_cpu_ci_high", "memory_saved_mb", "memory_saved_ci_low", "memory_saved_ci_high",
    "predicted_saved_mb", "saved_over_predicted", "memory_method", "first_loss_fused", "first_loss_logits",
    "first_loss_rel_diff")


def _first_losses(runs: list[dict]) -> dict:
    """``{repeat: the run's first optimizer step's loss}``."""
    return {r["repeat"]: r["losses"][0] for r in runs if r.get("losses")}


def fused_axis_row(preset: str, K: int, arm: str, against: str, fused_runs: list[dict], logits_runs: list[dict],
                   saved_mb: list[float], predicted_saved_mb: float | None, memory_method: str,
                   compare_losses: bool = True) -> dict:
    """One fused arm against its logits arm at one K.

    Args:
        fused_runs, logits_runs: the two arms' records at this K (``repeat``, ``step_seconds``,
            ``step_cpu_seconds``, ``losses``; with ``cycles`` where a run rotates its windows through the arms).
        saved_mb: the memory the fused arm saved, MB: one value per pair (logits arm's peak minus the fused arm's),
            or one exact value (tensor peaks repeat exactly).
        predicted_saved_mb: the memory model's saving (:func:`accum_kit.bench.loss_axis.predicted_loss_memory`).
        memory_method: how ``saved_mb`` was measured (stated in the row).
        compare_losses: the two arms' first steps ran from the same weights on the same data (False where the
            arms take turns window by window inside one run: their windows differ).
    """
    ratios = paired_ratios(fused_runs, logits_runs)
    wall, cpu = ratio_interval(ratios), ratio_interval(paired_ratios(fused_runs, logits_runs, "step_cpu_seconds"))
    saved, lo, hi = mean_interval(saved_mb)
    row = {"preset": preset, "K": K, "arm": arm, "against": against, "n_pairs": len(ratios),
           "fused_over_logits": wall["median"], "fused_over_logits_ci_low": wall["low"],
           "fused_over_logits_ci_high": wall["high"], "fused_over_logits_per_pair": ratios,
           "fused_over_logits_cpu": cpu["median"], "fused_over_logits_cpu_ci_low": cpu["low"],
           "fused_over_logits_cpu_ci_high": cpu["high"],
           "memory_saved_mb": saved, "memory_saved_ci_low": lo, "memory_saved_ci_high": hi,
           "memory_saved_per_pair": list(saved_mb), "predicted_saved_mb": predicted_saved_mb,
           "saved_over_predicted": saved / predicted_saved_mb if (saved is not None and predicted_saved_mb) else None,
           "memory_method": memory_method, "first_loss_fused": None, "first_loss_logits": None,
           "first_loss_rel_diff": None}
    if compare_losses:
        mine, theirs = _first_losses(fused_runs), _first_losses(logits_runs)
        pairs = [(mine[rep], theirs[rep]) for rep in sorted(mine) if rep in theirs]
        if pairs:
            row["first_loss_fused"], row["first_loss_logits"] = pairs[0]
            row["first_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in pairs if b) if any(b for _, b in pairs) else None
    return row


def fused_axis_targets(rows: list[dict]) -> list[dict]:
    """Per loss-axis row two verdicts (:func:`accum_kit.bench.bench_report.target`):

    - ``<arm> step not worse``: fused / logits at most :data:`FUSED_OVER_LOGITS_AT_MOST` by its 95 % interval
      (PASS: the whole interval at or below; FAIL: wholly above; UNRESOLVED otherwise);
    - ``<arm> saves memory as predicted``: the measured saving over the predicted one within 1 +- :data:`SAVED_WITHIN`,
      judged by the saving's interval where there is one (PASS: all of it inside the band; FAIL: all of it
      outside; UNRESOLVED otherwise), by the value itself where it is exact.
    """
    out = []
    for r in rows:
        name = f"K={r['K']} {r['arm']}"
        lo, hi = r["fused_over_logits_ci_low"], r["fused_over_logits_ci_high"]
        point = r["fused_over_logits"]
        if point is None:
            out.append(target(r["preset"], f"{name} step not worse", None, f"no pair of {r['arm']} and {r['against']}"))
        else:
            verdict = interval_verdict(lo, hi, FUSED_OVER_LOGITS_AT_MOST, at_most=True) or "UNRESOLVED"
            ci = "no interval (< 2 pairs)" if lo is None else f"95% interval {lo:.3f}-{hi:.3f}"
            cpu = r["fused_over_logits_cpu"]
            out.append(target(r["preset"], f"{name} step not worse", verdict,
                              f"{r['arm']} / {r['against']} s/step {point:.3f}, {ci}, at most "
                              f"{FUSED_OVER_LOGITS_AT_MOST}" + (f" (CPU s {cpu:.3f})" if cpu is not None else "")))
        out.append(_memory_target(r, name))
    return out


def _memory_target(r: dict, name: str) -> dict:
    saved, pred = r["memory_saved_mb"], r["predicted_saved_mb"]
    if saved is None or not pred:
        return target(r["preset"], f"{name} saves memory as predicted", None, "no measured or predicted saving")
    lo, hi = r["memory_saved_ci_low"], r["memory_saved_ci_high"]
    band = (pred * (1 - SAVED_WITHIN), pred * (1 + SAVED_WITHIN))
    band = (min(band), max(band))
    if lo is None:
        verdict = band[0] <= saved <= band[1]
        ci = "exact" if len(r["memory_saved_per_pair"]) == 1 else "no interval (< 2 pairs)"
    else:
        verdict = "PASS" if band[0] <= lo and hi <= band[1] else ("FAIL" if hi < band[0] or lo > band[1] else "UNRESOLVED")
        ci = f"95% interval {lo:.1f}-{hi:.1f} MB"
    return target(r["preset"], f"{name} saves memory as predicted", verdict,
                  f"saved {saved:.1f} MB ({ci}; {r['memory_method']}) against {pred:.1f} MB predicted: "
                  f"{_f(r['saved_over_predicted'])}, within {SAVED_WITHIN:.0%}")
