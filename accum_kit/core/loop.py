"""The accumulation loop, built on ``Accelerator.prepare`` and ``accelerator.accumulate``.

It follows the order of Accelerate's gradient accumulation guide: forward and
backward of every micro-batch inside ``accelerator.accumulate(model)`` (so DDP
skips the all-reduce on non-boundary micro-batches), then, on the boundary
only, clipping, optimizer step, scheduler step and ``zero_grad``. The one
addition is the window normalisation of :mod:`accum_kit.core.loss`, which makes the
update equal to that of one big batch on one process.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field

from tqdm import tqdm  # text bar: a widget cannot be drawn from processes forked by accum_kit.notebook.launch; Jupyter redraws the text bar in place

from .. import checks
from .batchnorm import warn_if_batchnorm_trains
from .callbacks import CallbackList, LoopState
from .checkpoint import load_checkpoint
from .data_cursor import DataCursor
from ..compat import release_dataloader, restart_window_counter
from ..errors import UsageError
from .loss import NORMALIZATIONS, LossFn, causal_lm_loss
from .accumulation_schedule import schedule_pairs
from .run_plan import run_plan_of
from .window_figures import FigureLog, WindowFigures
from .window_schedule import WindowSchedule


@dataclass
class LoopResult:
    """What :func:`train_loop` returns.

    Attributes:
        train_loss: one loss per optimizer step (nats; token-mean over the
            window and all processes in ``tokens`` mode).
        step_seconds: wall-clock seconds of each optimizer step (from the end of
            the previous step; the first includes start-up).
        step_tokens: target tokens of each window, summed over processes.
        step_accumulation_steps: K of each window (per process; the last
            window of an epoch may hold fewer micro-batches).
        accumulation_schedule: the schedule as ``[[step, K], ...]`` (None: constant K).
        micro_batches: micro-batches run by this process.
        epochs: passes over the data begun (the last may be partial), restored ones included.
        resumed_from_step: optimizer steps restored from a checkpoint (None:
            not resumed); the lists above then hold the restored steps first.
        figures: each step's :class:`accum_kit.core.window_figures.WindowFigures`, from which ``train_loss``
            and ``step_tokens`` are read: the windows' figures stay on the device until one of those lists
            (or a logging step, a checkpoint save) asks for them, and then every unread one comes in one copy.
    """

    step_seconds: list = field(default_factory=list)
    step_accumulation_steps: list = field(default_factory=list)
    accumulation_schedule: list | None = None
    micro_batches: int = 0
    epochs: int = 0
    resumed_from_step: int | None = None
    figures: list = field(default_factory=list, repr=False)
    log: FigureLog = field(default_factory=FigureLog, repr=False)

    @property
    def train_loss(self) -> list[float]:
        return [f.loss for f in self.figures]  # the first unread one reads them all

    @property
    def step_tokens(self) -> list[int]:
        return [f.tokens for f in self.figures]

    def restore(self, saved: dict) -> None:
        """Take over the history of a checkpoint's loop state (see :mod:`accum_kit.core.checkpoint`)."""
        self.figures = [WindowFigures.of(loss, tokens) for loss, tokens in zip(saved["train_loss"], saved["step_tokens"])]
        self.step_seconds, self.resumed_from_step = list(saved["step_seconds"]), saved["optimizer_steps"]
        # a run resumed after its last step runs no epoch: it must still report those the checkpoint had begun
        self.epochs = saved["epoch"] + (1 if saved["batches_done_in_epoch"] else 0)
        # checkpoints written before schedules existed ran one K throughout
        self.step_accumulation_steps = list(saved.get("step_accumulation_steps")
                                            or [saved["gradient_accumulation_steps"]] * len(self.figures))

    def record(self, figures: WindowFigures, k: int, since: float) -> float:
        """Append one optimizer step of K ``k`` that started at ``since`` (perf_counter seconds); return now.
        ``figures`` stay unread (:attr:`figures`)."""
        now = time.perf_counter()
        self.figures.append(self.log.add(figures))
        self.step_accumulation_steps.append(k)
        self.step_seconds.append(now - since)
        return now

    @property
    def optimizer_steps(self) -> int:
        return len(self.step_seconds)

    def __getstate__(self) -> dict:
        """Pickled (a notebook's worker sends its result back) with every window's figures read: host numbers."""
        self.log.read_all()
        return dict(self.__dict__)

    @property
    def tokens_per_second(self) -> float:
        """Target tokens per second over all processes (0 before any step)."""
        seconds = sum(self.step_seconds)
        return sum(self.step_tokens) / seconds if seconds > 0 else 0.0

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(self.step_seconds) if self.step_seconds else float("nan")


def _examples_per_micro_batch(accelerator, dataloader) -> int | None:
    """Examples of one micro-batch over all processes (``B x P``), from a prepared dataloader."""
    total = getattr(dataloader, "total_batch_size", None)
    batch = getattr(dataloader, "batch_size", None)
    return total or (batch * accelerator.num_processes if batch else None)


def _validate(accelerator, train_dataloader, max_train_steps, num_train_epochs, max_grad_norm, loss_normalization,
              logging_steps):
    checks.one_of("--loss_normalization", loss_normalization, NORMALIZATIONS)
    checks.at_least("--logging_steps", logging_steps)
    if max_train_steps is not None:
        checks.at_least("--max_train_steps", max_train_steps, fix="pass a positive integer or omit it")
    else:
        checks.at_least("--num_train_epochs", num_train_epochs)
    if max_grad_norm is not None:
        checks.positive("--max_grad_norm", max_grad_norm, fix="pass a positive float or omit it")
    if len(train_dataloader) == 0:
        raise UsageError("--per_device_train_batch_size", "the train dataloader yields no batch", "add data or lower the batch size")
    run_plan_of(accelerator).engine.use_clipping(accelerator, max_grad_norm)  # an engine that clips in its own step


def train_loop(
    accelerator,
    model,
    optimizer,
    train_dataloader,
    *,
    lr_scheduler=None,
    max_train_steps: int | None = None,
    num_train_epochs: int = 1,
    max_grad_norm: float | None = None,
    loss_normalization: str = "tokens",
    loss_fn: LossFn | None = None,
    callbacks=(),
    progress: bool = True,
    profiler=None,
    checkpointer=None,
    resume_from=None,
    accumulation_schedule=None,
    lr_scaling: str = "none",
    normalizer=None,
    logging_steps: int = 10,
) -> LoopResult:
    """Train with gradient accumulation that skips DDP syncs and is exact.

    Args:
        accelerator: an ``accelerate.Accelerator`` built with
            ``gradient_accumulation_steps=K`` (see :func:`accum_kit.build_accelerator`).
        model, optimizer, train_dataloader, lr_scheduler: objects returned by
            ``accelerator.prepare``. Batches are dicts of (batch, seq) tensors:
            ``input_ids``, ``attention_mask``, ``labels`` (-100 = ignored).
            A prepared scheduler steps once per process per optimizer step
            (Accelerate's convention), so build it with steps x num_processes.
        max_train_steps: stop after this many optimizer steps (overrides epochs).
        num_train_epochs: passes over the data when ``max_train_steps`` is None.
        max_grad_norm: clip the global gradient norm to this (None: no clipping), under
            every engine: DDP and FSDP2 clip here, after the window's rescale; an engine
            that clips inside its own step (DeepSpeed) is set to this value.
        loss_normalization: ``"tokens"`` (exact token-mean over the window and
            all processes) or ``"mean"`` (per-micro-batch mean / K, Accelerate's guide).
        loss_fn: ``loss_fn(model, batch) -> (summed_loss, num_items)``; default
            :func:`accum_kit.core.loss.causal_lm_loss` (``classification_loss`` and
            ``seq2seq_loss`` in :mod:`accum_kit.core.loss` for other models). BatchNorm
            layers training with K > 1 get one warning (:mod:`accum_kit.core.batchnorm`).
        callbacks: :class:`accum_kit.LoopCallback` subclasses (or objects with
            any of its seven hooks), each hook called with a :class:`LoopState`.
            ``on_step_begin`` runs on the boundary micro-batch before the window
            rescale (gradients still hold sum / (K x world_size)).
        progress: show a tqdm bar over optimizer steps on the main process.
        profiler: a :class:`accum_kit.profiler.CommProfiler` (or any callback).
        checkpointer: a :class:`accum_kit.core.checkpoint.Checkpointer`: saves
            ``step_<N>`` / ``epoch_<E>`` at window boundaries and stops on SIGTERM.
        resume_from: a complete checkpoint folder (see
            :func:`accum_kit.core.checkpoint.latest_checkpoint`): the model,
            optimizer, scheduler and RNG states are loaded, the history is
            restored, and training continues at the saved data position, so
            losses and parameters equal those of an uninterrupted run. Prepare
            the same objects in the same order as the saved run.
        accumulation_schedule: batch-size warm-up, ``{optimizer step: K}``
            with an entry for step 0, e.g. ``{0: 1, 100: 2, 300: 4}``: the
            window after N optimizer steps holds the K of the largest key <= N
            micro-batches per process. K changes only at window boundaries;
            every window is normalised with its own K and token count, so each
            step stays equal to one big batch. None: the run plan's schedule
            (``build_accelerator(accumulation_schedule=...)``), else the Accelerator's K.
            Epoch-based runs count their steps under the schedule
            (:func:`accum_kit.core.accumulation_schedule.scheduled_steps`).
        lr_scaling: ``"none"``, ``"linear"`` or ``"sqrt"``: multiply the
            learning rate by the rule's factor for K / (K at step 0) whenever K
            changes (the scheduler's base rates, see :mod:`accum_kit.core.window_schedule`).
        normalizer: a :class:`accum_kit.core.loss.WindowNormalizer` to use instead of the engine's
            (:meth:`accum_kit.engines.base.Engine.window_normalizer`), e.g. one counting tokens over other
            ranks (``accum-kit verify``'s miscount rows); its ``mode`` replaces ``loss_normalization``.
        logging_steps: the progress bar shows the loss every this many optimizer steps (and at the last).
            Reading the loss waits for the device on a GPU, so the loop reads it only then: the window's
            loss, tokens and gradient norm stay tensors (``LoopState.figures``, ``grad_norm``) until a callback
            or the result asks for them (docs/loop.md, "Host reads").

    Returns:
        :class:`LoopResult` with per-step losses, times and token counts.

    Raises:
        UsageError: invalid argument (the message names the flag), or a
            checkpoint saved with another K (under a schedule: the schedule's
            K at the saved step), world size or batch size.
        accum_kit.core.checkpoint.Preempted: a signal stopped the run after saving.
        TypeError: a callback defines no hook or a misspelled one.
        RuntimeError: the dataloader ended inside a window, which happens when
            it was not passed through ``accelerator.prepare``.
    """
    _validate(accelerator, train_dataloader, max_train_steps, num_train_epochs, max_grad_norm, loss_normalization,
              logging_steps)
    loss_fn = loss_fn or causal_lm_loss
    run = _Run.start(accelerator, model, optimizer, train_dataloader, lr_scheduler, loss_fn, loss_normalization,
                     max_train_steps, num_train_epochs, [profiler, *callbacks, checkpointer], checkpointer,
                     resume_from, accumulation_schedule, lr_scaling, progress, normalizer, logging_steps)
    hooks, norm, state, result = run.hooks, run.norm, run.state, run.result
    model.train()
    restart_window_counter(accelerator)  # an earlier loop may have stopped mid-window; load_state restores it too
    run.windows.start(state)  # the schedule's K for the steps done (0, or the resumed step)
    hooks("on_train_begin", state)
    warn_if_batchnorm_trains(accelerator, model, run.windows.schedule)  # after the hooks: a callback may freeze them
    last = time.perf_counter()
    try:
        for state.epoch in run.epochs:
            batches = run.cursor.batches(state.epoch)  # set_epoch (reshuffle), skipping on resume
            if hasattr(loss_fn, "window_batches"):  # a loss that reads its window ahead (router_loss.RouterAuxLoss)
                batches = loss_fn.window_batches(batches)
            for batch in norm.batches(batches):
                with accelerator.accumulate(model):
                    state.boundary = accelerator.sync_gradients
                    state.sync = state.boundary or run.plan.reduces_each_micro_batch()
                    hooks("on_micro_batch_begin", state)
                    summed_loss, num_items = loss_fn(model, batch)
                    hooks("on_forward_end", state)
                    accelerator.backward(norm.backward_loss(summed_loss, num_items))
                    hooks("on_backward_end", state)
                    state.micro_step += 1
                    if accelerator.sync_gradients:
                        hooks("on_step_begin", state)
                        state.figures = norm.finish(model)  # exact rescale before clipping; figures stay on the device
                        if max_grad_norm is not None:  # returns the norm before clipping (kept as a tensor: no read)
                            state.grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                        optimizer.step()
                        if lr_scheduler is not None:
                            lr_scheduler.step()
                        optimizer.zero_grad()
                        last = run.close_window(last)  # the checkpointer saves in its on_step_end: .grad is empty
                if state.step >= run.total:
                    break
            run.end_epoch()
            if state.step >= run.total:
                break
    finally:  # also on an exception (e.g. a notebook interrupt): leave Accelerate's state clean
        release_dataloader(accelerator, run.cursor.active)
        if checkpointer is not None:
            checkpointer.close()
        run.bar.close()
    result.micro_batches = state.micro_step
    hooks("on_train_end", state)
    return result


@dataclass
class _Run:
    """One call of :func:`train_loop`: its plan, hooks, normaliser, K schedule, state, data position and results."""

    plan: object
    hooks: CallbackList
    norm: object
    windows: WindowSchedule
    total: int
    state: LoopState
    cursor: DataCursor
    result: LoopResult
    epochs: object
    bar: object
    logging_steps: int = 10

    @classmethod
    def start(cls, accelerator, model, optimizer, train_dataloader, lr_scheduler, loss_fn, loss_normalization,
              max_train_steps, num_train_epochs, callbacks, checkpointer, resume_from, accumulation_schedule,
              lr_scaling, progress, normalizer=None, logging_steps: int = 10) -> "_Run":
        """Everything the loop needs before its first micro-batch; restores a checkpoint's state and history."""
        plan = run_plan_of(accelerator)
        # profiler first: it must see a step before others react to it; the checkpointer after the user's
        # callbacks: it saves what they did; the engine's own last (DDP's static-graph first sync)
        hooks = CallbackList([*callbacks, *plan.engine.loop_callbacks(accelerator, model)])
        norm = normalizer if normalizer is not None else \
            plan.engine.window_normalizer(accelerator, loss_normalization, loss_fn)  # DeepSpeed: counts ahead
        windows = WindowSchedule(accelerator, accumulation_schedule, optimizer, lr_scheduler, lr_scaling,
                                 _examples_per_micro_batch(accelerator, train_dataloader))
        total = max_train_steps or windows.total_steps(len(train_dataloader), num_train_epochs)
        state, cursor = LoopState(), DataCursor(train_dataloader)
        result = LoopResult(accumulation_schedule=schedule_pairs(windows.schedule))
        if resume_from is not None:  # load_state, then the data position
            saved = load_checkpoint(accelerator, resume_from, cursor, accumulation_schedule=windows.schedule,
                                    resplit=getattr(checkpointer, "resplit", False))
            result.restore(saved)
            state.step, state.micro_step = saved["optimizer_steps"], saved["micro_batches"]
        if checkpointer is not None:
            checkpointer.attach(cursor, result)
        epochs = itertools.count(cursor.epoch) if max_train_steps else range(cursor.epoch, num_train_epochs)
        epochs = epochs if state.step < total else ()  # resumed from the last step: nothing left
        bar = tqdm(total=total, initial=state.step, desc="optimizer steps",
                   disable=not (progress and accelerator.is_main_process))
        return cls(plan, hooks, norm, windows, total, state, cursor, result, epochs, bar, logging_steps)

    def close_window(self, since: float) -> float:
        """After the optimizer step: count it, set the next window's K, record it, call ``on_step_end``; returns now."""
        state = self.state
        state.step += 1
        self.windows.after_step(state)  # after finish: the closed window used its own K
        now = self.result.record(state.figures, state.accumulation_steps, since=since)
        self.hooks("on_step_end", state)
        self.bar.update(1)
        if not self.bar.disable and (state.step % self.logging_steps == 0 or state.step >= self.total):
            self.bar.set_postfix(loss=f"{state.loss:.4f}", K=state.accumulation_steps)  # reads the loss: shown
        return now

    def end_epoch(self) -> None:
        """After an epoch's batches: no window may be left open; count the epoch.

        Raises:
            RuntimeError: the dataloader ended inside a window (it was not prepared by Accelerate).
        """
        if self.norm.pending:
            raise RuntimeError(
                "the dataloader ended inside an accumulation window; pass it through accelerator.prepare "
                "and keep GradientAccumulationPlugin(sync_with_dataloader=True) so that Accelerate closes "
                "the last partial window"
            )
        self.result.epochs = self.state.epoch + 1
