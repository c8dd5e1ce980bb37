"""Peak memory of one run: the resident set high-water mark on CPU, ``max_memory_allocated`` on CUDA.

On CPU the process's ``VmHWM`` (``/proc/self/status``) is reset before each run
by writing 5 to ``/proc/self/clear_refs`` (Linux >= 4.0, ``proc(5)``); on CUDA
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (that
path is written but was only run on CPU).
"""

from __future__ import annotations

import torch

from ..profiler.held_memory import proc_status_kb


class PeakMemory:
    """Peak memory of one run (MB = 2**20 bytes), reset by :meth:`reset` and read by :meth:`peak`.

    Args:
        device: the ``torch.device`` of the run.

    ``method`` says how it is measured; None means this platform offers
    neither way and :meth:`peak` returns ``(None, None)``.
    """

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.method = "torch.cuda.max_memory_allocated after reset_peak_memory_stats"
        elif self._clear_refs():
            self.method = "VmHWM of /proc/self/status after `echo 5 > /proc/self/clear_refs`"
        else:
            self.method = None
        self.start_mb = None

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            return proc_status_kb("VmHWM") is not None
        except OSError:
            return False

    def reset(self) -> None:
        """Start a new peak from the current usage."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_mb = torch.cuda.memory_allocated(self.device) / 2**20
        elif self.method:
            self._clear_refs()
            # the high-water mark just after the reset (the RSS at that moment), not a later VmRSS read: the RSS
            # may grow between two reads, and the peak is measured from the reset
            self.start_mb = proc_status_kb("VmHWM") / 1024

    def peak(self) -> tuple[float | None, float | None]:
        """(peak MB since :meth:`reset`, that peak minus the usage at reset, MB)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self.method:
            peak = proc_status_kb("VmHWM") / 1024
        else:
            return None, None
        # Linux counts RSS in per-CPU batches (approximate to a few hundred KB), so a later VmHWM read can come out
        # below the one taken at the reset; a high-water mark cannot fall, so that is reading noise: 0
        return peak, max(peak - self.start_mb, 0.0)
