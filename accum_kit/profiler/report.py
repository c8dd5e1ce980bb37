"""The profiler's report, computed from plain records: one process, all processes, a text table.

Definitions (per process, then min / median / max over processes):

- algorithm bandwidth ``algbw = bytes / seconds`` and bus bandwidth
  ``busbw = algbw * 2 (n - 1) / n`` for an all-reduce over n processes: the
  definitions of nccl-tests (``doc/PERFORMANCE.md``), also used by DeepSpeed's
  communication logger. ``seconds`` is the time with at least one bucket
  all-reduce in flight (:func:`busy_seconds`), summed over syncs.
- exposed communication: median backward time of sync micro-batches minus that
  of no-sync micro-batches, i.e. the all-reduce time not hidden behind the
  backward computation; overlap = 1 - exposed / all-reduce time per sync.
- estimated saving: skipped syncs x exposed time (and x full all-reduce
  time, an upper bound); the measured saving comes from an A/B run
  (:class:`accum_kit.profiler.ABSwitch`).
"""

from __future__ import annotations

from ..engines.bandwidth import bus_bandwidth
from ..stats import spread
from .figures import Figures, busy_seconds, from_records
from .records import ProfileRecords

GB = 1e9

__all__ = ["GB", "allreduce_summary", "busy_seconds", "common_summary", "figures_of", "format_table",
           "local_summary", "summarize_processes"]


def local_summary(records: ProfileRecords | Figures, *, mode: str, world_size: int, distributed: bool) -> dict:
    """One process's figures (seconds, bytes, GB/s) from its records of one mode, as DDP reports them.

    :func:`common_summary` (what every engine reports) and :func:`allreduce_summary` (DDP's
    bucket all-reduces) together: the summary of :class:`accum_kit.profiler.parts.BucketPart`.

    Args:
        records: the process's records, already selected (one mode, maybe one tag), or
            their :class:`accum_kit.profiler.figures.Figures` (what the profiler's running
            aggregates give for a run of any length).
        mode: reported as ``mode``.
        world_size: processes in the all-reduce (n of busbw).
        distributed: False when the model is not DDP: nothing was skipped.

    Keys: those of :func:`common_summary` and :func:`allreduce_summary`.
    """
    f = figures_of(records)
    return {**common_summary(f, mode=mode, world_size=world_size, distributed=distributed),
            **allreduce_summary(f, world_size=world_size, distributed=distributed)}


def figures_of(records: ProfileRecords | Figures) -> Figures:
    """``records`` as :class:`accum_kit.profiler.figures.Figures` (computed from raw records, or already figures)."""
    return records if isinstance(records, Figures) else from_records(records)


def common_summary(records: ProfileRecords | Figures, *, mode: str, world_size: int, distributed: bool) -> dict:
    """The figures every engine's summary has (an engine's part may redefine some: see :mod:`.parts`).

    Args: as :func:`local_summary`.

    Keys: ``world_size``, ``mode``, ``optimizer_steps``, ``micro_batches``, ``syncs`` (backward
    passes that all-reduced buckets), ``seconds_per_sync`` (time with at least one bucket
    all-reduce in flight, median over syncs; the union of the bucket intervals, so queued buckets
    are not counted twice and the gaps between buckets are left out), ``skipped_syncs``,
    ``exposed_comm_seconds`` (per sync: median backward of sync minus no-sync micro-batches, when
    buckets were all-reduced), ``overlap_fraction``, ``estimated_seconds_saved`` (whole run,
    exposed-time estimate), ``estimated_seconds_saved_per_step``, ``forward_seconds``,
    ``backward_seconds_sync``, ``backward_seconds_no_sync``, ``optimizer_seconds``,
    ``seconds_per_step`` (medians per micro-batch / step).
    """
    f = figures_of(records)
    bwd_sync, bwd_nosync, per_sync = f.backward_sync, f.backward_no_sync, f.seconds_per_sync
    exposed = (max(bwd_sync - bwd_nosync, 0.0)
               if (bwd_sync is not None and bwd_nosync is not None and f.allreduce_calls) else None)
    skipped = f.no_sync_micro_batches if distributed else 0
    n_steps = f.optimizer_steps or f.call_steps or 1
    nothing_skipped = 0.0 if not distributed else None  # one process: no saving, rather than unknown
    return {
        "world_size": world_size,
        "mode": mode,
        "optimizer_steps": f.optimizer_steps,
        "micro_batches": f.micro_batches,
        "syncs": f.syncs,
        "seconds_per_sync": per_sync or 0.0,
        "skipped_syncs": skipped,
        "exposed_comm_seconds": exposed if distributed else 0.0,
        # Exposed time can exceed the all-reduce's own span: it also holds the wait for slower
        # processes to reach the sync. Overlap is then 0, not negative.
        "overlap_fraction": max(0.0, 1 - exposed / per_sync) if (exposed is not None and per_sync) else None,
        "estimated_seconds_saved": skipped * exposed if exposed is not None else nothing_skipped,
        "estimated_seconds_saved_per_step": (skipped / n_steps * exposed) if exposed is not None else nothing_skipped,
        "forward_seconds": f.forward,
        "backward_seconds_sync": bwd_sync,
        "backward_seconds_no_sync": bwd_nosync,
        "optimizer_seconds": f.optimizer,
        "seconds_per_step": f.step,
    }


def allreduce_summary(records: ProfileRecords | Figures, *, world_size: int, distributed: bool) -> dict:
    """DDP's gradient-bucket all-reduces (the comm hook's records, or a loop's own all-reduces).

    Args: as :func:`local_summary`.

    Keys: ``allreduce_calls``, ``allreduce_bytes``, ``allreduce_seconds`` (sum of bucket
    latencies), ``allreduce_calls_per_step``, ``allreduce_bytes_per_step``,
    ``allreduce_calls_per_sync`` (median buckets per sync: DDP rebuilds its buckets after the
    first iteration, so the first sync may differ), ``algbw_GBps`` = bytes / the time with a
    bucket in flight summed over syncs, ``busbw_GBps``, ``estimated_seconds_saved_upper``
    (skipped syncs x that time per sync: the full latency, an upper bound).
    """
    f = figures_of(records)
    algbw = f.allreduce_bytes / f.busy_seconds / GB if f.busy_seconds > 0 else 0.0
    n = world_size
    skipped = f.no_sync_micro_batches if distributed else 0
    n_steps = f.optimizer_steps or f.call_steps or 1
    return {
        "allreduce_calls": f.allreduce_calls,
        "allreduce_bytes": f.allreduce_bytes,
        "allreduce_seconds": f.allreduce_seconds,
        "allreduce_calls_per_step": f.allreduce_calls / n_steps,
        "allreduce_bytes_per_step": f.allreduce_bytes / n_steps,
        "allreduce_calls_per_sync": f.calls_per_sync or 0,
        "algbw_GBps": algbw,
        "busbw_GBps": bus_bandwidth(algbw, "all_reduce", n) if n > 1 else 0.0,
        "estimated_seconds_saved_upper": skipped * (f.seconds_per_sync or 0.0),
    }


def summarize_processes(local: dict, world_size: int) -> dict:
    """The ``comm`` block: ``local`` of every process, gathered; collective (every process must call it).

    Top-level values are the main process's; ``per_process`` lists each
    process's ``local`` and ``spread`` the min / median / max of every numeric
    field over processes, so a straggler shows.
    """
    if world_size > 1:
        from accelerate.utils import gather_object

        everyone = gather_object([local])
    else:
        everyone = [local]
    numeric = [k for k, v in local.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out = dict(everyone[0])
    out["per_process"] = everyone
    out["spread"] = {k: spread(p.get(k) for p in everyone) for k in numeric}
    return out


#: (label, key of the comm block, unit) per row of :func:`format_table`, in order; absent keys are skipped.
TABLE_ROWS = (
    ("all-reduce calls", "allreduce_calls", ""), ("all-reduce calls / step", "allreduce_calls_per_step", ""),
    ("all-reduce calls / sync (buckets)", "allreduce_calls_per_sync", ""),
    ("all-reduce bytes", "allreduce_bytes", " B"), ("all-reduce seconds (sum of buckets)", "allreduce_seconds", " s"),
    ("reduce-scatter calls (FSDP2)", "reduce_scatter_calls", ""),
    ("reduce-scatter calls / step", "reduce_scatter_calls_per_step", ""),
    ("reduce-scatter bytes / step", "reduce_scatter_bytes_per_step", " B"),
    ("reduce-scatter busbw", "reduce_scatter_busbw_GBps", " GB/s"),
    ("all-gather calls (FSDP2)", "all_gather_calls", ""), ("all-gather calls / step", "all_gather_calls_per_step", ""),
    ("all-gather bytes / step", "all_gather_bytes_per_step", " B"), ("all-gather busbw", "all_gather_busbw_GBps", " GB/s"),
    ("seconds per sync", "seconds_per_sync", " s"), ("algbw", "algbw_GBps", " GB/s"), ("busbw", "busbw_GBps", " GB/s"),
    ("skipped syncs", "skipped_syncs", ""), ("forward / micro-batch", "forward_seconds", " s"),
    ("backward, sync micro-batch", "backward_seconds_sync", " s"),
    ("backward, no-sync micro-batch", "backward_seconds_no_sync", " s"),
    ("exposed comm / sync", "exposed_comm_seconds", " s"), ("overlap fraction", "overlap_fraction", ""),
    ("exposed all-gather / step", "exposed_all_gather_seconds_per_step", " s"),
    ("exposed comm / step", "exposed_comm_seconds_per_step", " s"),
    ("accumulation / micro-batch", "accumulation_seconds", " s"), ("compute / micro-batch", "compute_seconds", " s"), ("ideal s/step (from the parts)", "ideal_seconds_per_step", " s"),
    ("s/step over ideal", "seconds_per_step_over_ideal", ""),
    ("optimizer step", "optimizer_seconds", " s"), ("estimated saved (exposed)", "estimated_seconds_saved", " s"),
    ("estimated saved (full latency)", "estimated_seconds_saved_upper", " s"),
    ("estimated saved / step (exposed)", "estimated_seconds_saved_per_step", " s"),
    ("s/step, sync_each_batch (A/B)", "seconds_per_step_sync_each_batch", " s"),
    ("s/step, no_sync (A/B)", "seconds_per_step_no_sync", " s"),
    ("measured saved / step (A/B)", "measured_seconds_saved_per_step", " s"), ("speedup (A/B)", "speedup", "x"),
    ("estimated / measured saving", "estimated_over_measured", ""),
    ("s/step, profiler on", "seconds_per_step_profiler_on", " s"),
    ("s/step, profiler off", "seconds_per_step_profiler_off", " s"),
    ("profiler overhead ratio (on / off)", "profiler_overhead_ratio", ""),
)


def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}{unit}"
    return f"{v}{unit}"


def format_table(comm: dict) -> str:
    """A text table of a ``comm`` block: the main process's value and min / median / max over processes; with a
    ``by_mesh_dim`` block, its table (:func:`accum_kit.profiler.mesh_report.format_mesh_table`) below."""
    from tabulate import tabulate

    spread_of = comm.get("spread", {})
    rows = []
    for label, key, unit in TABLE_ROWS:
        if key not in comm:
            continue
        s = spread_of.get(key)
        rows.append((label, _fmt(comm[key], unit), f"{_fmt(s['min'])} / {_fmt(s['median'])} / {_fmt(s['max'])}" if s else ""))
    headers = (f"communication ({comm.get('world_size')} processes)", "main", "min / median / max over processes")
    table = tabulate(rows, headers=headers, tablefmt="simple", colalign=("left", "right", "left"),
                     disable_numparse=True)
    if comm.get("by_mesh_dim"):  # the profiler counted by mesh dimension: its table and what no_sync saves
        from .mesh_report import format_mesh_table

        table += "\n\n" + format_mesh_table(comm["by_mesh_dim"])
    return table
