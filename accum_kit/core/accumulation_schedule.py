"""Accumulation schedules (batch-size warm-up): parsing, checks, K at a step, steps and the phase table.

A schedule maps an optimizer step to the gradient accumulation steps K used
from there on, e.g. ``{0: 1, 100: 2, 300: 4}``: the windows that make
optimizer steps 1 to 100 hold 1 micro-batch per process, steps 101 to 300
hold 2, and later ones 4. K changes only at a window boundary: right after
the optimizer step that completes step N, the next window uses the K of the
largest key <= N. The schedule must contain step 0 (no implicit K before
the first key, so the same text means the same run under every launcher).

Accelerate closes the last window of an epoch at the end of the dataloader
(``sync_with_dataloader=True``), so an epoch of ``M`` micro-batches per
process ends with a window of ``M`` minus what earlier windows took, which
may be shorter than its K; it is still one optimizer step
(:func:`scheduled_steps`). Large-batch ramps of this kind: GPT-3 (Brown et
al. 2020, arXiv:2005.14165, appendix B) increases the batch size linearly
over the first tokens; Smith et al. 2018 (arXiv:1711.00489) increase the
batch instead of decaying the learning rate.

Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Mapping

from .. import checks
from ..errors import UsageError


def optimizer_steps_per_epoch(micro_batches_per_process: int, gradient_accumulation_steps: int) -> int:
    """Optimizer steps in one epoch: a last partial window still makes a step (``ceil(M / K)``).

    Args:
        micro_batches_per_process: ``M``, micro-batches each process runs per epoch.
        gradient_accumulation_steps: ``K``, micro-batches per optimizer step.
    """
    return math.ceil(micro_batches_per_process / gradient_accumulation_steps)


FLAG = "--accumulation_schedule"
FIX = "pass STEP:K pairs starting at step 0, e.g. 0:1,100:2,300:4"


def parse_accumulation_schedule(text: str, flag: str = FLAG) -> dict[int, int]:
    """``"0:1,100:2,300:4"`` -> ``{0: 1, 100: 2, 300: 4}`` (checked by :func:`check_accumulation_schedule`).

    Raises:
        UsageError: a pair that is not ``STEP:K`` with integers, or a schedule that fails the checks.
    """
    pairs = []
    for part in str(text).replace(" ", "").split(","):
        step, sep, k = part.partition(":")
        try:
            pairs.append((int(step), int(k)))
        except ValueError:
            raise UsageError(flag, f"{part!r} is not a STEP:K pair of integers", FIX) from None
        if not sep:
            raise UsageError(flag, f"{part!r} is not a STEP:K pair of integers", FIX)
    return check_accumulation_schedule(pairs, flag)


def check_accumulation_schedule(schedule, flag: str = FLAG) -> dict[int, int]:
    """A schedule (mapping or ``[[step, K], ...]``) as a dict sorted by step, after checking it.

    Raises:
        UsageError: empty; a step that is not an integer >= 0 or appears twice;
            a K that is not an integer >= 1; no entry for step 0.
    """
    pairs = list(schedule.items()) if isinstance(schedule, Mapping) else [tuple(p) for p in schedule]
    if not pairs:
        raise UsageError(flag, "the schedule is empty", FIX)
    for step, k in pairs:
        checks.at_least(f"{flag} (step)", step, minimum=0, fix=FIX)
        checks.at_least(f"{flag} (K at step {step})", k, fix=FIX)
    steps = [s for s, _ in pairs]
    if len(set(steps)) != len(steps):
        raise UsageError(flag, f"step {next(s for s in steps if steps.count(s) > 1)} appears twice", FIX)
    if 0 not in steps:
        raise UsageError(flag, f"no K for step 0 (first step given: {min(steps)})",
                         f"start the schedule with 0:K, e.g. 0:1,{min(steps)}:{dict(pairs)[min(steps)]}")
    return dict(sorted(pairs))


def accumulation_steps_at(schedule: Mapping[int, int], step: int) -> int:
    """K of the window that follows ``step`` optimizer steps done (the largest key <= ``step``)."""
    return schedule[max(s for s in schedule if s <= step)]


def schedule_pairs(schedule: Mapping[int, int] | None) -> list[list[int]] | None:
    """The JSON form ``[[step, K], ...]`` (JSON object keys would be strings)."""
    return None if schedule is None else [[int(s), int(k)] for s, k in sorted(schedule.items())]


def epoch_windows(micro_batches_per_epoch: int, schedule: Mapping[int, int], step: int) -> Iterator[tuple[int, int, int]]:
    """The windows of one epoch that starts after ``step`` optimizer steps, in runs of equal K.

    Yields ``(K, windows, micro_batches)`` per run: ``windows`` optimizer steps
    with K micro-batches per process each, except that the epoch's last
    window holds what is left (``micro_batches`` counts per process).
    """
    keys = sorted(schedule)
    pos = 0
    while pos < micro_batches_per_epoch:
        k = accumulation_steps_at(schedule, step)
        n = math.ceil((micro_batches_per_epoch - pos) / k)
        nxt = next((s for s in keys if s > step), None)
        if nxt is not None:
            n = min(n, nxt - step)
        micro = min(n * k, micro_batches_per_epoch - pos)
        yield k, n, micro
        pos, step = pos + micro, step + n


def scheduled_steps(micro_batches_per_epoch: int, schedule: Mapping[int, int], num_train_epochs: int = 1) -> int:
    """Optimizer steps of ``num_train_epochs`` epochs of ``M`` micro-batches per process under ``schedule``.

    With a constant schedule ``{0: K}`` this is ``epochs x ceil(M / K)``
    (:func:`accum_kit.planning.optimizer_steps_per_epoch`).
    """
    checks.at_least("micro_batches_per_epoch", micro_batches_per_epoch)
    step = 0
    for _ in range(num_train_epochs):
        step += sum(n for _, n, _ in epoch_windows(micro_batches_per_epoch, schedule, step))
    return step


@dataclass(frozen=True)
class SchedulePhase:
    """One phase of a schedule: the optimizer steps that use one K.

    Attributes:
        start_step: optimizer steps done when the phase begins (the schedule's key).
        end_step: steps done when it ends (None: runs to the end of training, length unknown).
        gradient_accumulation_steps: K, micro-batches per process per full step.
        examples_per_step: ``B x K x P`` (a partial window at an epoch's end has fewer).
        tokens_per_step: ``examples_per_step x block_size`` input tokens (None without a block size).
        steps: optimizer steps in the phase (None: unknown, see ``end_step``).
        micro_batches_per_process: micro-batches each process runs in the phase (None: unknown).
        epochs: passes over the data in the phase, ``micro_batches_per_process / M`` (None without ``M``).
    """

    start_step: int
    end_step: int | None
    gradient_accumulation_steps: int
    examples_per_step: int
    tokens_per_step: int | None = None
    steps: int | None = None
    micro_batches_per_process: int | None = None
    epochs: float | None = None


def schedule_phases(schedule: Mapping[int, int], per_device_train_batch_size: int, num_processes: int = 1, *,
                    block_size: int | None = None, micro_batches_per_epoch: int | None = None,
                    num_train_epochs: int = 1) -> list[SchedulePhase]:
    """The phase table of a schedule (what ``accum-kit plan --accumulation_schedule`` prints).

    Args:
        schedule: checked schedule (:func:`check_accumulation_schedule`).
        per_device_train_batch_size: ``B``, examples per micro-batch per process.
        num_processes: ``P``.
        block_size: tokens per example, for ``tokens_per_step`` (None: examples only).
        micro_batches_per_epoch: ``M`` per process; with it the run of
            ``num_train_epochs`` epochs is simulated window by window (partial
            windows included) and phases that start after its end are left out.
            Without it the last phase's length is unknown.
    """
    keys = sorted(schedule)
    B, P = per_device_train_batch_size, num_processes
    steps = {s: None for s in keys}
    micro = {s: None for s in keys}
    ends = {s: e for s, e in zip(keys, [*keys[1:], None])}
    if micro_batches_per_epoch is None:
        steps = {s: (e - s if e is not None else None) for s, e in ends.items()}
    else:
        steps, micro, step = dict.fromkeys(keys, 0), dict.fromkeys(keys, 0), 0
        for _ in range(num_train_epochs):
            for k_, n, m in epoch_windows(micro_batches_per_epoch, schedule, step):
                key = max(s for s in keys if s <= step)
                steps[key] += n
                micro[key] += m
                step += n
        keys = [s for s in keys if s < step]
        ends = {s: min(e, step) if e is not None else step for s, e in ends.items()}
    phases = []
    for s in keys:
        k = schedule[s]
        examples = B * k * P
        phases.append(SchedulePhase(
            start_step=s, end_step=ends[s], gradient_accumulation_steps=k, examples_per_step=examples,
            tokens_per_step=examples * block_size if block_size else None, steps=steps[s],
            micro_batches_per_process=micro[s],
            epochs=micro[s] / micro_batches_per_epoch if micro_batches_per_epoch and micro[s] is not None else None))
    return phases
