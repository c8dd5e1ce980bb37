"""Solving for K: the per-device batch and accumulation steps that reach a target batch.

Given a target batch (examples per optimizer step over all processes), the
largest per-device batch that fits in memory and ``P`` processes,
:func:`solve_accumulation_steps` picks the largest ``B <= max`` with the
smallest ``K`` such that ``B K P == target``, and explains what is reachable
when nothing is.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import checks
from ..errors import UsageError


@dataclass(frozen=True)
class AccumulationSolution:
    """``B`` and ``K`` that reach a target batch on ``P`` processes.

    Attributes:
        target_batch_size: examples per optimizer step wanted.
        max_per_device_train_batch_size: the largest per-device batch that fits.
        num_processes: ``P``.
        per_device_train_batch_size: chosen ``B`` (the largest divisor of
            ``target / P`` that is <= the maximum).
        gradient_accumulation_steps: ``K = target / (B P)``.
        note: why ``B`` is below the maximum, when it is (else None).
    """

    target_batch_size: int
    max_per_device_train_batch_size: int
    num_processes: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    note: str | None = None


def _best_split(per_process: int, max_b: int) -> tuple[int, int]:
    """Largest ``B <= max_b`` dividing ``per_process``, and ``K = per_process / B``."""
    b = max(d for d in range(1, min(max_b, per_process) + 1) if per_process % d == 0)
    return b, per_process // b


def _neighbours(target: int, step: int) -> tuple[int | None, int]:
    """Nearest multiples of ``step`` below (None if under ``step``) and above ``target``."""
    below = (target // step) * step
    return (below if below >= step else None), (target // step + 1) * step


def solve_accumulation_steps(
    target_batch_size: int, max_per_device_train_batch_size: int, num_processes: int = 1
) -> AccumulationSolution:
    """The gradient accumulation steps that reach a target batch size.

    Args:
        target_batch_size: examples per optimizer step wanted, over all processes.
        max_per_device_train_batch_size: the largest per-device batch that fits
            in memory (the ``--per_device_train_batch_size`` flag in this mode).
        num_processes: ``P``, processes over all machines.

    Returns:
        :class:`AccumulationSolution` with the largest ``B <= max`` and then the
        smallest ``K`` such that ``B x K x P == target``.

    Raises:
        UsageError (``--target_batch_size``): the target is not a multiple of
            ``P`` (every process must run the same ``B x K`` examples per step);
            the message lists the nearest reachable sizes below and above, with
            their ``B`` and ``K``, and those that keep ``B`` at the maximum.
    """
    checks.at_least("--target_batch_size", target_batch_size)
    checks.at_least("--per_device_train_batch_size", max_per_device_train_batch_size)
    checks.at_least("--num_processes", num_processes)
    T, max_b, P = target_batch_size, max_per_device_train_batch_size, num_processes
    if T % P:
        def describe(size: int | None) -> str | None:
            if size is None:
                return None
            b, k = _best_split(size // P, max_b)
            return f"{size} (B={b}, K={k})"

        near = [d for d in map(describe, _neighbours(T, P)) if d]
        full = [f"{s} (B={max_b}, K={s // (max_b * P)})" for s in _neighbours(T, max_b * P) if s]
        raise UsageError(
            "--target_batch_size",
            f"{T} is not a multiple of --num_processes {P}, so no B x K x {P} equals it",
            f"use a reachable size: nearest {' or '.join(near)}; with per-device batch {max_b}: {' or '.join(full)}",
        )
    b, k = _best_split(T // P, max_b)
    note = None
    if b < max_b:
        full = [str(s) for s in _neighbours(T, max_b * P) if s]
        note = (
            f"per-device batch {b} is below the maximum {max_b} because {max_b} does not divide "
            f"target / num_processes = {T // P}; targets that keep B={max_b}: {' or '.join(full)}"
        )
    return AccumulationSolution(T, max_b, P, b, k, note)
