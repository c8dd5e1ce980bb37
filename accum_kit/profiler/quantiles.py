"""Running statistics of bounded size: count / sum / min / max and a quantile estimate.

:class:`QuantileSketch` keeps its values exactly while there are at most
``exact_limit`` of them (quantiles then equal :func:`statistics.median` /
:func:`statistics.quantiles` of the values), and beyond that a histogram of
logarithmic buckets (the DDSketch scheme: Masson, Rim and Lee, "DDSketch: a
fast and fully-mergeable quantile sketch with relative-error guarantees",
VLDB 2019). A bucket holds the values in ``(gamma^(i-1), gamma^i]`` with
``gamma = (1 + a) / (1 - a)``; a quantile is the bucket's midpoint
``2 gamma^i / (gamma + 1)``, within a relative error ``a`` of a value of that
rank (for the median of an even count, within ``a`` of one of the two middle
values rather than of their mean). Zeros are counted apart and negative
values mirror the positive buckets. The histogram's size is bounded by the
range of the values, not their number: seconds from 1 ns to 10,000 s take at
most ``ln(1e13) / ln(gamma)`` = 1,500 buckets at ``a`` = 0.01. Count, sum,
min and max stay exact (the sum up to float rounding).
"""

from __future__ import annotations

import math
import statistics
from array import array

#: Values kept exactly before a sketch switches to its histogram.
EXACT_LIMIT = 2048
#: Relative accuracy of a quantile once in histogram form.
RELATIVE_ACCURACY = 0.01


class QuantileSketch:
    """Count, sum, min, max and quantiles of a stream of floats, in bounded memory.

    Args:
        exact_limit: values kept exactly (quantiles are then exact).
        relative_accuracy: ``a`` of the histogram, ``0 < a < 1``.

    Raises:
        ValueError: ``relative_accuracy`` outside (0, 1) or ``exact_limit`` negative.
    """

    __slots__ = ("exact_limit", "accuracy", "gamma", "_log_gamma", "count", "sum", "min", "max", "_values",
                 "_positive", "_negative", "_zeros")

    def __init__(self, exact_limit: int = EXACT_LIMIT, relative_accuracy: float = RELATIVE_ACCURACY):
        if not 0 < relative_accuracy < 1:
            raise ValueError(f"relative_accuracy must be in (0, 1) (got {relative_accuracy})")
        if exact_limit < 0:
            raise ValueError(f"exact_limit must be >= 0 (got {exact_limit})")
        self.exact_limit, self.accuracy = exact_limit, relative_accuracy
        self.gamma = (1 + relative_accuracy) / (1 - relative_accuracy)
        self._log_gamma = math.log(self.gamma)
        self.count, self.sum, self.min, self.max = 0, 0.0, math.inf, -math.inf
        self._values: array | None = array("d")
        self._positive: dict[int, int] = {}
        self._negative: dict[int, int] = {}
        self._zeros = 0

    @property
    def exact(self) -> bool:
        """True while every value is kept (quantiles exact)."""
        return self._values is not None

    def add(self, x: float) -> None:
        """Add one value."""
        x = float(x)
        self.count += 1
        self.sum += x
        self.min, self.max = min(self.min, x), max(self.max, x)
        if self._values is not None:
            self._values.append(x)
            if len(self._values) > self.exact_limit:
                values, self._values = self._values, None
                for v in values:
                    self._bucket(v)
        else:
            self._bucket(x)

    def _bucket(self, x: float) -> None:
        if x == 0:
            self._zeros += 1
            return
        store = self._positive if x > 0 else self._negative
        i = math.ceil(math.log(abs(x)) / self._log_gamma)
        store[i] = store.get(i, 0) + 1

    def merge(self, other: "QuantileSketch") -> "QuantileSketch":
        """A new sketch holding the values of both (same accuracy); exact while their total fits."""
        out = QuantileSketch(self.exact_limit, self.accuracy)
        for s in (self, other):
            if s._values is not None:
                for v in s._values:
                    out.add(v)
            else:
                out.count, out.sum = out.count + s.count, out.sum + s.sum
                out.min, out.max = min(out.min, s.min), max(out.max, s.max)
                if out._values is not None:
                    values, out._values = out._values, None
                    for v in values:
                        out._bucket(v)
                for mine, theirs in ((out._positive, s._positive), (out._negative, s._negative)):
                    for i, n in theirs.items():
                        mine[i] = mine.get(i, 0) + n
                out._zeros += s._zeros
        return out

    def _value_at_rank(self, rank: int) -> float:
        """The histogram's estimate of the value of 0-based ``rank`` in sorted order."""
        seen = 0
        for i in sorted(self._negative, reverse=True):  # most negative first
            seen += self._negative[i]
            if rank < seen:
                return -2 * self.gamma ** i / (self.gamma + 1)
        seen += self._zeros
        if rank < seen:
            return 0.0
        for i in sorted(self._positive):
            seen += self._positive[i]
            if rank < seen:
                return 2 * self.gamma ** i / (self.gamma + 1)
        return self.max

    def median(self) -> float | None:
        """The median (None when empty): exact while :attr:`exact`, else within ``relative_accuracy``."""
        if self.count == 0:
            return None
        if self._values is not None:
            return statistics.median(self._values)
        return min(max(self._value_at_rank((self.count - 1) // 2), self.min), self.max)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (``0 <= q <= 1``; the value of rank ``floor(q (n - 1))``), None when empty."""
        if not 0 <= q <= 1:
            raise ValueError(f"q must be in [0, 1] (got {q})")
        if self.count == 0:
            return None
        rank = math.floor(q * (self.count - 1))
        if self._values is not None:
            return sorted(self._values)[rank]
        return min(max(self._value_at_rank(rank), self.min), self.max)

    def describe(self) -> dict:
        """``{"count", "sum", "min", "max", "p50", "p90", "exact"}`` (min / max None when empty)."""
        empty = self.count == 0
        return {"count": self.count, "sum": self.sum, "min": None if empty else self.min,
                "max": None if empty else self.max, "p50": self.median(), "p90": self.quantile(0.9),
                "exact": self.exact}
