"""Loop callbacks that alternate windows to measure a difference in the same run.

:class:`ABSwitch` alternates ``no_sync`` and ``sync_each_batch`` windows (the
measured saving of ``no_sync``); :class:`OverheadSwitch` alternates windows
with the profiler recording and not (the profiler's own cost). Alternating in
one run, rather than comparing two runs, makes machine drift hit both sides.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..core.callbacks import LoopCallback
from ..compat import set_sync_each_batch, sync_each_batch
from ..stats import median, ratio

if TYPE_CHECKING:
    from . import CommProfiler


class AlternatingWindows(LoopCallback):
    """Callback: after ``warmup_steps`` steps, ``2 * n`` windows alternate a boolean setting.

    Window ``i`` of the alternation runs with the setting at its home value
    when ``i`` is even and flipped when odd. The setting is applied between
    windows (in ``on_step_end``), before the next window's first
    ``accelerator.accumulate`` reads it. ``times[label]`` collects the seconds
    of each window by side and ``sequence`` the side of each measured window
    in order; subclasses name the sides in ``labels`` (False side, True side)
    and apply the setting in :meth:`apply`.
    """

    labels = ("off", "on")

    def __init__(self, n: int, home: bool, warmup_steps: int = 1):
        self.n, self.home, self.warmup = n, home, warmup_steps
        self.times = {label: [] for label in self.labels}
        self.sequence: list[str] = []
        self._start = None

    def apply(self, value: bool) -> None:
        raise NotImplementedError

    def _value_for(self, step: int):
        i = step - self.warmup
        if i < 0 or i >= 2 * self.n:
            return None
        return self.home if i % 2 == 0 else not self.home

    def on_train_begin(self, state):
        self._start = time.perf_counter()
        value = self._value_for(0)
        self.apply(self.home if value is None else value)

    def on_step_end(self, state):
        now = time.perf_counter()
        value = self._value_for(state.step - 1)
        if value is not None:
            self.times[self.labels[value]].append(now - self._start)
            self.sequence.append(self.labels[value])
        nxt = self._value_for(state.step)
        self.apply(self.home if nxt is None else nxt)
        self._start = time.perf_counter()


class ABSwitch(AlternatingWindows):
    """Callback: alternate windows with and without ``no_sync`` to measure the saving.

    After ``warmup_steps`` optimizer steps, the next ``2 * ab_steps`` windows
    alternate between the run's own mode and the other one (Accelerate's
    ``sync_each_batch`` flag, switched through :mod:`accum_kit.compat`). The
    update is the same either way (only the moment of the all-reduce
    changes), so these are real training steps.

    Args:
        accelerator: the Accelerator of the run.
        ab_steps: windows measured in each mode.
        profiler: a :class:`CommProfiler`, told the current mode so that its
            records of the other mode are kept apart.
        warmup_steps: steps to run before measuring (first steps are slower).
    """

    labels = ("no_sync", "sync_each_batch")

    def __init__(self, accelerator, ab_steps: int, profiler: CommProfiler | None = None, warmup_steps: int = 1):
        self.accelerator, self.profiler = accelerator, profiler
        super().__init__(ab_steps, sync_each_batch(accelerator), warmup_steps)

    def apply(self, value: bool) -> None:
        set_sync_each_batch(self.accelerator, value)
        if self.profiler is not None:
            self.profiler.mode = self.labels[value]

    def summary(self, steps_per_epoch: int | None = None) -> dict:
        """Median seconds per optimizer step each way, the saving (seconds per step / epoch) and the speedup; with a
        profiler counting by mesh dimension, ``measured_saving_scope``: the sentence saying that only the
        data-parallel gradient synchronisation is saved (tensor- and context-parallel collectives run on every
        micro-batch; :func:`accum_kit.profiler.mesh_report.no_sync_scope`)."""
        sync_each, no_sync = median(self.times["sync_each_batch"]), median(self.times["no_sync"])
        out = {"ab_steps_each": min(len(v) for v in self.times.values()),
               "seconds_per_step_sync_each_batch": sync_each, "seconds_per_step_no_sync": no_sync}
        if sync_each is not None and no_sync is not None:
            saved = sync_each - no_sync
            out["measured_seconds_saved_per_step"] = saved
            out["speedup"] = ratio(sync_each, no_sync)
            if steps_per_epoch:
                out["measured_seconds_saved_per_epoch"] = saved * steps_per_epoch
            if self.profiler is not None:
                # Estimated vs measured saving per step, from the no-sync windows' own records.
                local = self.profiler.local_summary()
                est = local.get("estimated_seconds_saved_per_step")
                out["estimated_over_measured"] = est / saved if (est is not None and saved) else None
                if "no_sync_saving_scope" in local:  # under dp x tp / cp: the data-parallel part only
                    out["measured_saving_scope"] = local["no_sync_saving_scope"]
        return out


class OverheadSwitch(AlternatingWindows):
    """Callback: alternate windows with the profiler recording and not, to measure its overhead.

    "Off" windows skip every record and timer; the comm hook stays registered
    (DDP cannot unregister one) and passes buckets straight to the wrapped
    all-reduce, so "off" still pays one Python call per bucket.

    Args:
        profiler: the :class:`CommProfiler` to switch.
        n: windows measured each way.
        warmup_steps: steps before the first window.
    """

    labels = ("profiler_off", "profiler_on")

    def __init__(self, profiler: CommProfiler, n: int, warmup_steps: int = 1):
        self.profiler = profiler
        super().__init__(n, True, warmup_steps)

    def apply(self, value: bool) -> None:
        self.profiler.enabled = value

    def summary(self) -> dict:
        """Median seconds per optimizer step with the profiler on and off, and their ratio."""
        on, off = median(self.times["profiler_on"]), median(self.times["profiler_off"])
        return {"overhead_steps_each": min(len(v) for v in self.times.values()),
                "seconds_per_step_profiler_on": on, "seconds_per_step_profiler_off": off,
                "profiler_overhead_ratio": on / off if on and off else None}
