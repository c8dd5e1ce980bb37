"""The loop side of accumulation schedules: K per window and the learning rate that follows the batch.

:class:`WindowSchedule` is what :func:`accum_kit.train_loop` uses for its
``accumulation_schedule`` and ``lr_scaling`` arguments. It sets K before the
first window (also after a resume) and, right after each optimizer step,
the K of the next window, so a window never changes size midway and the
window normalisation (:class:`accum_kit.core.loss.WindowNormalizer`, which reads
K when the window closes) divides by the K the window was run with. The
schedule's arithmetic (parsing, K at a step, steps per run) is torch-free in
:mod:`accum_kit.core.accumulation_schedule`.

Learning rate: with ``lr_scaling`` ``"linear"`` or ``"sqrt"`` the rate is
multiplied by the rule's factor for ``K / K_first`` (the effective batch
ratio; rules and sources in :mod:`accum_kit.core.lr_scaling`). The multiplier is
applied to the scheduler's ``base_lrs`` (which every ``step`` recomputes the
rates from) and to the current rates of the optimizer's groups, so it lasts
and composes with the schedule's own shape (warm-up, decay).
"""

from __future__ import annotations

from .. import checks
from ..compat import scheduler_base_lrs
from .lr_scaling import LR_RULES, scale_learning_rate
from .accumulation_schedule import accumulation_steps_at, scheduled_steps


class WindowSchedule:
    """K per window from a schedule, switched at window boundaries; optional learning-rate coupling.

    Args:
        accelerator: the loop's Accelerator (K lives in its gradient state).
        schedule: ``{optimizer step: K}`` with an entry for step 0, or None
            (the run plan's schedule, if any; else K stays the Accelerator's).
        optimizer, lr_scheduler: the prepared optimizer and scheduler (the
            latter may be None) whose learning rates ``lr_scaling`` scales.
        lr_scaling: ``"none"``, ``"linear"`` or ``"sqrt"``, relative to the first K.
        examples_per_micro_batch: examples of one micro-batch over all
            processes (``B x P``), for the effective batch reported in :class:`LoopState`.

    Raises:
        UsageError: an invalid schedule or rule (see
            :func:`accum_kit.core.accumulation_schedule.check_accumulation_schedule`).
    """

    def __init__(self, accelerator, schedule, optimizer=None, lr_scheduler=None, lr_scaling: str = "none",
                 examples_per_micro_batch: int | None = None):
        from .run_plan import run_plan_of

        checks.one_of("--lr_scaling", lr_scaling, LR_RULES)
        self.accelerator, self.optimizer, self.lr_scheduler = accelerator, optimizer, lr_scheduler
        self.plan = run_plan_of(accelerator)  # K changes through it; a schedule is checked once, by it
        self.schedule = self.plan.checked_schedule(schedule) if schedule is not None else self.plan.schedule
        self.lr_scaling, self.examples_per_micro_batch = lr_scaling, examples_per_micro_batch
        self.first_k = self.schedule[0] if self.schedule else accelerator.gradient_accumulation_steps
        self._multiplier = 1.0

    def k_at(self, step: int) -> int:
        """K of the window that follows ``step`` optimizer steps done."""
        return accumulation_steps_at(self.schedule, step) if self.schedule else self.first_k

    def total_steps(self, micro_batches_per_epoch: int, num_train_epochs: int) -> int:
        """Optimizer steps of ``num_train_epochs`` epochs (partial windows at epoch ends included)."""
        return scheduled_steps(micro_batches_per_epoch, self.schedule or {0: self.first_k}, num_train_epochs)

    def multiplier(self, k: int) -> float:
        """The learning-rate factor of K relative to the first K under ``lr_scaling``."""
        if self.lr_scaling == "none":
            return 1.0
        return scale_learning_rate(1.0, self.first_k, k, self.lr_scaling).multiplier

    def start(self, state) -> None:
        """Before the first window: K for ``state.step`` steps done.

        After a resume the optimizer's and scheduler's saved learning rates
        already carry the multiplier of that K, so it is only noted, not applied.
        """
        if self.schedule is None:
            return
        k = self.k_at(state.step)
        self.plan.set_accumulation_steps(k)
        self._multiplier = self.multiplier(k)
        state.accumulation_steps = k

    def after_step(self, state) -> None:
        """Right after an optimizer step (window closed): report its K, then set the next window's K."""
        k = self.accelerator.gradient_accumulation_steps
        state.accumulation_steps = k
        if self.examples_per_micro_batch:
            state.effective_batch_size = k * self.examples_per_micro_batch
        if self.schedule is None:
            return
        nxt = self.k_at(state.step)
        if nxt != k:
            self.plan.set_accumulation_steps(nxt)
            self._scale_learning_rate(self.multiplier(nxt))

    def _scale_learning_rate(self, multiplier: float) -> None:
        ratio = multiplier / self._multiplier
        if ratio != 1.0:
            base = scheduler_base_lrs(self.lr_scheduler) if self.lr_scheduler is not None else None
            if base is not None:
                base[:] = [b * ratio for b in base]
            for group in self.optimizer.param_groups:  # the rate of the next step, already computed
                group["lr"] *= ratio
        self._multiplier = multiplier
