"""Timing of autograd's gradient accumulation into FSDP2's unsharded parameters (CPU only).

Under ``no_sync`` an FSDP2 unit keeps its unsharded gradient between
micro-batches, and every backward after a window's first adds the new
gradient into it (autograd's ``AccumulateGrad``; the first backward of the
window, and every backward under ``sync_each_batch``, hands its fresh
gradient over without a copy). That add, G, is work ``no_sync`` costs and
syncing every micro-batch does not, so it enters the profiler's estimate of
the saving (:func:`accum_kit.profiler.sharded.saved_per_skipped_sync`).

It cannot be read off the backward's total time: the backwards of one
window differ for other reasons too (the first follows the optimizer step),
and by as much as the add itself on a 2-core machine. So each unsharded
parameter gets two hooks around its accumulation: a tensor hook, which
autograd runs on the incoming gradient just before ``AccumulateGrad``, and a
post-accumulate-grad hook, run just after it (``torch.Tensor.register_hook``
and ``register_post_accumulate_grad_hook``, https://pytorch.org/docs/stable/generated/torch.Tensor.register_post_accumulate_grad_hook.html).
The seconds between them, summed over the parameters, are one micro-batch's
accumulation time. On CUDA the add is asynchronous and the host clock would
time its launch only, so the timer is not installed there.
"""

from __future__ import annotations

import time


class GradAccumulationTimer:
    """Sums, per micro-batch, the seconds (wall and process CPU) autograd spends accumulating FSDP2 gradients.

    Install with :meth:`install` once the units have gathered their parameters
    (after a forward; idempotent and cheap, so it can be called every
    micro-batch); read and restart with :meth:`take`.

    Args:
        enabled: a callable returning whether to time now (the profiler's ``enabled``).
    """

    def __init__(self, enabled):
        self._enabled = enabled
        self._hooked: set[int] = set()
        self._groups_done = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.calls = 0  #: accumulations timed over the run (one per parameter per backward)
        self._start = (0.0, 0.0)

    def install(self, groups: list) -> None:
        """Hook every unsharded parameter of the FSDP2 ``groups`` (``FSDPParamGroup`` list) not hooked yet."""
        if self._groups_done == len(groups):
            return
        from ..compat import fsdp_unsharded_parameters

        done = 0
        for group in groups:
            params = fsdp_unsharded_parameters(group)
            for p in params:
                if id(p) not in self._hooked and p.requires_grad:
                    self._hooked.add(id(p))
                    p.register_hook(self._before)  # they stay: disabled, they only check the flag
                    p.register_post_accumulate_grad_hook(self._after)
            done += bool(params)
        self._groups_done = done

    def _before(self, grad):
        if self._enabled():
            self._start = (time.perf_counter(), time.process_time())
        return None  # the gradient passes unchanged

    def _after(self, param) -> None:
        if self._enabled():
            wall, cpu = self._start
            self.seconds += time.perf_counter() - wall
            self.cpu_seconds += time.process_time() - cpu
            self.calls += 1

    def take(self) -> tuple[float | None, float | None]:
        """(seconds, CPU seconds) summed since the last call, then zero; (None, None) when not installed."""
        out = (self.seconds, self.cpu_seconds) if self._hooked else (None, None)
        self.seconds = self.cpu_seconds = 0.0
        return out
