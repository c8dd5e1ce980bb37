"""Phase timing: forward, backward and optimizer step of every micro-batch, as a loop callback."""

from __future__ import annotations

import time

from ..core.callbacks import LoopCallback
from .records import KEEP_RECORDS, Labels, MicroBatchTimes, StepTimes, recent


class PhaseTimer(LoopCallback):
    """Loop callback: one :class:`MicroBatchTimes` per micro-batch and one :class:`StepTimes` per optimizer step.

    It also keeps ``labels.step`` / ``labels.micro_batch`` current, so the
    bucket recorder can tag each all-reduce with the micro-batch it belongs to.

    Args:
        labels: the shared :class:`Labels`; with ``enabled`` False nothing is
            timed or recorded (the step clock still restarts at each step end).
        synchronize: call ``torch.cuda.synchronize()`` at each phase boundary
            so that times cover the GPU work (use on CUDA only).
        keep_records: records of each kind kept in ``micro_batches`` and
            ``steps``, the most recent (None: all).
        sink: called with every new record (the profiler's running aggregates), or None.
        accumulation: a :class:`accum_kit.profiler.accumulation.GradAccumulationTimer` whose
            seconds go into each micro-batch's record, or None.
    """

    def __init__(self, labels: Labels, synchronize: bool = False, keep_records: int | None = KEEP_RECORDS, sink=None,
                 accumulation=None):
        self.labels, self.synchronize, self.sink, self.accumulation = labels, synchronize, sink, accumulation
        self.micro_batches = recent(keep_records)
        self.steps = recent(keep_records)
        self._t: dict[str, float] = {}

    def _add(self, store, record) -> None:
        store.append(record)
        if self.sink is not None:
            self.sink(record)

    def now(self) -> float:
        """``perf_counter`` seconds, after the GPU's queued work when ``synchronize`` is on."""
        if self.synchronize:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def restart_step_clock(self) -> None:
        """The next step's time counts from here (called at train begin and after every step)."""
        self._t["step_start"] = self.now() if self.labels.enabled else time.perf_counter()
        self._t["step_cpu"] = time.process_time()

    def on_train_begin(self, state):
        self.restart_step_clock()

    def on_micro_batch_begin(self, state):
        self.labels.step, self.labels.micro_batch = state.step, state.micro_step
        if self.accumulation is not None:
            self.accumulation.take()  # what ran between micro-batches belongs to none
        if self.labels.enabled:
            self._t["begin"] = self.now()

    def on_forward_end(self, state):
        if self.labels.enabled:
            self._t["forward"] = self.now()
            self._t["forward_cpu"] = time.process_time()

    def on_backward_end(self, state):
        if not self.labels.enabled:
            return
        end = self.now()
        acc, acc_cpu = self.accumulation.take() if self.accumulation is not None else (None, None)
        self._add(self.micro_batches, MicroBatchTimes(
            step=state.step, micro_batch=state.micro_step, sync=bool(state.sync), mode=self.labels.mode,
            tag=self.labels.tag, forward_seconds=self._t["forward"] - self._t["begin"],
            backward_seconds=end - self._t["forward"],
            backward_cpu_seconds=time.process_time() - self._t["forward_cpu"],
            accumulate_seconds=acc, accumulate_cpu_seconds=acc_cpu))

    def on_step_begin(self, state):
        if self.labels.enabled:
            self._t["optimizer"] = self.now()

    def on_step_end(self, state):
        if self.labels.enabled:
            now = self.now()
            self._add(self.steps, StepTimes(
                step=state.step - 1, mode=self.labels.mode, tag=self.labels.tag,
                optimizer_seconds=now - self._t["optimizer"], step_seconds=now - self._t["step_start"],
                cpu_seconds=time.process_time() - self._t["step_cpu"]))
        self.restart_step_clock()
