"""What every part of ``accum-kit bench`` reports with: pairs of arms, their ratios with 95 % intervals, verdicts.

No torch, nothing from the sweep. The figures per part are in :mod:`.report_ddp` (the DDP modes),
:mod:`.report_tune` (``--tune``), :mod:`.report_fsdp2` (the FSDP2 / HSDP policies), :mod:`.report_zero`
(the DeepSpeed ZeRO stages) and :mod:`.report_compiled` (``--torch_compile``); their text is
:mod:`.bench_tables`'s, their files :mod:`.bench_files`'.

The pairing of two arms (:func:`paired_values`: per repeat, or per cycle of windows where a run rotates its
windows), every ratio's 95 % interval (:data:`INTERVAL_METHOD`), PASS / FAIL / UNRESOLVED verdicts
(:func:`bar`, :func:`target`).
"""

from __future__ import annotations

from ..stats import RATIO_INTERVAL_METHOD, interval_verdict, median, ratio_interval

MB = 2**20
#: How every ratio's interval is computed (stated in the JSON and the printed tables).
INTERVAL_METHOD = RATIO_INTERVAL_METHOD


def _f(x, fmt: str = "{:.3f}", none: str = "n/a") -> str:
    return none if x is None else fmt.format(x)


def _m(runs, key):
    """Median over ``runs`` of their ``key`` (runs without it left out)."""
    return median(r[key] for r in runs if r.get(key) is not None)


def paired_values(runs: list[dict], key: str = "step_seconds") -> dict:
    """What pairs up between two arms' runs: ``{(repeat, cycle): seconds}`` per window for runs that rotate
    their windows through the arms (records with ``cycles``: the FSDP2 and ZeRO parts), else ``{repeat: the
    run's median}`` (one run per arm and repeat, back to back). Values that are None are left out (a run
    with one is left out whole when it has no ``cycles``)."""
    out = {}
    for r in runs:
        values = r.get(key) or []
        if "cycles" in r:
            out.update({(r["repeat"], c): t for c, t in zip(r["cycles"], values) if t is not None})
        elif values and None not in values:
            out[r["repeat"]] = median(values)
    return out


def paired_ratios(num_runs: list[dict], den_runs: list[dict], key: str = "step_seconds") -> list[float]:
    """``num / den`` per pair both arms have (:func:`paired_values`), in pair order; a zero ``den`` is left out."""
    a, b = paired_values(num_runs, key), paired_values(den_runs, key)
    return [a[p] / b[p] for p in sorted(a) if p in b and b[p]]


def paired_differences(num_runs: list[dict], den_runs: list[dict], key: str = "step_seconds") -> list[float]:
    """``num - den`` per pair both arms have (:func:`paired_values`), in pair order (seconds)."""
    a, b = paired_values(num_runs, key), paired_values(den_runs, key)
    return [a[p] - b[p] for p in sorted(a) if p in b]


def status(ok: bool | None) -> str:
    """``PASS`` / ``FAIL`` / ``SKIP`` for True / False / None."""
    return {True: "PASS", False: "FAIL", None: "SKIP"}[ok]



def target(preset: str, name: str, ok, detail: str) -> dict:
    """One target's verdict: ``ok`` a verdict string (``interval_verdict``'s, or ``UNRESOLVED``) or True /
    False / None (PASS / FAIL / SKIP)."""
    return {"preset": preset, "target": name, "status": ok if isinstance(ok, str) else status(ok), "detail": detail}


def bar(name: str, description: str, items: list, threshold: float, at_most: bool) -> dict:
    """A bar every item must meet, judged by each item's interval (:func:`accum_kit.stats.interval_verdict`).

    ``items``: ``(point, low, high, label)`` per measured case. The bar's
    ``verdict`` is FAIL if any interval lies wholly on the wrong side of the
    threshold, PASS if every interval lies on the right side, UNRESOLVED
    otherwise (an interval straddles the threshold, or has fewer than 2
    passes), SKIP when nothing was measured; ``passed`` is True / False / None
    accordingly. ``value`` is the worst point estimate (largest for an
    at-most bar, smallest for an at-least bar).
    """
    verdicts = [interval_verdict(lo, hi, threshold, at_most) or "UNRESOLVED" for _, lo, hi, _ in items]
    if not items:
        verdict = "SKIP"
    elif "FAIL" in verdicts:
        verdict = "FAIL"
    elif all(v == "PASS" for v in verdicts):
        verdict = "PASS"
    else:
        verdict = "UNRESOLVED"
    worst = (max if at_most else min)(items, key=lambda it: it[0]) if items else None

    def show(it, v):
        point, lo, hi, label = it
        ci = f" [{lo:.3f}-{hi:.3f}]" if lo is not None else " [no interval: < 2 passes]"
        return f"{label}: {point:.3f}{ci} {v}"

    return {"name": name, "description": description, "threshold": threshold,
            "value": worst[0] if worst else None, "interval": [worst[1], worst[2]] if worst else None,
            "verdict": verdict, "passed": {"PASS": True, "FAIL": False}.get(verdict),
            "detail": None if not items else f"worst {show(worst, verdicts[items.index(worst)])}; all: "
            + ", ".join(show(it, v) for it, v in zip(items, verdicts))}


def per_repeat_ratios(runs: list[dict], K: int, num: str, den: str, key: str = "step_seconds") -> list[float]:
    """Per repeat (pass), in order: median step of ``num``'s run / median step of ``den``'s run at this K.

    ``num`` and ``den`` are arms named in the runs' ``mode``. ``key``: ``"step_seconds"`` (wall clock) or
    ``"step_cpu_seconds"`` (the process's CPU time per step); runs without that record are left out.
    """
    def arm(name):
        return [r for r in runs if r["K"] == K and r["mode"] == name]

    return paired_ratios(arm(num), arm(den), key)


def paired_estimate(runs: list[dict], K: int, num: str, den: str, key: str = "step_seconds") -> dict:
    """The median over repeats of :func:`per_repeat_ratios`, with its 95 % interval
    (:func:`accum_kit.stats.ratio_interval` of the per-repeat ratios).

    Runs of one (repeat, K) block ran back to back, so a burst of load from
    outside that hits one block (or one repeat) moves both sides of its ratio
    or is voted out by the other repeats; a ratio of pooled medians has no
    such protection.

    Returns ``{"median", "per_repeat", "low", "high", "geometric_mean", "n", "level"}``
    (``low`` / ``high`` None with fewer than 2 repeats). ``key``: see :func:`per_repeat_ratios`.
    """
    ratios = per_repeat_ratios(runs, K, num, den, key)
    return {**ratio_interval(ratios), "per_repeat": ratios}
