"""Counting host reads in a training loop: every place a tensor's value is read by Python.

On a GPU each such read (``t.item()``, ``float(t)``, ``if t:``, ``t.tolist()``, ``t.cpu()``, ...) waits for every
kernel queued before it: the CPU stops running ahead of the device. On a CPU machine nothing waits, but the reads
happen in the same places, so this module counts them by wrapping the tensor methods that read a value:

``item``, ``tolist``, ``numpy``, ``cpu``, ``to("cpu")``, ``__float__``, ``__int__``, ``__bool__``,
``__index__``, ``__complex__`` (``__format__``, ``__repr__`` and ``__array__`` read through these).

A ``TorchDispatchMode`` would see only ``item`` / ``float`` / ``int`` / ``bool`` (``aten._local_scalar_dense``)
and none of the copies; wrapping the Python methods sees those calls made from Python, not the ones C++ makes inside
an operator (boolean-mask indexing, ``nonzero``); ``torch.cuda.set_sync_debug_mode`` sees all of them on a GPU.

What is not counted, because it reads no device memory on a GPU:

- a read of a tensor that an earlier counted read copied to the host, or of a view of it (``t.cpu().tolist()``
  is one read; a value computed from the copy is counted again: the counts are upper bounds there);
- ``to`` with a ``torch.device`` (``to(accelerator.device)``, ``to(t.device)``): placement where the work runs,
  a host-to-device copy or nothing on a GPU; only ``to("cpu")`` by name counts;
- reads inside the data pipeline (``torch.utils.data``, Accelerate's ``data_loader.py``: samplers, collation,
  the epoch's RNG synchronisation), and reads of what stays on the host on a GPU too (torch.optim's step counts,
  :data:`_HOST_HELD`): recorded apart as ``host_side`` reads.

Use :class:`HostReads` as a loop callback and a context manager around the run
(``with HostReads() as reads: train_loop(..., callbacks=[reads])``): each read is attributed to the micro-batch
that was running (from its ``on_micro_batch_begin`` to the next one's), to ``"start"`` before the first, or to
``"end"`` from ``on_train_end`` on.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path

import torch

_METHODS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__", "__complex__")
_HERE = str(Path(__file__).resolve())
_DATA = ("torch/utils/data/", "accelerate/data_loader.py")
#: Readers of tensors that stay on the host on a GPU too: torch.optim's step counts (kept on the CPU unless the
#: optimizer is ``capturable`` or ``fused``; ``_get_value`` reads them with ``item``).
_HOST_HELD = ("torch/optim/optimizer.py:_get_value",)


def _short(filename: str) -> str:
    """``package/…/file.py`` from a frame's file name (the part from the first known package on)."""
    parts = Path(filename).parts
    for root in ("accum_kit", "accelerate", "transformers", "torch", "deepspeed", "tests"):
        if root in parts:
            return "/".join(parts[parts.index(root):])
    return Path(filename).name


class HostReads:
    """Counts host reads per micro-batch of a training loop (see the module docstring).

    Attributes:
        reads: ``[(where, kind, site)]``: ``where`` the micro-batch (``LoopState.micro_step`` at its
            ``on_micro_batch_begin``), ``"start"`` or ``"end"``; ``kind`` the method (``item``, ``cpu``,
            ``to(cpu)``, ``__bool__``, ...); ``site`` ``"owner <- reader"``: the innermost frame outside torch and
            the innermost frame outside this module, as ``file:function``.
        data_reads: the data pipeline's reads and those of host-held tensors, ``Counter`` of ``(kind, site)``.
        boundary: ``{micro-batch: whether it ended a window}``.
    """

    def __init__(self):
        self.reads: list[tuple] = []
        self.data_reads: Counter = Counter()
        self.boundary: dict[int, bool] = {}
        self.where = "start"
        self._host: dict = {}  # storage address -> the host copy a counted read made (kept: a few small tensors)
        self._inside = threading.local()  # a read made inside another (item inside __format__) counts once
        self._originals: dict = {}

    # ---- the loop's callbacks ----------------------------------------------------------------
    def on_micro_batch_begin(self, state):
        self.where = state.micro_step
        self.boundary[state.micro_step] = bool(state.boundary)

    def on_train_end(self, state):
        self.where = "end"

    # ---- counting ----------------------------------------------------------------------------
    def __enter__(self):
        for name in _METHODS:
            self._originals[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, self._originals[name]))
        self._originals["to"] = torch.Tensor.to
        torch.Tensor.to = self._wrap_to(torch.Tensor.to)
        return self

    def __exit__(self, *exc):
        for name, fn in self._originals.items():
            setattr(torch.Tensor, name, fn)
        self._originals.clear()
        return False

    def _record(self, kind: str, tensor) -> bool:
        """Count one read of ``tensor`` unless it is nested, of a host copy, or the data pipeline's."""
        if getattr(self._inside, "depth", 0) or self._is_host(tensor):
            return False
        frame, reader, owner, data = sys._getframe(2), None, None, False
        while frame is not None:
            name = frame.f_code.co_filename.replace("\\", "/")
            if name != _HERE:
                here = f"{_short(name)}:{frame.f_code.co_name}"
                reader = reader or here
                if owner is None and "/torch/" not in name:
                    owner = here
                data = data or any(d in name for d in _DATA)
            frame = frame.f_back
        if data or reader in _HOST_HELD:
            self.data_reads[(kind, f"{owner} <- {reader}")] += 1
        else:
            self.reads.append((self.where, kind, f"{owner} <- {reader}"))
        return True

    def _is_host(self, tensor) -> bool:
        """A host copy a counted read made, or a view of one (same storage)."""
        try:
            return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in self._host
        except (RuntimeError, NotImplementedError, AttributeError):  # no storage (a DTensor, a fake tensor)
            return False

    def _host_copy(self, tensor, out):
        """Remember ``out`` (the result of ``tensor.cpu()``) as a host copy; on a CPU, where ``cpu()`` returns
        ``tensor`` itself, a clone of it, so that the device tensor is not taken for its copy."""
        if not _is_tensor(out):
            return out
        if out is tensor:
            out = out.clone()
        self._host[out.untyped_storage().data_ptr()] = out
        return out

    def _wrap(self, name, original):
        reads = self

        def read(tensor, *args, **kwargs):
            counted = reads._record(name, tensor)
            reads._inside.depth = getattr(reads._inside, "depth", 0) + 1
            try:
                out = original(tensor, *args, **kwargs)
            finally:
                reads._inside.depth -= 1
            return reads._host_copy(tensor, out) if counted and name == "cpu" else out

        read.__name__ = getattr(original, "__name__", name)
        return read

    def _wrap_to(self, original):
        reads = self

        def to(tensor, *args, **kwargs):
            counted = _names_cpu(args, kwargs) and reads._record("to(cpu)", tensor)
            out = original(tensor, *args, **kwargs)
            return reads._host_copy(tensor, out) if counted else out

        return to

    # ---- summaries ---------------------------------------------------------------------------
    def per_micro_batch(self) -> list[dict]:
        """``[{"micro", "boundary", "reads", "sites"}]`` for every micro-batch that ran, in order."""
        counts = Counter(w for w, _, _ in self.reads)
        sites = {}
        for w, kind, site in self.reads:
            sites.setdefault(w, Counter())[f"{kind} {site}"] += 1
        return [{"micro": m, "boundary": b, "reads": counts.get(m, 0), "sites": dict(sites.get(m, {}))}
                for m, b in sorted(self.boundary.items())]

    def summary(self) -> dict:
        """JSON-ready: per micro-batch, per window, the reads outside micro-batches, and the host-side ones."""
        micro = self.per_micro_batch()
        windows, current = [], 0
        for m in micro:
            current += m["reads"]
            if m["boundary"]:
                windows.append(current)
                current = 0
        outside = {w: Counter(f"{k} {s}" for ww, k, s in self.reads if ww == w) for w in ("start", "end")}
        return {"micro": micro, "windows": windows,
                "start": dict(outside["start"]), "end": dict(outside["end"]),
                "host_side": {f"{k} {s}": n for (k, s), n in self.data_reads.items()}}


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _names_cpu(args, kwargs) -> bool:
    """Whether a ``to`` call names the host by string (``to("cpu")``, ``to(device="cpu")``).

    A ``torch.device`` object usually comes from a tensor or from the Accelerator (``to(accelerator.device)``):
    placement where the work runs, a host-to-device copy or nothing on a GPU, and the same object as the host here.
    """
    dests = [*args[:1], kwargs.get("device")]
    return any(isinstance(d, str) and d.split(":")[0] == "cpu" for d in dests)


#: Owners whose reads count as the loop's: accum_kit and Accelerate (a model's own reads, e.g. transformers'
#: attention-mask checks, are the same in any loop; DeepSpeed's engine reads for itself).
LOOP_OWNERS = ("accum_kit/", "accelerate/")


def owner_of(site: str) -> str:
    """The owner ``file:function`` of a ``"kind owner <- reader"`` entry of :meth:`HostReads.summary`."""
    return site.split(" ", 1)[1].split(" <- ")[0]


def loop_reads(summary: dict, owners=LOOP_OWNERS) -> tuple[list[dict], list[dict]]:
    """The loop's reads (those ``owners`` made) in a :meth:`HostReads.summary`: ``(per micro-batch that does
    not end a window, per window)``, each a list of ``{site: count}``."""
    inside, windows, current = [], [], {}
    for m in summary["micro"]:
        mine = {s: n for s, n in m["sites"].items() if owner_of(s).startswith(owners)}
        for s, n in mine.items():
            current[s] = current.get(s, 0) + n
        if m["boundary"]:
            windows.append(current)
            current = {}
        else:
            inside.append(mine)
    return inside, windows
