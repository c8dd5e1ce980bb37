"""Batch arithmetic of one epoch under Accelerate's default sharding.

With per-device batch ``B``, gradient accumulation steps ``K`` and ``P``
processes (all machines together), one optimizer step sees ``B x K x P``
examples. Over an epoch of ``N`` examples, a map-style ``DataLoader`` prepared
by ``accelerator.prepare`` (``split_batches=False``, ``even_batches=True``, the
defaults) gives every process

* ``ceil(N / (B P))`` micro-batches without ``drop_last``: the last global
  batch is completed with examples repeated from the start of the epoch
  (``BatchSamplerShard._iter_with_no_split`` in ``accelerate/data_loader.py``;
  its ``__len__`` is ``ceil(ceil(N / B) / P)``, which equals
  ``ceil(N / (B P))``), so ``ceil(N / (B P)) B P - N`` examples are padded
  (seen twice);
* ``floor(N / (B P))`` micro-batches with ``drop_last=True``, so
  ``N - floor(N / (B P)) B P`` examples are dropped.

Accelerate ends the accumulation window at the end of the dataloader
(``GradientAccumulationPlugin(sync_with_dataloader=True)``, the default), so a
last partial window of ``r = M mod K`` micro-batches still makes an optimizer
step: steps per epoch = ``ceil(M / K)`` (:func:`optimizer_steps_per_epoch`).

Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import checks
from ..errors import UsageError
from ..core.accumulation_schedule import optimizer_steps_per_epoch  # noqa: F401 (re-exported: plan's public name)
from ..core.settings import resolve_accumulation_steps


@dataclass(frozen=True)
class BatchPlan:
    """Batch arithmetic of one epoch. Counts are examples unless named otherwise.

    Attributes:
        per_device_train_batch_size: ``B``, examples per micro-batch per process.
        gradient_accumulation_steps: ``K``, micro-batches per optimizer step per process.
        num_processes: ``P``, processes over all machines.
        effective_batch_size: ``B K P``, examples per full optimizer step.
        drop_last: the DataLoader drops the incomplete last global batch.
        num_examples: ``N``, examples in the training set (None: not given; the
            per-epoch fields below are then None too).
        micro_batches_per_process: ``M``, micro-batches each process runs per epoch.
        optimizer_steps_per_epoch: ``ceil(M / K)``.
        examples_per_epoch: examples processed per epoch over all processes,
            padding included: ``M B P`` (one process: ``N``; Accelerate pads
            only when it shards the batches over several processes).
        examples_padded: examples repeated from the start of the epoch to
            complete the last global batch (0 with ``drop_last`` or one process).
        examples_dropped: examples never seen in the epoch (0 without ``drop_last``).
        last_step_micro_batches: micro-batches per process in the epoch's last
            optimizer step, ``M mod K`` or ``K`` when that is 0.
        last_step_examples: examples in the last optimizer step over all
            processes, padding included.
        last_step_is_partial: ``last_step_micro_batches < K``.
    """

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_processes: int
    effective_batch_size: int
    drop_last: bool = False
    num_examples: int | None = None
    micro_batches_per_process: int | None = None
    optimizer_steps_per_epoch: int | None = None
    examples_per_epoch: int | None = None
    examples_padded: int | None = None
    examples_dropped: int | None = None
    last_step_micro_batches: int | None = None
    last_step_examples: int | None = None
    last_step_is_partial: bool | None = None


def effective_batch_size(per_device_train_batch_size: int, gradient_accumulation_steps: int, num_processes: int) -> int:
    """Examples per optimizer step over all processes: ``B x K x P``.

    Raises:
        UsageError: a value below 1 (the message names its flag).
    """
    checks.at_least("--per_device_train_batch_size", per_device_train_batch_size)
    checks.at_least("--gradient_accumulation_steps", gradient_accumulation_steps)
    checks.at_least("--num_processes", num_processes)
    return per_device_train_batch_size * gradient_accumulation_steps * num_processes


def plan_batch(
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int | None = None,
    num_processes: int = 1,
    num_examples: int | None = None,
    *,
    drop_last: bool = False,
) -> BatchPlan:
    """The batch plan of one epoch under Accelerate's default sharding.

    Args:
        per_device_train_batch_size: ``B``, examples per micro-batch on one process.
        gradient_accumulation_steps: ``K``, micro-batches per optimizer step;
            None: ``$ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, else 4
            (:func:`accum_kit.core.settings.resolve_accumulation_steps`); a given
            ``K`` is used as is.
        num_processes: ``P``, processes over all machines (``accelerate launch
            --num_processes``, i.e. ``WORLD_SIZE``).
        num_examples: ``N``, training examples per epoch; None leaves the
            per-epoch fields None.
        drop_last: the DataLoader was built with ``drop_last=True``.

    Returns:
        :class:`BatchPlan`. Formulas: ``M = ceil(N / (B P))`` (``floor`` with
        ``drop_last``), after ``BatchSamplerShard`` in ``accelerate/data_loader.py``
        with ``even_batches=True``; steps = ``ceil(M / K)`` since Accelerate
        syncs at the end of the dataloader.

    Raises:
        UsageError: a value below 1, or ``drop_last`` with fewer than ``B P``
            examples (the epoch would have no batch).
    """
    if gradient_accumulation_steps is None:
        checks.at_least("--per_device_train_batch_size", per_device_train_batch_size)  # B's error before K's
        gradient_accumulation_steps = resolve_accumulation_steps(None)
    eff = effective_batch_size(per_device_train_batch_size, gradient_accumulation_steps, num_processes)
    if num_examples is not None:
        checks.at_least("--num_examples", num_examples)
    B, K, P = per_device_train_batch_size, gradient_accumulation_steps, num_processes
    if num_examples is None:
        return BatchPlan(B, K, P, eff, drop_last=drop_last)
    N, global_micro = num_examples, B * P
    if drop_last:
        M = N // global_micro
        if M == 0:
            raise UsageError(
                "--num_examples",
                f"{N} examples are fewer than one global micro-batch of B x P = {global_micro} with --drop_last, "
                "so the epoch has no batch",
                "lower --per_device_train_batch_size, add data, or drop --drop_last",
            )
        padded, dropped = 0, N - M * global_micro
    else:
        M = math.ceil(N / global_micro)
        padded, dropped = M * global_micro - N, 0
    # Accelerate shards (and pads with repeated examples) only for several processes;
    # with one, the last micro-batch is simply shorter.
    short = padded if P == 1 else 0
    padded -= short
    r = M % K or K
    return BatchPlan(
        B,
        K,
        P,
        eff,
        drop_last=drop_last,
        num_examples=N,
        micro_batches_per_process=M,
        optimizer_steps_per_epoch=optimizer_steps_per_epoch(M, K),
        examples_per_epoch=M * global_micro - short,
        examples_padded=padded,
        examples_dropped=dropped,
        last_step_micro_batches=r,
        last_step_examples=r * global_micro - short,
        last_step_is_partial=r < K,
    )
