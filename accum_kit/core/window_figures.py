"""What a closed window logs (its loss and target tokens), kept on the device until something shows it.

Reading a tensor's value from Python (``.item()``, ``float(t)``, ``.tolist()``, ``.cpu()``) makes the host wait
for every kernel queued before it: on a GPU the CPU stops running ahead, and the device idles while the next
window's first kernels are launched. The window normalisation needs no value on the host (its rescale and the
next window's divisor stay tensors, :class:`accum_kit.core.loss.WindowNormalizer`), so what is left to read is
what the run shows: the logged loss and token counts. :class:`WindowFigures` holds one window's pair where it
was computed; :class:`FigureLog` keeps the run's figures in order and reads every unread one in a single
copy when any of them is asked for (a logging step, a tracker, a checkpoint save, the end of the run), so a
run that logs every N steps reads once per N windows. See docs/loop.md ("Host reads").
"""

from __future__ import annotations

import math

import torch

#: Unread windows a :class:`FigureLog` keeps before it reads them anyway (one read per this many windows when
#: nothing shows them: bounded memory on the device, 2 float64 values per window).
MAX_UNREAD = 1024


class WindowFigures:
    """One closed window's loss (nats) and target tokens (all processes), read from the device once, when asked.

    Args:
        values: a float64 tensor ``[loss, tokens]`` (on any device), or a ``(loss, tokens)`` pair of numbers.
        log: the :class:`FigureLog` that reads it together with the run's other unread windows (None: alone).
    """

    def __init__(self, values, log: "FigureLog | None" = None):
        self._tensor = values if isinstance(values, torch.Tensor) else None
        self._read = None if self._tensor is not None else (float(values[0]), int(values[1]))
        self._log = log

    @classmethod
    def of(cls, loss: float, tokens: int) -> "WindowFigures":
        """Figures already on the host (a loss computed by hand, a reference loop)."""
        return cls((loss, tokens))

    @property
    def is_read(self) -> bool:
        return self._read is not None

    @property
    def log(self) -> "FigureLog | None":
        return self._log

    @property
    def tensor(self) -> torch.Tensor | None:
        """The unread ``[loss, tokens]`` tensor (None once read or when made from numbers)."""
        return self._tensor if self._read is None else None

    def settle(self, values: list) -> None:
        """Take the host values ``[loss, tokens]`` (from :meth:`FigureLog.read_all`)."""
        self._read, self._tensor = (float(values[0]), int(values[1])), None

    def read(self) -> tuple[float, int]:
        """``(loss, tokens)`` on the host: one read (with the log's other unread windows), then cached."""
        if self._read is None:
            if self._log is not None:
                self._log.read_all()
            if self._read is None:  # not in a log, or the log has forgotten it
                self.settle(self._tensor.tolist())
        return self._read

    @property
    def loss(self) -> float:
        return self.read()[0]

    @property
    def tokens(self) -> int:
        return self.read()[1]


class FigureLog:
    """The run's :class:`WindowFigures` in step order; one device-to-host copy reads all unread ones.

    Args:
        max_unread: read the unread windows when this many are waiting (:data:`MAX_UNREAD`).
    """

    def __init__(self, max_unread: int = MAX_UNREAD):
        self.max_unread = max_unread
        self._unread: list[WindowFigures] = []
        self.reads = 0  # read_all calls that read something

    def add(self, figures: WindowFigures) -> WindowFigures:
        """Keep ``figures`` (adopted by this log) until the next :meth:`read_all`; returns it."""
        if figures.tensor is not None:
            figures._log = self
            self._unread.append(figures)
            if len(self._unread) >= self.max_unread:
                self.read_all()
        return figures

    def read_all(self, extra=()) -> list[float]:
        """Read every unread window's figures, and the scalar tensors ``extra`` with them (a gradient norm to
        log beside the loss): one ``tolist`` of everything stacked per device. Returns ``extra``'s values."""
        unread, self._unread = [f for f in self._unread if f.tensor is not None], []
        values = read_together([f.tensor for f in unread] + [t.reshape(1).double() for t in extra])
        for f, v in zip(unread, values):
            f.settle(v)
        self.reads += bool(unread or extra)
        return [v[0] for v in values[len(unread):]]


def read_together(tensors: list) -> list[list]:
    """``[t.tolist() for t in tensors]`` (1-D float tensors) with one device-to-host copy per device."""
    by_device: dict = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out = [None] * len(tensors)
    for device, index in by_device.items():
        sizes = [tensors[i].numel() for i in index]
        flat = torch.cat([tensors[i].reshape(-1).to(torch.float64) for i in index]).tolist()
        for i, n in zip(index, sizes):
            out[i], flat = flat[:n], flat[n:]
    return out


def nan_figures() -> WindowFigures:
    """The figures before any window closed: loss NaN, 0 tokens."""
    return WindowFigures.of(math.nan, 0)
