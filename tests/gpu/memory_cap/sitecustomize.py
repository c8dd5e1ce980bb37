"""A memory cap and peak figures for every Python process started with this folder first on ``PYTHONPATH``.

Python imports ``sitecustomize`` at interpreter start (the ``site`` module), before any script, so a launched job,
each of its processes and each re-execution of a one-process ``--auto_find_batch_size`` run (``os.execv``, the
environment kept) is capped before anything allocates. Used by tests/gpu's ``auto_batch`` launch; does nothing
unless one of these is set:

- ``GPU_TESTS_MEMORY_CAP_BYTES``: cap the CUDA caching allocator of device 0 at this many bytes,
  ``torch.cuda.set_per_process_memory_fraction(cap / total memory)``: an allocation that would take the memory the
  allocator reserves past it raises a real ``torch.OutOfMemoryError`` (after freeing its cached blocks).
- ``GPU_TESTS_MEMORY_LOG``: a file that gets one JSON line per interpreter start (pid, attempt, the cap as set)
  and one at exit (``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` of device 0, bytes).

Without CUDA and with ``GPU_TESTS_DRY_RUN=1`` (tests/gpu's dry run on a CPU), a stand-in takes the allocator's place:
during each outermost module call it sums the bytes of the outputs of every leaf module (those activations grow
with the micro-batch as the CUDA allocator's peak does) and raises ``torch.OutOfMemoryError`` with CUDA's wording
past the cap; its largest sum is logged as both peaks. It exercises the logic, not the allocator.
"""

import atexit
import json
import os

_CAP = os.environ.get("GPU_TESTS_MEMORY_CAP_BYTES")
_LOG = os.environ.get("GPU_TESTS_MEMORY_LOG")


def _log(entry: dict) -> None:
    with open(_LOG, "a") as f:  # one short append per line: lines of concurrent processes do not interleave
        f.write(json.dumps(entry) + "\n")


class _StandIn:
    """Leaf-module output bytes per outermost call, against the cap (the dry run's allocator)."""

    def __init__(self, cap):
        self.cap, self.depth, self.live, self.peak = cap, 0, 0, 0

    def pre(self, module, args):
        if self.depth == 0:
            self.live = 0
        self.depth += 1

    def post(self, module, args, output):
        import torch

        self.depth -= 1
        if next(module.children(), None) is None:  # a leaf: its outputs are the activations
            flat = output if isinstance(output, (tuple, list)) else (output,)
            self.live += sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
            self.peak = max(self.peak, self.live)
            if self.cap is not None and self.live > self.cap:
                self.depth = 0
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {self.live / 2**20:.2f} MiB (dry-run stand-in of the "
                    f"caching allocator: {self.live} bytes of activations past the cap of {self.cap} bytes)")


def _install() -> None:
    import torch

    cap = int(_CAP) if _CAP else None
    entry = {"event": "start", "pid": os.getpid(), "cap_bytes": cap,
             "attempt": os.environ.get("ACCUM_KIT_AUTO_BATCH_ATTEMPT", "0")}
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(cap / total, 0)
        entry.update(device="cuda", total_bytes=total, fraction=None if cap is None else cap / total)

        def peaks():
            return torch.cuda.max_memory_allocated(0), torch.cuda.max_memory_reserved(0)
    elif os.environ.get("GPU_TESTS_DRY_RUN") == "1":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        stand_in = _StandIn(cap)
        register_module_forward_pre_hook(stand_in.pre)
        register_module_forward_hook(stand_in.post)
        entry.update(device="cpu", stand_in=True)

        def peaks():
            return stand_in.peak, stand_in.peak
    else:
        raise RuntimeError("GPU_TESTS_MEMORY_CAP_BYTES / GPU_TESTS_MEMORY_LOG need CUDA (or GPU_TESTS_DRY_RUN=1)")
    if _LOG:
        _log(entry)

        def at_exit():
            allocated, reserved = peaks()
            _log({"event": "exit", "pid": os.getpid(), "max_memory_allocated": allocated,
                  "max_memory_reserved": reserved})

        atexit.register(at_exit)


if _CAP or _LOG:
    _install()
