"""A ``torch.profiler`` Chrome trace of a few optimizer steps, one file per process.

The trace is built and run by Accelerate: :class:`accelerate.utils.ProfileKwargs`
holds the activities and the schedule (``wait`` optimizer steps, 1 warm-up
step, ``steps`` recorded steps, once) and ``accelerator.profile(handler)``
opens the ``torch.profiler.profile`` context. The schedule advances once per
optimizer step (``on_step_end``) and every micro-batch's forward + backward is
a range named ``micro_batch_<i>/sync`` or ``micro_batch_<i>/no_sync``.

What is not left to Accelerate, and why (accelerate 1.15,
``Accelerator.profile``): with ``output_trace_dir`` set it exports straight
into the final file ``profile_<rank>.json`` (a crash mid-write leaves a
truncated trace under the real name) and then calls ``wait_for_everyone()``,
a collective, inside the exit of the context, where a process that failed
would leave the others waiting. So the handler is built without
``output_trace_dir`` and :meth:`StepTrace.stop` writes ``trace_rank<R>.json``
itself through a temporary file and ``os.replace``, with no collective.
The context is entered in ``on_train_begin`` and left in ``on_train_end``
(``__enter__`` / ``__exit__`` of Accelerate's context manager), because a loop
callback has no ``with`` block around the loop.
"""

from __future__ import annotations

import os

from ..core.callbacks import LoopCallback


class StepTrace(LoopCallback):
    """Loop callback: a Chrome trace of ``steps`` optimizer steps after ``wait`` + 1 warm-up step.

    Args:
        accelerator: the run's Accelerator (``profile()`` and ``process_index``).
        trace_dir: directory of ``trace_rank<R>.json`` (opens in Perfetto).
        steps: optimizer steps recorded (a trace of every step grows by
            megabytes per step).
        wait: optimizer steps before the warm-up step; keep timed windows
            (A/B, overhead) out of the trace, which would disturb them.

    After :meth:`stop`, ``path`` is the file written.
    """

    def __init__(self, accelerator, trace_dir: str, steps: int = 2, wait: int = 1):
        self.accelerator, self.trace_dir, self.steps, self.wait = accelerator, trace_dir, steps, wait
        self.path: str | None = None
        self._context = self._profiler = self._range = None

    def start(self) -> None:
        """Start the profiler (its schedule begins waiting); a second call while running does nothing."""
        import torch
        from accelerate.utils import ProfileKwargs

        if self._context is not None:
            return
        activities = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        handler = ProfileKwargs(activities=activities,
                                schedule_option=dict(wait=self.wait, warmup=1, active=self.steps, repeat=1))
        self._context = self.accelerator.profile(handler)
        self._profiler = self._context.__enter__()

    def on_train_begin(self, state):
        self.start()

    def on_micro_batch_begin(self, state):
        import torch

        if self._profiler is None:
            return
        self._range = torch.profiler.record_function(f"micro_batch_{state.micro_step}/{'sync' if state.sync else 'no_sync'}")
        self._range.__enter__()

    def on_backward_end(self, state):
        self.close_range()

    def on_step_end(self, state):
        if self._profiler is not None:
            self._profiler.step()  # one schedule step per optimizer step

    def on_train_end(self, state):
        self.stop()

    def close_range(self) -> None:
        """Close the current micro-batch range, if one is open."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def stop(self) -> None:
        """Stop the profiler and write ``trace_rank<R>.json`` atomically; sets ``path``."""
        if self._context is None:
            return
        self.close_range()
        context, profiler = self._context, self._profiler
        self._context = self._profiler = None  # stopped once, whatever happens below
        context.__exit__(None, None, None)
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"trace_rank{self.accelerator.process_index}.json")
        tmp = path + ".tmp"  # one file per rank: the name cannot collide
        try:
            profiler.export_chrome_trace(tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self.path = path
