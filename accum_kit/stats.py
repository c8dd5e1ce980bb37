"""Small statistics helpers shared by the profiler and the bench (no torch)."""

from __future__ import annotations

import statistics


def median(xs):
    """Median of ``xs``, or None for an empty sequence."""
    xs = list(xs)
    return statistics.median(xs) if xs else None


def spread(values) -> dict | None:
    """``{"min", "median", "max"}`` of the non-None ``values``; None when there is none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}


def quartiles(xs) -> tuple:
    """First and third quartiles (inclusive method); ``(x, x)`` for one value, ``(None, None)`` for none."""
    xs = list(xs)
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (None, None)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def ratio(a, b):
    """``a / b``, or None when either is None or ``b`` is 0."""
    return a / b if (a is not None and b not in (None, 0)) else None
