"""The by-mesh-dimension report: running totals of :mod:`.mesh_collectives`' records, their summary and table.

No torch here. Definitions (one process, one mode; calls and bytes as counted by
:class:`accum_kit.profiler.mesh_collectives.MeshCollectiveCounter`, bytes being
nccl-tests' S of each call):

- per window: totals over the windows counted / their number (``min`` / ``max``: over windows);
- per sync / no-sync micro-batch: forward and backward totals of the micro-batches whose backward
  synchronised gradients (``LoopState.sync``) / did not, over their number;
- what ``no_sync`` saves per window: the ``gradient_sync`` calls and bytes of a sync micro-batch minus
  those of a no-sync one, times the no-sync micro-batches per window; the ``tensor_parallel`` and
  ``context_parallel`` collectives run on every micro-batch under either setting and are not saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Classes (those of :func:`accum_kit.profiler.mesh_collectives.classify`) that no_sync does not defer.
EVERY_MICRO_BATCH = ("tensor_parallel", "context_parallel")


@dataclass
class _Bin:
    """Running totals of one (mode, tag)."""

    windows: int = 0
    micro: dict = field(default_factory=lambda: {True: 0, False: 0})
    totals: dict = field(default_factory=dict)  # (dim, kind, phase, sync or None) -> [calls, bytes]
    window_range: dict = field(default_factory=dict)  # dim -> [min, max] calls per window


class MeshAggregates:
    """Running totals per (mode, tag) of :class:`~accum_kit.profiler.mesh_collectives.MeshMicroBatch` and
    :class:`~accum_kit.profiler.mesh_collectives.MeshWindow` records; memory bounded by the distinct
    (dimension, kind, phase) seen, whatever the run's length."""

    def __init__(self):
        self.bins: dict[tuple, _Bin] = {}

    def _bin(self, record) -> _Bin:
        return self.bins.setdefault((record.mode, record.tag), _Bin())

    def add_micro_batch(self, record) -> None:
        """Fold in one micro-batch's forward and backward counts."""
        b = self._bin(record)
        b.micro[bool(record.sync)] += 1
        for (dim, kind, phase), (calls, nbytes) in record.counts.items():
            c = b.totals.setdefault((dim, kind, phase, bool(record.sync)), [0, 0])
            c[0] += calls
            c[1] += nbytes

    def add_window(self, record) -> None:
        """Fold in one window: its step-phase counts (its micro-batches came one by one) and its calls per dimension."""
        b = self._bin(record)
        per_dim: dict[str, int] = {}
        for (dim, kind, phase), (calls, nbytes) in record.counts.items():
            per_dim[dim] = per_dim.get(dim, 0) + calls
            if phase == "step":
                c = b.totals.setdefault((dim, kind, phase, None), [0, 0])
                c[0] += calls
                c[1] += nbytes
        for dim in set(b.window_range) | set(per_dim):
            n = per_dim.get(dim, 0)
            if dim not in b.window_range:
                b.window_range[dim] = [0 if b.windows else n, n]  # earlier windows had none
            else:
                r = b.window_range[dim]
                r[0], r[1] = min(r[0], n), max(r[1], n)
        b.windows += 1

    def figures(self, *, mode: str | None = None, tag: str | None = None) -> _Bin:
        """The totals of the bins of ``mode`` and ``tag`` (None: every one) merged into one."""
        out = _Bin()
        chosen = [b for (m, t), b in self.bins.items()
                  if (mode is None or m == mode) and (tag is None or t == tag)]
        for b in chosen:
            out.micro[True] += b.micro[True]
            out.micro[False] += b.micro[False]
            out.windows += b.windows
            for key, (calls, nbytes) in b.totals.items():
                c = out.totals.setdefault(key, [0, 0])
                c[0] += calls
                c[1] += nbytes
        for dim in {d for b in chosen for d in b.window_range}:  # a bin that never saw dim: 0 in its windows
            ranges = [b.window_range.get(dim, [0, 0]) for b in chosen if b.windows]
            out.window_range[dim] = [min(r[0] for r in ranges), max(r[1] for r in ranges)]
        return out


def _per(x: float, n: int) -> float | None:
    return x / n if n else None


def mesh_summary(f: _Bin, dims: dict, *, has_mesh: bool) -> dict:
    """One process's ``by_mesh_dim`` block from merged totals (:meth:`MeshAggregates.figures`).

    Args:
        f: the totals of one mode (and tag).
        dims: ``{dimension: size}`` of the mesh (``{}`` without one).
        has_mesh: whether the run had a mesh (without one every collective is on ``"dp"``).

    Keys: ``mesh`` (``dims``, or None), ``windows``, ``micro_batches``, ``sync_micro_batches``,
    ``no_sync_micro_batches``; ``by_dim``: per dimension ``size``, ``calls_per_window``,
    ``bytes_per_window``, ``calls_per_window_min`` / ``_max``, ``calls_per_sync_micro_batch``,
    ``bytes_per_sync_micro_batch``, ``calls_per_no_sync_micro_batch``, ``bytes_per_no_sync_micro_batch``,
    and ``by_kind`` / ``by_phase`` / ``by_class`` (each ``{name: {"calls_per_window", "bytes_per_window"}}``);
    ``by_class``: per class the per-window and per-micro-batch figures and its ``dims``; ``no_sync_scope``
    (:func:`no_sync_scope`). Per-window figures are None without a window, per-micro-batch ones
    without such a micro-batch.
    """
    from .mesh_collectives import classify

    w, ms, mn = f.windows, f.micro[True], f.micro[False]
    by_dim: dict[str, dict] = {}
    by_class: dict[str, dict] = {}

    def add(block: dict, calls: int, nbytes: int, sync) -> None:
        block["calls"] = block.get("calls", 0) + calls
        block["bytes"] = block.get("bytes", 0) + nbytes
        if sync is not None:
            name = "sync" if sync else "no_sync"
            block[f"{name}_calls"] = block.get(f"{name}_calls", 0) + calls
            block[f"{name}_bytes"] = block.get(f"{name}_bytes", 0) + nbytes

    raw: dict[str, dict] = {dim: {"kind": {}, "phase": {}, "class": {}} for dim in dims}
    raw_class: dict[str, dict] = {}
    for (dim, kind, phase, sync), (calls, nbytes) in f.totals.items():
        cls = classify(dim, kind, phase)
        d = raw.setdefault(dim, {"kind": {}, "phase": {}, "class": {}})
        add(d, calls, nbytes, sync)
        for part, name in (("kind", kind), ("phase", phase), ("class", cls)):
            add(d[part].setdefault(name, {}), calls, nbytes, None)
        c = raw_class.setdefault(cls, {"dims": set()})
        c["dims"].add(dim)
        add(c, calls, nbytes, sync)

    def figures(block: dict) -> dict:
        return {"calls_per_window": _per(block.get("calls", 0), w), "bytes_per_window": _per(block.get("bytes", 0), w),
                "calls_per_sync_micro_batch": _per(block.get("sync_calls", 0), ms),
                "bytes_per_sync_micro_batch": _per(block.get("sync_bytes", 0), ms),
                "calls_per_no_sync_micro_batch": _per(block.get("no_sync_calls", 0), mn),
                "bytes_per_no_sync_micro_batch": _per(block.get("no_sync_bytes", 0), mn)}

    for dim, d in raw.items():
        lo, hi = f.window_range.get(dim, [0, 0])
        by_dim[dim] = {"size": dims.get(dim), **figures(d),
                       "calls_per_window_min": lo if w else None, "calls_per_window_max": hi if w else None,
                       **{f"by_{part}": {name: {"calls_per_window": _per(b["calls"], w),
                                                "bytes_per_window": _per(b["bytes"], w)}
                                         for name, b in sorted(d[part].items())}
                          for part in ("kind", "phase", "class")}}
    for cls, c in raw_class.items():
        by_class[cls] = {**figures(c), "dims": sorted(c["dims"])}
    return {"mesh": dict(dims) if has_mesh else None, "windows": w, "micro_batches": ms + mn,
            "sync_micro_batches": ms, "no_sync_micro_batches": mn, "by_dim": by_dim, "by_class": by_class,
            "no_sync_scope": no_sync_scope(by_class, dims, w, ms, mn)}


def no_sync_scope(by_class: dict, dims: dict, windows: int, sync_micro_batches: int,
                  no_sync_micro_batches: int) -> dict:
    """What ``no_sync`` saves, and what it cannot: only the data-parallel gradient synchronisation.

    Keys: ``saved_dims`` (dimensions of the ``gradient_sync`` collectives), ``every_micro_batch_dims``
    (the mesh's tp / cp / sp dimensions and any dimension with ``tensor_parallel`` / ``context_parallel``
    collectives), ``gradient_sync_calls_saved_per_window`` / ``_bytes_saved_per_window`` (per sync minus
    per no-sync micro-batch, times the no-sync micro-batches per window; None without both kinds of
    micro-batch), ``not_saved_calls_per_window`` / ``not_saved_bytes_per_window`` (the tensor- and
    context-parallel collectives, run on every micro-batch whatever the setting) and ``note`` (one sentence).
    """
    from .mesh_collectives import MODEL_PARALLEL_DIMS

    grad = by_class.get("gradient_sync") or {  # none seen: 0 in every micro-batch counted
        "dims": [], **{f"{unit}_per_{name}_micro_batch": 0 if n else None
                       for unit in ("calls", "bytes") for name, n in (("sync", sync_micro_batches),
                                                                      ("no_sync", no_sync_micro_batches))}}
    saved_dims = grad.get("dims", [])
    every = sorted({d for d in dims if d in MODEL_PARALLEL_DIMS}
                   | {d for cls in EVERY_MICRO_BATCH for d in by_class.get(cls, {}).get("dims", [])})
    per_window = _per(no_sync_micro_batches, windows)
    saved = {}
    for unit in ("calls", "bytes"):
        s, n = grad.get(f"{unit}_per_sync_micro_batch"), grad.get(f"{unit}_per_no_sync_micro_batch")
        saved[unit] = (s - n) * per_window if (s is not None and n is not None and per_window) else None
    not_saved = {unit: sum(by_class.get(cls, {}).get(f"{unit}_per_window") or 0 for cls in EVERY_MICRO_BATCH)
                 for unit in ("calls", "bytes")}
    if every:
        note = (f"no_sync defers only the data-parallel gradient synchronisation "
                f"({', '.join(saved_dims) or 'none seen'}); the {', '.join(every)} collectives run on every "
                f"micro-batch under either setting, so the saving no_sync measures (A/B) and is estimated to "
                f"make is the data-parallel part only")
    else:
        note = (f"no_sync defers the data-parallel gradient synchronisation ({', '.join(saved_dims) or 'none seen'}); "
                f"this run has no tensor- or context-parallel dimension")
    return {"saved_dims": saved_dims, "every_micro_batch_dims": every,
            "gradient_sync_calls_saved_per_window": saved["calls"],
            "gradient_sync_bytes_saved_per_window": saved["bytes"],
            "not_saved_calls_per_window": not_saved["calls"], "not_saved_bytes_per_window": not_saved["bytes"],
            "note": note}


def format_mesh_table(block: dict) -> str:
    """A text table of a ``by_mesh_dim`` block: per dimension, calls and bytes per window and per micro-batch."""
    from tabulate import tabulate

    def fmt(v) -> str:
        return "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    rows = [(dim, fmt(d["size"]), fmt(d["calls_per_window"]), fmt(d["bytes_per_window"]),
             fmt(d["calls_per_sync_micro_batch"]), fmt(d["calls_per_no_sync_micro_batch"]),
             ", ".join(d["by_class"]) or "-") for dim, d in block["by_dim"].items()]
    headers = (f"mesh dim ({block['windows']} windows)", "size", "calls / window", "bytes / window",
               "calls / sync mb", "calls / no-sync mb", "classes")
    table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    return f"{table}\n{block['no_sync_scope']['note']}"
