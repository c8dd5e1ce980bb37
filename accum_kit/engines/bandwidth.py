"""Bus bandwidth and the seconds of a ring collective, as nccl-tests define them (torch-free).

One function converts between the algorithm bandwidth a run measures (bytes of the whole buffer S per
second) and the bus bandwidth a link is rated at (:func:`busbw_factor`); every estimate of collective
time in the package (the cost table :mod:`accum_kit.engines.costs`, the step-time model
:mod:`accum_kit.planning.step_time`, the profiler's report, HSDP's emulated link) goes through it.
Source: https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md
"""

from __future__ import annotations

#: Bytes per gigabyte in bandwidths (GB/s) and memory figures (GB): 1e9, as NVIDIA and nccl-tests count.
GB = 1e9

#: nccl-tests' bus-bandwidth factor of each collective kind over a group of n processes: ``busbw = algbw x
#: factor(n)`` with ``algbw = S / t`` (S the whole buffer: the all-reduce's buffer, the all-gather's output,
#: the reduce-scatter's input). It is what each process sends (and receives) of S on a ring, so ``busbw`` can be
#: set against a link's peak. https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md
BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def busbw_factor(kind: str, group_size: int) -> float:
    """``busbw / algbw`` of one collective ``kind`` over ``group_size`` processes (:data:`BUSBW_FACTORS`).

    ``2 (n - 1) / n`` for an all-reduce, ``(n - 1) / n`` for an all-gather, a reduce-scatter and an
    all-to-all, 1 for a broadcast and a reduce (nccl-tests, doc/PERFORMANCE.md). One process: 0 for the
    first four (nothing crosses a link).

    Raises:
        ValueError: an unknown kind, or a group of fewer than 1 process.
    """
    if kind not in BUSBW_FACTORS:
        raise ValueError(f"unknown collective kind {kind!r}; one of {sorted(BUSBW_FACTORS)}")
    if group_size < 1:
        raise ValueError(f"a collective needs a group of 1 or more processes (got {group_size})")
    return BUSBW_FACTORS[kind](group_size)


def bus_bandwidth(algbw: float, kind: str, group_size: int) -> float:
    """Bus bandwidth from algorithm bandwidth (both in the same unit, e.g. GB/s): ``algbw x busbw_factor``.

    Raises:
        ValueError: as :func:`busbw_factor`.
    """
    return algbw * busbw_factor(kind, group_size)


def algorithm_bandwidth(busbw: float, kind: str, group_size: int) -> float:
    """Algorithm bandwidth (bytes of S per second) from bus bandwidth: ``busbw / busbw_factor``.

    Raises:
        ValueError: as :func:`busbw_factor`, or a group of one process for a kind that sends nothing then.
    """
    factor = busbw_factor(kind, group_size)
    if factor == 0:
        raise ValueError(f"a {kind} over {group_size} process sends nothing: no algorithm bandwidth")
    return busbw / factor


def collective_seconds(n_bytes: float, group_size: int, busbw_GBps: float, kind: str = "reduce_scatter") -> float:
    """Seconds of one ring collective of S = ``n_bytes`` over ``group_size`` processes at ``busbw_GBps``.

    ``S x busbw_factor(kind, n) / busbw`` (:func:`busbw_factor`): nccl-tests define
    ``busbw = algbw x factor`` with ``algbw = S / t``, so ``t = S x factor / busbw``;
    ``S (n - 1) / n / busbw`` for an all-gather or a reduce-scatter (the default kind),
    ``2 S (n - 1) / n / busbw`` for an all-reduce. GB/s are 1e9 bytes/s. One process: 0.

    Raises:
        ValueError: as :func:`busbw_factor`.
    """
    return n_bytes * busbw_factor(kind, group_size) / (busbw_GBps * GB)


def all_reduce_seconds(n_bytes: float, group_size: int, busbw_GBps: float) -> float:
    """Seconds of a ring all-reduce of S = ``n_bytes`` over ``group_size`` processes: ``2 S (n - 1) / n / busbw``.

    :func:`collective_seconds` of kind ``all_reduce``. One process: 0.
    """
    return collective_seconds(n_bytes, group_size, busbw_GBps, "all_reduce")
