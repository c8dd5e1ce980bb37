"""The DDP communication hook that records every gradient bucket's all-reduce.

DDP hands each gradient bucket to its comm hook, ``hook(state, bucket) ->
Future``, as soon as the bucket's gradients are ready during the backward
(PyTorch docs, "DDP Communication Hooks"). :class:`BucketRecorder` registers
itself as that hook, calls the hook it wraps (DDP's default all-reduce unless
told otherwise) and records, when the returned future completes, the bucket's
size and the seconds from hand-over to completion.
"""

from __future__ import annotations

import threading
import time

from .records import KEEP_RECORDS, BucketCall, Labels, recent


def allreduce_mean_hook(process_group, bucket):
    """DDP's default hook: all-reduce the bucket, divide by the world size."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(process_group, bucket)


def _recording_hook(recorder: "BucketRecorder", bucket):
    """The hook DDP calls (DDP passes the registered state first): delegates to the recorder."""
    return recorder.on_bucket(bucket)


class BucketRecorder:
    """Wraps a DDP comm hook and records one :class:`BucketCall` per bucket all-reduce.

    Args:
        labels: the shared :class:`Labels` stamped on every record; with
            ``labels.enabled`` False buckets go straight to the wrapped hook.
        hook: the comm hook ``hook(state, bucket) -> Future`` to wrap, e.g.
            ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``;
            default: :func:`allreduce_mean_hook`.
        hook_state: the state passed to ``hook`` (default None: the world group).
        keep_records: raw records kept, the most recent (None: all).
        sink: called with every new record (the profiler's running aggregates), or None.

    Notes:
        The future's callback may run on another thread (gloo), hence the
        lock. On CUDA the latency is taken when that callback runs; checked on
        CPU / gloo only.
    """

    def __init__(self, labels: Labels, hook=None, hook_state=None, keep_records: int | None = KEEP_RECORDS,
                 sink=None):
        self.labels = labels
        self.hook, self.hook_state = hook or allreduce_mean_hook, hook_state
        self._calls = recent(keep_records)
        self.sink = sink
        self._lock = threading.Lock()
        self._sync = 0  # index of the synchronised backward in progress
        self._in_sync = 0  # calls recorded so far in that sync (record_call's bucket index)

    def _add(self, call: BucketCall) -> None:
        with self._lock:
            self._calls.append(call)
        if self.sink is not None:
            self.sink(call)

    def register(self, model) -> None:
        """Register on the ``DistributedDataParallel`` ``model`` (DDP cannot unregister a hook).

        Raises:
            RuntimeError: the model already has a comm hook (DDP allows one):
                pass that hook as ``hook=`` instead so the recorder wraps it.
        """
        try:
            model.register_comm_hook(state=self, hook=_recording_hook)
        except RuntimeError as exc:
            raise RuntimeError(
                "this DDP model already has a comm hook and DDP allows only one; pass that hook to "
                "CommProfiler(..., hook=<hook>, hook_state=<state>) so the profiler wraps it"
            ) from exc

    @property
    def calls(self) -> list[BucketCall]:
        """The most recent completed bucket all-reduces (``keep_records`` of them), in completion order (a copy)."""
        with self._lock:
            return list(self._calls)

    def record_call(self, nbytes: int, start: float, seconds: float, last: bool) -> None:
        """Record one gradient all-reduce that a loop made itself, without DDP (see :mod:`accum_kit.reference.manual_allreduce`).

        Args:
            nbytes: bytes all-reduced by this process.
            start: ``time.perf_counter()`` when the call began; seconds: until it returned.
            last: True for the last call of this sync (the next call starts a new sync).
        """
        if not self.labels.enabled:
            return
        lab = self.labels
        self._add(BucketCall(step=lab.step, micro_batch=lab.micro_batch, sync=self._sync, mode=lab.mode,
                             tag=lab.tag, bucket=self._in_sync, bytes=nbytes, start=start, seconds=seconds))
        self._in_sync += 1
        if last:
            self._sync, self._in_sync = self._sync + 1, 0

    def on_bucket(self, bucket):
        """Call the wrapped hook on ``bucket`` and record it when its future completes."""
        if not self.labels.enabled:
            return self.hook(self.hook_state, bucket)
        buf = bucket.buffer()
        lab = self.labels
        start = time.perf_counter()
        fut = self.hook(self.hook_state, bucket)
        fields = dict(step=lab.step, micro_batch=lab.micro_batch, sync=self._sync, mode=lab.mode, tag=lab.tag,
                      bucket=bucket.index(), bytes=buf.numel() * buf.element_size(), start=start)
        if bucket.is_last():
            self._sync += 1

        def done(f):
            self._add(BucketCall(**fields, seconds=time.perf_counter() - start))
            return f.value()

        return fut.then(done)
