"""Small statistics helpers shared by the profiler and the bench (no torch, no scipy)."""

from __future__ import annotations

import math
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


# --------------------------------------------------------------------------- Student's t, integer degrees of freedom


def t_central_mass(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with ``df`` (a positive integer) degrees of freedom, ``t >= 0``.

    The closed forms for integer ``df`` of Abramowitz & Stegun, *Handbook of
    Mathematical Functions*, 26.7.3 (odd ``df``) and 26.7.4 (even ``df``), with
    ``theta = atan(t / sqrt(df))``: odd ``df``:
    ``(2 / pi) (theta + sin(theta) (cos + 2/3 cos^3 + ... + (2 4 ... (df-3)) / (1 3 ... (df-2)) cos^(df-2)))``;
    even ``df``: ``sin(theta) (1 + 1/2 cos^2 + ... + (1 3 ... (df-3)) / (2 4 ... (df-2)) cos^(df-2))``.

    Raises:
        ValueError: ``df`` not a positive integer, or ``t`` negative.
    """
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be a positive integer (got {df!r})")
    if t < 0:
        raise ValueError(f"t must be >= 0 (got {t})")
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:  # odd: a_0 = cos, a_j = a_(j-1) (2j) / (2j + 1) cos^2, j up to (df - 3) / 2
        total, term = 0.0, c
        for j in range(0, (df - 1) // 2):
            if j:
                term *= c * c * (2 * j) / (2 * j + 1)
            total += term
        return min(1.0, 2.0 / math.pi * (theta + s * total))
    total, term = 0.0, 1.0  # even: b_0 = 1, b_j = b_(j-1) (2j - 1) / (2j) cos^2, j up to (df - 2) / 2
    for j in range(0, df // 2):
        if j:
            term *= c * c * (2 * j - 1) / (2 * j)
        total += term
    return min(1.0, s * total)


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile of Student's t with ``df`` integer degrees of freedom (``0 < q < 1``).

    Inverts :func:`t_central_mass` by bisection to about 1e-12 (e.g.
    ``t_quantile(0.975, 1)`` = 12.706, ``(0.975, 10)`` = 2.228, ``(0.975, 30)`` = 2.042).

    Raises:
        ValueError: ``q`` outside (0, 1) or ``df`` not a positive integer.
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must lie in (0, 1) (got {q})")
    if q == 0.5:
        return 0.0
    mass = abs(2.0 * q - 1.0)  # P(|T| <= t) of the upper quantile
    lo, hi = 0.0, 1.0
    while t_central_mass(hi, df) < mass:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_central_mass(mid, df) < mass:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    t = 0.5 * (lo + hi)
    return t if q > 0.5 else -t


def mean_interval(values, level: float = 0.95) -> tuple[float | None, float | None, float | None]:
    """``(mean, low, high)``: the mean of ``values`` and its Student t interval, ``m -+ t_{(1+level)/2, n-1} s / sqrt(n)``.

    The standard one-sample t interval (NIST/SEMATECH e-Handbook of
    Statistical Methods, 7.2.2.1). Fewer than 2 values: the mean (or None) and
    no interval (``low``, ``high`` None).

    Raises:
        ValueError: ``level`` outside (0, 1).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1) (got {level})")
    xs = list(values)
    if not xs:
        return None, None, None
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, None, None
    half = t_quantile(0.5 + level / 2, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - half, m + half


#: How :func:`ratio_interval` computes its interval, as reports state it.
RATIO_INTERVAL_METHOD = ("95% t-interval on the log of the paired per-pass ratios "
                         "(exp(mean +- t_0.975,n-1 x sd / sqrt(n)) of log ratio), n = passes")


def ratio_interval(ratios, level: float = 0.95) -> dict:
    """Point estimates and a confidence interval for a ratio measured once per pass.

    The ratios (positive, one per pass, e.g. step time of mode A over mode B
    in the same pass) are taken on a log scale, where a ratio and its inverse
    are symmetric, and a Student t interval is formed for the mean log ratio:
    ``exp(m -+ t_{(1+level)/2, n-1} s / sqrt(n))`` with ``m``, ``s`` the mean and
    sample standard deviation of the logs (the standard one-sample t interval,
    e.g. NIST/SEMATECH e-Handbook of Statistical Methods, 7.2.2.1). Its centre,
    ``exp(m)``, is the geometric mean of the ratios.

    Args:
        ratios: per-pass ratios; None and non-positive values are dropped.
        level: coverage, e.g. 0.95.

    Returns:
        ``{"n", "median", "geometric_mean", "low", "high", "level"}``; ``low``
        and ``high`` are None with fewer than 2 ratios, every value is None
        with none.

    Raises:
        ValueError: ``level`` outside (0, 1).
    """
    rs = [r for r in ratios if r is not None and r > 0]
    m, low, high = mean_interval([math.log(r) for r in rs], level)
    exp = lambda x: None if x is None else math.exp(x)  # noqa: E731
    return {"n": len(rs), "median": median(rs), "geometric_mean": exp(m), "low": exp(low), "high": exp(high),
            "level": level}


def interval_verdict(low, high, threshold: float, at_most: bool) -> str | None:
    """Judge an interval against a bar: ``"PASS"``, ``"FAIL"``, ``"UNRESOLVED"``, or None without an interval.

    For a bar ``value <= threshold`` (``at_most``): PASS when the whole
    interval is at or below the threshold, FAIL when it lies wholly above,
    otherwise UNRESOLVED (this run cannot tell). ``value >= threshold`` mirrors it.
    """
    if low is None or high is None:
        return None
    if at_most:
        return "PASS" if high <= threshold else ("FAIL" if low > threshold else "UNRESOLVED")
    return "PASS" if low >= threshold else ("FAIL" if high < threshold else "UNRESOLVED")


def resolved(low, high, value: float = 1.0) -> bool | None:
    """Whether the interval ``[low, high]`` excludes ``value`` (None without an interval)."""
    if low is None or high is None:
        return None
    return not (low <= value <= high)
