"""What one bench run records: its profiler records under the run's tag, turned into one plain dict.

The sweep gives every run a tag (``<mode>/K<K>/r<repeat>``); the tag callback
marks the run's warm-up steps ``warmup/<tag>`` so that only the measured steps
carry the tag itself. :func:`run_record` is the only place that reads the
profiler; the report works on the dicts it returns.
"""

from __future__ import annotations

from ..core.callbacks import LoopCallback


class TagWindows(LoopCallback):
    """Loop callback: tag the profiler's records ``warmup/<tag>`` for ``warmup_steps`` steps, then ``tag``.

    Put it after the profiler in the callback list: the profiler records a
    step in ``on_step_end`` before the tag changes, so the last warm-up step
    keeps the warm-up tag.
    """

    def __init__(self, profiler, warmup_steps: int, tag: str):
        self.profiler, self.warmup_steps, self.tag = profiler, warmup_steps, tag

    def on_train_begin(self, state):
        self.profiler.tag = self.tag if self.warmup_steps == 0 else f"warmup/{self.tag}"

    def on_step_end(self, state):
        if state.step == self.warmup_steps:
            self.profiler.tag = self.tag


def run_record(profiler, tag: str) -> dict:
    """The measured part of one run, from ``profiler``'s records tagged ``tag`` (seconds, bytes).

    Keys: ``step_seconds``, ``step_cpu_seconds`` (process CPU time per step),
    ``optimizer_seconds``, ``other_seconds`` (per
    step: the step minus its timed phases, i.e. fetching batches and the
    loop's own code), ``micro_batches`` (``sync``, ``forward_s``,
    ``backward_s`` each), ``allreduce_calls``, ``allreduce_bytes``, ``syncs``,
    ``seconds_per_sync`` (median time with a bucket all-reduce in flight per
    sync), ``allreduce_busy_seconds`` (that times the syncs) and
    ``warmup_step_seconds`` (the unmeasured warm-up steps, kept to check
    what warming up changes).
    """
    records = profiler.records(tag=tag)
    s = profiler.local_summary(tag)
    phases: dict[int, float] = {}
    for m in records.micro_batches:
        phases[m.step] = phases.get(m.step, 0.0) + m.forward_seconds + m.backward_seconds
    steps = records.steps
    return {
        "step_seconds": [x.step_seconds for x in steps],
        "step_cpu_seconds": [x.cpu_seconds for x in steps],
        "optimizer_seconds": [x.optimizer_seconds for x in steps],
        "other_seconds": [x.step_seconds - phases.get(x.step, 0.0) - x.optimizer_seconds for x in steps],
        "micro_batches": [{"sync": m.sync, "forward_s": m.forward_seconds, "backward_s": m.backward_seconds}
                          for m in records.micro_batches],
        "allreduce_calls": s["allreduce_calls"], "allreduce_bytes": s["allreduce_bytes"], "syncs": s["syncs"],
        "seconds_per_sync": s["seconds_per_sync"],
        "allreduce_busy_seconds": s["seconds_per_sync"] * s["syncs"] if s["syncs"] else 0.0,
        "warmup_step_seconds": [x.step_seconds for x in profiler.records(tag=f"warmup/{tag}").steps],
    }
