"""Figures of ``accum-kit bench --torch_compile``: compiled against eager per K, the break-even step count.
No torch."""

from __future__ import annotations

from ..stats import median, ratio_interval
from .bench_report import paired_ratios


#: The two arms of ``--torch_compile``.
COMPILE_MODES = ("eager", "compiled")


def summarize_k(preset: str, runs: list[dict], K: int, compile_seconds: float) -> dict:
    """The figures of one K from its runs (each with ``repeat``, ``mode``, ``measured`` step seconds, ``losses``).

    Returns:
        median step seconds per mode over all measured steps, the paired ratio
        compiled / eager (per repeat: ratio of the two runs' median steps) with
        its 95 % interval, ``seconds_saved_per_step`` (eager minus compiled
        median), ``break_even_steps`` (``compile_seconds`` / saved; None when
        nothing is saved), ``break_even_steps_interval`` (the same at the two
        ends of the ratio's interval, with the eager median; None at an end
        where compiling does not save time: then it may never pay) and the
        largest per-step loss difference.
    """
    by = {(r["repeat"], r["mode"]): r for r in runs if r["K"] == K}
    repeats = sorted({rep for rep, _ in by})
    ratios = paired_ratios([by[(rep, "compiled")] for rep in repeats], [by[(rep, "eager")] for rep in repeats],
                           "measured")
    med = {m: median([s for r in runs if r["K"] == K and r["mode"] == m for s in r["measured"]]) for m in COMPILE_MODES}
    saved = med["eager"] - med["compiled"]
    diffs = [abs(a - b) for rep in repeats for a, b in zip(by[(rep, "compiled")]["losses"], by[(rep, "eager")]["losses"])]
    ci = ratio_interval(ratios)

    def even(ratio):  # steps to earn the compile back if compiled / eager were ``ratio`` (None: never)
        return compile_seconds / (med["eager"] * (1 - ratio)) if ratio is not None and ratio < 1 else None

    return {"preset": preset, "K": K, "eager_step_seconds": med["eager"], "compiled_step_seconds": med["compiled"],
            "compiled_over_eager": ci, "seconds_saved_per_step": saved,
            "break_even_steps": compile_seconds / saved if saved > 0 else None,
            # from the ratio's interval: (at its low end, at its high end); None at an end where compiling is slower
            "break_even_steps_interval": [even(ci["low"]), even(ci["high"])],
            "loss_max_abs_diff": max(diffs) if diffs else None}
