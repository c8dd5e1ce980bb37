"""Worker for tests/test_auto_batch.py (not a test module): the train job under a real address-space limit.

    [accelerate launch ...] tests/auto_batch_worker.py <accum-kit train flags>

Runs ``accum_kit.cli.run("train")`` after arranging, inside this process only, an ``RLIMIT_AS`` that makes a real
allocation fail (torch's CPU allocator then raises "DefaultCPUAllocator: can't allocate memory"). Environment:

- ``AUTO_BATCH_RANK``: the only rank that gets the limit (default: every rank);
- ``AUTO_BATCH_AT``: comma-separated ``WHEN:VALUE:ATTEMPTS`` items, ATTEMPTS ``all`` or one attempt number
  (torchrun's ``TORCHELASTIC_RESTART_COUNT``, or the re-exec count of a one-process run):
  - ``train_begin:<MB>``: at the loop's start, the address space then plus MB;
  - ``forward:<step>``, ``backward:<step>``, ``optimizer:<step>``: just before the forward / backward of the
    first micro-batch of the window after ``step`` optimizer steps, or just before its ``optimizer.step()``, the
    address space then (nothing more may be mapped).

glibc's malloc is told to map every block of 64 KiB or more on its own (``M_MMAP_THRESHOLD``, which also stops the
threshold from growing), so that a tensor's allocation needs new address space and fails under the limit instead of
reusing a freed block. The hooks are plain loop callbacks and a wrapped ``optimizer.step``; the job is unchanged.
A later attempt starts without the limit (a re-exec would inherit it).
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _limit(extra_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + extra_bytes, resource.RLIM_INFINITY))


def _arm() -> None:
    at = os.environ.get("AUTO_BATCH_AT")
    rank = os.environ.get("AUTO_BATCH_RANK")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("ACCUM_KIT_AUTO_BATCH_ATTEMPT") or 0)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    if not at or (rank is not None and os.environ.get("RANK", "0") != rank):
        return
    items = [item.split(":") for item in at.split(",")]
    todo = {when: int(value) for when, value, attempts in items if attempts in ("all", str(attempt))}
    if not todo:
        return
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    import accum_kit.job.train as job
    from accum_kit import LoopCallback

    armed = []  # the optimizer step to fail is the next one

    class _Limit(LoopCallback):
        def on_train_begin(self, state):
            if "train_begin" in todo:
                _limit(todo["train_begin"] * 2**20)

        def on_micro_batch_begin(self, state):
            if todo.get("forward") == state.step:
                _limit(0)

        def on_forward_end(self, state):
            if todo.get("backward") == state.step:
                _limit(0)

        def on_step_begin(self, state):
            if todo.get("optimizer") == state.step:
                armed.append(True)

    loop = job.train_loop

    def train_loop(accelerator, model, optimizer, *args, callbacks=(), **kwargs):
        step = optimizer.step

        def limited_step(*a, **k):
            if armed:
                _limit(0)
            return step(*a, **k)

        optimizer.step = limited_step
        return loop(accelerator, model, optimizer, *args, callbacks=[*callbacks, _Limit()], **kwargs)

    job.train_loop = train_loop


if __name__ == "__main__":
    _arm()
    from accum_kit.cli import run

    sys.exit(run("train", sys.argv[1:]))
