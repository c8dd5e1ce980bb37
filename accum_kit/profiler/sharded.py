"""The profiler's report under FSDP2: reduce-scatters, all-gathers, exposed time, ideal step and estimated saving.

Computed from one process's records of one mode (no torch), and merged into
:func:`accum_kit.profiler.report.local_summary` when the model is FSDP2.

Definitions (seconds, bytes; "per step" divides by the optimizer steps recorded):

- bandwidth per collective, nccl-tests' definitions
  (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
  ``algbw = S / t`` with S the whole buffer (the all-gather's output, the
  reduce-scatter's input) and t the call's seconds, summed over calls;
  ``busbw = algbw (n - 1) / n`` for both all-gather and reduce-scatter;
- a sync is a backward that reduce-scattered (one call per unit); the
  exposed reduce-scatter per sync is the median backward of sync
  micro-batches minus that of no-sync ones, as for DDP (it includes FSDP2's
  copy into the reduce-scatter buffer); with no no-sync micro-batch
  (``sync_each_batch``, K=1) it is the reduce-scatter seconds per sync;
- exposed all-gather per step: the time with an all-gather in flight. FSDP2
  calls its all-gathers synchronously on CPU (gloo), so the training thread
  waits for all of it; on CUDA they run on a side stream and this is an
  upper bound;
- compute per micro-batch: forward + backward minus the collectives of that
  micro-batch, median over the no-sync micro-batches (over all, without the
  reduce-scatters, when there is none);
- ideal step (what a step would take with nothing but its parts):
  ``K x compute + syncs per step x exposed reduce-scatter + exposed all-gather
  per step + optimizer step``; ``seconds_per_step_over_ideal`` is the measured
  median step over it;
- accumulation per micro-batch: what adding a backward's gradients into the
  unsharded gradient held from the window's earlier micro-batches costs,
  against a micro-batch that finds none (the window's first): the median
  backward of the later no-sync micro-batches minus that of the first ones.
  Syncing every micro-batch never pays it (FSDP2 frees the unsharded
  gradient after each reduce-scatter and adds only the 1/W shard), so it
  is part of what ``no_sync`` costs;
- HSDP (2-D mesh): reduce-scatters and all-gathers run in the shard group
  (n = S for their busbw), FSDP2's all-reduce of each reduce-scattered shard
  in the replicate group (n = R, busbw ``2 algbw (n - 1) / n``); ``by_group``
  gives calls, bytes, seconds and bandwidths per step for each. With no-sync
  micro-batches the exposed reduce-scatter per sync (a backward difference)
  includes the all-reduce that follows it; without, the all-reduce seconds
  per step are added to the exposed time and the ideal. The saving adds,
  for ``reduce_scatter_each_batch``, the all-reduces it defers (micro-batches
  that reduce-scattered without all-reducing) x the median all-reduce
  seconds of one that did;
- estimated saving per step against syncing every micro-batch with the same
  reshard settings (what :class:`accum_kit.profiler.ABSwitch` alternates
  with)::

      skipped syncs per step x (R - H + A - G) + all-gathers term

  A window of K micro-batches under ``no_sync`` reduces once (the last) and
  accumulates K - 1 times into the unsharded gradient; syncing each reduces K
  times, and K - 1 of those reductions add the new shard into the one already
  held. So per skipped sync:

  * R, measured: FSDP2's post-backward hooks of a sync micro-batch (all units
    summed; median): the whole reduction path, i.e. copy into the
    reduce-scatter input, division, reduce-scatter, storing the shard (HSDP:
    the all-reduce across replicas);
  * H, measured: the same hooks in a deferred micro-batch (reshard only);
  * A, the add of the new shard into the held one that syncing each
    micro-batch pays and ``no_sync`` never does: measured as R of the
    micro-batches that added minus R when the records hold both (a
    ``sync_each_batch`` selection); otherwise ASSUMED to be G / S, the
    accumulation below scaled to the 1/S of the elements a shard holds
    (both are one elementwise add over fp32 gradients: memory-bound);
  * G, measured: the add into the unsharded gradient held, which happens in
    autograd, outside the hooks (:func:`accumulation_seconds`): timed around
    autograd's accumulation on CPU, per micro-batch, later no-sync
    micro-batches minus a window's first; elsewhere the backward of later
    no-sync micro-batches minus that of a window's first, which also carries
    what else sets a window's first backward apart (on a 2-core CPU machine
    as much as the add: it follows the optimizer step).

  Without post-backward records R - H is replaced by the exposed
  reduce-scatter per sync (backward difference) and A by 0.
  ``estimated_cpu_seconds_saved_per_step`` is the first term again with R,
  H, A and G in the process's CPU seconds (``time.process_time`` around the
  hooks and the backwards): the work saved, without the waits a loaded
  machine adds; compare it with the measured CPU seconds per step.
  The all-gathers term: per unit, the all-gathers syncing every micro-batch
  would make (K per step, 2K for a unit that reshards after forward) minus
  those recorded, times that unit's median seconds per all-gather. Assumed
  throughout: the rest of a micro-batch (forward, backward compute, the
  optimizer step) costs the same under both settings.
"""

from __future__ import annotations

from ..engines.bandwidth import bus_bandwidth
from ..planning.step_time import window_seconds
from .figures import Figures, from_records
from .records import ProfileRecords
from .report import GB


def _bandwidths(calls: int, nbytes: int, seconds: float, n: int,
                kind: str = "reduce_scatter") -> tuple[float | None, float | None]:
    if not calls or seconds <= 0:
        return None, None
    algbw = nbytes / seconds / GB
    return algbw, bus_bandwidth(algbw, kind, n)


def sharded_summary(records: ProfileRecords | Figures, *, shard_size: int, units: list[dict],
                    replicate_size: int = 1) -> dict:
    """FSDP2 figures of one process from its records of one mode (see the module docstring).

    Args:
        records: the process's records, already selected (one mode, maybe one tag or several: records
            are told apart by (tag, micro-batch) and (tag, step), so runs with their own tags can be pooled),
            or their :class:`accum_kit.profiler.figures.Figures` (the profiler's running aggregates).
        shard_size: S, processes in each all-gather and reduce-scatter (n of their busbw): the world
            under plain FSDP2, the shard group under HSDP.
        replicate_size: R, processes in each all-reduce across replicas (HSDP; 1 for plain FSDP2).
        units: :meth:`accum_kit.profiler.collectives.CollectiveRecorder.unit_info`
            (``reshard_after_forward`` decides the all-gathers of syncing every micro-batch).

    Keys: ``reduce_scatter_calls``, ``reduce_scatter_bytes``, ``reduce_scatter_seconds``,
    ``all_gather_calls``, ``all_gather_bytes``, ``all_gather_seconds`` (whole run), each
    ``*_per_step``; ``reduce_scatter_calls_per_sync``, ``all_gather_calls_per_micro_batch``
    (medians); ``reduce_scatter_algbw_GBps``, ``reduce_scatter_busbw_GBps``,
    ``all_gather_algbw_GBps``, ``all_gather_busbw_GBps``; ``syncs``, ``skipped_syncs``,
    ``seconds_per_sync`` (reduce-scatter seconds per sync, median), ``exposed_comm_seconds``
    (exposed reduce-scatter per sync), ``exposed_reduce_scatter_source``,
    ``exposed_all_gather_seconds_per_step``, ``exposed_comm_seconds_per_step``,
    ``accumulation_seconds`` (G per micro-batch; 0 without a window of 3 or more) and
    ``accumulation_source``,
    ``compute_seconds`` (per micro-batch), ``ideal_seconds_per_step``,
    ``seconds_per_step_over_ideal``, ``estimated_seconds_saved``,
    ``estimated_seconds_saved_per_step`` and its terms (:func:`saved_per_skipped_sync`),
    ``estimated_cpu_seconds_saved_per_step``, ``overlap_fraction``, ``fsdp_units`` (``units``),
    ``mesh`` (``dp_replicate_size``, ``dp_shard_size``) and ``by_group`` (:func:`by_group`). Under HSDP
    ``all_reduce_*`` as ``reduce_scatter_*``, and the reduce-scatter per sync and its exposed time
    include the all-reduce that follows it in the backward.
    """
    f = records if isinstance(records, Figures) else from_records(records)
    n = shard_size
    n_steps = f.optimizer_steps or f.collective_steps or 1
    k = f.micro_batches / f.optimizer_steps if f.optimizer_steps else None
    no_sync = f.no_sync_micro_batches
    compute = f.compute_no_sync if no_sync else f.compute_all
    rs_per_sync = f.rs_seconds_per_sync
    bwd_sync, bwd_nosync = f.backward_sync, f.backward_no_sync
    if bwd_sync is not None and bwd_nosync is not None and f.rs_calls:
        exposed_rs, source = max(bwd_sync - bwd_nosync, 0.0), "backward of sync minus no-sync micro-batches"
    else:
        exposed_rs, source = (rs_per_sync, "reduce-scatter seconds per sync") if f.rs_calls else (0.0, "no reduce-scatter")
    accumulation, accumulation_source = accumulation_seconds(f)
    syncs, skipped = f.rs_syncs, no_sync
    ag_exposed = f.ag_busy_seconds / n_steps
    ar_extra, ar_saved = _replicate_all_reduce(f, n_steps, from_backwards=bool(no_sync and f.rs_calls))
    opt, step = f.optimizer, f.step
    ideal = (window_seconds(k, compute, communication_seconds=syncs / n_steps * exposed_rs + ar_extra + ag_exposed,
                            other_seconds=opt or 0.0).seconds if (k is not None and compute is not None) else None)

    ag_saved = 0.0  # per step, against every micro-batch syncing with the same reshard settings
    if k is not None:
        for index, unit in enumerate(units):
            calls, per_call = f.ag_per_unit.get(index, (0, None))
            baseline = k * (2 if unit.get("reshard_after_forward") else 1)
            if per_call is not None:
                ag_saved += max(baseline - calls / n_steps, 0.0) * per_call
    per_skip = saved_per_skipped_sync(f, exposed_rs, accumulation, shard_size)
    saved_per_step = skipped / n_steps * per_skip["saved_per_skipped_sync_seconds"] + ag_saved + ar_saved
    rs_alg, rs_bus = _bandwidths(f.rs_calls, f.rs_bytes, f.rs_seconds, n)
    ag_alg, ag_bus = _bandwidths(f.ag_calls, f.ag_bytes, f.ag_seconds, n, "all_gather")
    hsdp = {} if replicate_size < 2 else {
        "all_reduce_calls": f.ar_calls,
        "all_reduce_bytes": f.ar_bytes,
        "all_reduce_seconds": f.ar_seconds,
        "all_reduce_calls_per_step": f.ar_calls / n_steps,
        "all_reduce_bytes_per_step": f.ar_bytes / n_steps,
    }
    return {
        **hsdp,
        "mesh": {"dp_replicate_size": replicate_size, "dp_shard_size": shard_size},
        "by_group": by_group(f, n_steps, shard_size, replicate_size),
        "reduce_scatter_calls": f.rs_calls,
        "reduce_scatter_bytes": f.rs_bytes,
        "reduce_scatter_seconds": f.rs_seconds,
        "reduce_scatter_calls_per_step": f.rs_calls / n_steps,
        "reduce_scatter_bytes_per_step": f.rs_bytes / n_steps,
        "reduce_scatter_calls_per_sync": f.rs_calls_per_sync or 0,
        "reduce_scatter_algbw_GBps": rs_alg,
        "reduce_scatter_busbw_GBps": rs_bus,
        "all_gather_calls": f.ag_calls,
        "all_gather_bytes": f.ag_bytes,
        "all_gather_seconds": f.ag_seconds,
        "all_gather_calls_per_step": f.ag_calls / n_steps,
        "all_gather_bytes_per_step": f.ag_bytes / n_steps,
        "all_gather_calls_per_micro_batch": f.ag_calls_per_micro_batch,
        "all_gather_algbw_GBps": ag_alg,
        "all_gather_busbw_GBps": ag_bus,
        "syncs": syncs,
        "skipped_syncs": skipped,
        "seconds_per_sync": rs_per_sync or 0.0,
        "exposed_comm_seconds": exposed_rs,
        "exposed_reduce_scatter_source": source,
        "exposed_all_gather_seconds_per_step": ag_exposed,
        "exposed_comm_seconds_per_step": syncs / n_steps * exposed_rs + ar_extra + ag_exposed,
        "overlap_fraction": max(0.0, 1 - exposed_rs / rs_per_sync) if rs_per_sync and no_sync and f.rs_calls else None,
        "accumulation_seconds": accumulation,
        "accumulation_source": accumulation_source,
        "compute_seconds": compute,
        "ideal_seconds_per_step": ideal,
        "seconds_per_step_over_ideal": step / ideal if (step and ideal) else None,
        **per_skip,
        "estimated_cpu_seconds_saved_per_step": (skipped / n_steps * per_skip["saved_per_skipped_sync_cpu_seconds"]
                                                 if per_skip["saved_per_skipped_sync_cpu_seconds"] is not None
                                                 else None),
        "estimated_seconds_saved": saved_per_step * n_steps,
        "estimated_seconds_saved_per_step": saved_per_step,
        "fsdp_units": units,
    }


def accumulation_seconds(f: Figures, cpu: bool = False) -> tuple[float, str]:
    """G, the seconds (``cpu``: CPU seconds) a no-sync micro-batch spends adding into the held unsharded
    gradient, and where it came from.

    Timed around autograd's accumulation (:mod:`.accumulation`) where the
    records have it: the median over later no-sync micro-batches minus that
    over a window's first (which hands its gradient over without an add, as
    every micro-batch does when syncing each one). Otherwise the difference
    of the same two backwards' medians, which also carries whatever else
    sets a window's first backward apart. 0 without a window of 2 no-sync
    micro-batches.
    """
    suffix = "_cpu" if cpu else ""
    first, later = getattr(f, f"accumulate_first{suffix}"), getattr(f, f"accumulate_later{suffix}")
    if first is not None and later is not None:
        return later - first, "timed around autograd's accumulation"
    first, later = getattr(f, f"backward_first{suffix}"), getattr(f, f"backward_later{suffix}")
    if first is not None and later is not None:
        return later - first, "backward of later minus first no-sync micro-batches"
    return 0.0, "none"


def saved_per_skipped_sync(f: Figures, exposed_rs: float, accumulation: float, shard_size: int) -> dict:
    """The estimated seconds one skipped sync saves, R - H + A - G, and its terms (see the module docstring).

    Keys: ``post_backward_sync_seconds`` (R), ``post_backward_no_sync_seconds`` (H),
    ``post_backward_adding_seconds`` (R of micro-batches that added to a held shard; None without),
    ``reduction_seconds_per_sync`` (R - H, or the exposed reduce-scatter without hook records),
    ``shard_add_seconds`` (A) and ``shard_add_source`` (``"measured"``, ``"assumed: accumulation / S"``
    or ``"none"``), ``estimate_source``, ``saved_per_skipped_sync_seconds``; in the process's CPU
    seconds: ``post_backward_{sync,no_sync,adding}_cpu_seconds``, ``accumulation_cpu_seconds``,
    ``shard_add_cpu_seconds`` and ``saved_per_skipped_sync_cpu_seconds`` (R, H, A and G all in CPU time;
    None without CPU records): what the work costs whatever else holds the cores, the figure to compare
    on a loaded machine with the measured CPU seconds per step.
    """
    out = _terms(f.pb_sync, f.pb_no_sync, f.pb_sync_adding, exposed_rs, accumulation, shard_size)
    g_cpu, _ = accumulation_seconds(f, cpu=True)
    cpu = (_terms(f.pb_sync_cpu, f.pb_no_sync_cpu, f.pb_sync_adding_cpu, None, g_cpu, shard_size)
           if f.pb_sync_cpu is not None else None)
    return {"post_backward_sync_seconds": f.pb_sync, "post_backward_no_sync_seconds": f.pb_no_sync,
            "post_backward_adding_seconds": f.pb_sync_adding, "reduction_seconds_per_sync": out["reduction"],
            "shard_add_seconds": out["add"], "shard_add_source": out["add_source"], "estimate_source": out["source"],
            "saved_per_skipped_sync_seconds": out["saved"],
            "post_backward_sync_cpu_seconds": f.pb_sync_cpu, "post_backward_no_sync_cpu_seconds": f.pb_no_sync_cpu,
            "post_backward_adding_cpu_seconds": f.pb_sync_adding_cpu,
            "accumulation_cpu_seconds": g_cpu if cpu is not None else None,
            "shard_add_cpu_seconds": cpu["add"] if cpu is not None else None,
            "saved_per_skipped_sync_cpu_seconds": cpu["saved"] if cpu is not None else None}


def _terms(r, h, adding, exposed_rs, accumulation: float, shard_size: int) -> dict:
    """R - H + A - G from its medians (wall or CPU seconds); which of them the records gave decides the sources."""
    if r is not None and h is not None:
        reduction, source = r - h, "post-backward hooks: sync minus deferred micro-batches"
    elif r is not None and adding is not None:  # sync_each_batch: every micro-batch reduces
        reduction, source = r, "post-backward hooks of sync micro-batches"
    else:
        reduction, source = exposed_rs or 0.0, "exposed reduce-scatter (no post-backward records)"
    if r is not None and adding is not None:
        add, add_source = max(adding - r, 0.0), "measured"
    elif r is not None:
        add, add_source = accumulation / max(shard_size, 1), "assumed: accumulation / S"
    else:
        add, add_source = 0.0, "none"
    return {"reduction": reduction, "source": source, "add": add, "add_source": add_source,
            "saved": reduction + add - accumulation}


def _replicate_all_reduce(f: Figures, n_steps: int, from_backwards: bool) -> tuple[float, float]:
    """HSDP's all-reduces across replicas: (exposed seconds per step not already in the exposed
    reduce-scatter, estimated seconds saved per step against all-reducing on every micro-batch).

    With no-sync micro-batches the exposed reduce-scatter comes from backward differences and holds
    the all-reduce already: nothing to add. Without (``sync_each_batch``, ``reduce_scatter_each_batch``)
    the all-reduce seconds per step are added. Saved: the micro-batches that reduce-scattered but did not
    all-reduce (``reduce_scatter_each_batch``'s non-boundary ones) x the median all-reduce seconds of a
    micro-batch that did.
    """
    if not f.ar_calls:
        return 0.0, 0.0
    deferred = max(f.micro_batches - f.no_sync_micro_batches - f.ar_micro_batches, 0)
    extra = 0.0 if from_backwards else f.ar_seconds / n_steps
    return extra, deferred / n_steps * (f.ar_seconds_per_micro or 0.0)


def by_group(f: Figures, n_steps: int, shard_size: int, replicate_size: int) -> dict:
    """Per mesh dimension and collective kind, per optimizer step: what ran where.

    FSDP2's reduce-scatters and all-gathers run in the shard group, its all-reduces (HSDP) in the
    replicate group, so the kinds' totals are the groups' totals.

    Returns:
        ``{"shard": {"size": S, "reduce_scatter": {...}, "all_gather": {...}},
        "replicate": {"size": R, "all_reduce": {...}}}`` (``replicate`` only under HSDP); each
        ``{...}`` holds ``calls_per_step``, ``bytes_per_step``, ``seconds_per_step`` (time the
        training thread spent in the calls: FSDP2 calls them synchronously on CPU, so all of it is
        exposed there; on CUDA they run on side streams and this is an upper bound of the exposed
        time), ``algbw_GBps`` and ``busbw_GBps`` (nccl-tests: ``(n - 1) / n`` for reduce-scatter and
        all-gather, ``2 (n - 1) / n`` for all-reduce, n the group's size).
    """
    def block(calls: int, nbytes: int, seconds: float, n: int, kind: str = "reduce_scatter") -> dict:
        alg, bus = _bandwidths(calls, nbytes, seconds, n, kind)
        return {"calls_per_step": calls / n_steps, "bytes_per_step": nbytes / n_steps,
                "seconds_per_step": seconds / n_steps, "algbw_GBps": alg,
                "busbw_GBps": bus}

    out = {"shard": {"size": shard_size, "reduce_scatter": block(f.rs_calls, f.rs_bytes, f.rs_seconds, shard_size),
                     "all_gather": block(f.ag_calls, f.ag_bytes, f.ag_seconds, shard_size, "all_gather")}}
    if replicate_size > 1:  # an all-reduce moves 2 (n - 1) / n of its buffer per process
        out["replicate"] = {"size": replicate_size,
                            "all_reduce": block(f.ar_calls, f.ar_bytes, f.ar_seconds, replicate_size, "all_reduce")}
    return out
