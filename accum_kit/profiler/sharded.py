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
  with): skipped syncs per step x (exposed reduce-scatter per sync minus the
  accumulation per micro-batch), plus, per unit, the all-gathers syncing
  every micro-batch would make (K per step, 2K for a unit that reshards after
  forward) minus those recorded, times that unit's median seconds per
  all-gather. (A window of K micro-batches: the first allocates the gradient,
  the K - 2 other no-sync ones and the boundary add to it; syncing each would instead pay the
  reduce-scatter K - 1 more times and the accumulation K - 1 fewer times.)
"""

from __future__ import annotations

from collections import Counter, defaultdict

from ..stats import median
from .records import ProfileRecords
from .report import GB, busy_seconds


def _bandwidths(calls, n: int) -> tuple[float | None, float | None]:
    seconds = sum(c.seconds for c in calls)
    if not calls or seconds <= 0:
        return None, None
    algbw = sum(c.bytes for c in calls) / seconds / GB
    return algbw, algbw * (n - 1) / n if n > 1 else 0.0


def sharded_summary(records: ProfileRecords, *, shard_size: int, units: list[dict], replicate_size: int = 1) -> dict:
    """FSDP2 figures of one process from its records of one mode (see the module docstring).

    Args:
        records: the process's records, already selected (one mode, maybe one tag or several: records
            are told apart by (tag, micro-batch) and (tag, step), so runs with their own tags can be pooled).
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
    ``accumulation_seconds`` (per micro-batch; 0 without a window of 3 or more),
    ``compute_seconds`` (per micro-batch), ``ideal_seconds_per_step``,
    ``seconds_per_step_over_ideal``, ``estimated_seconds_saved``,
    ``estimated_seconds_saved_per_step``, ``overlap_fraction``, ``fsdp_units`` (``units``),
    ``mesh`` (``dp_replicate_size``, ``dp_shard_size``) and ``by_group`` (:func:`by_group`). Under HSDP ``all_reduce_*`` as ``reduce_scatter_*``, and the
    reduce-scatter per sync and its exposed time include the all-reduce that follows it in the backward.
    """
    n = shard_size
    mbs, steps = records.micro_batches, records.steps
    rs = [c for c in records.collectives if c.kind == "reduce_scatter"]
    ag = [c for c in records.collectives if c.kind == "all_gather"]
    n_steps = len(steps) or len({(c.tag, c.step) for c in records.collectives}) or 1
    k = len(mbs) / len(steps) if steps else None

    by_micro: dict[int, list] = defaultdict(list)
    for c in records.collectives:
        by_micro[(c.tag, c.micro_batch)].append(c)
    rs_by_sync: dict[int, list] = defaultdict(list)
    for c in rs:
        rs_by_sync[(c.tag, c.micro_batch)].append(c)
    ag_per_micro = Counter((c.tag, c.micro_batch) for c in ag)

    def collective_seconds(m, kinds) -> float:
        return busy_seconds([c for c in by_micro.get((m.tag, m.micro_batch), []) if c.kind in kinds])

    no_sync = [m for m in mbs if not m.sync]
    if no_sync:
        compute = median(m.forward_seconds + m.backward_seconds - collective_seconds(m, ("all_gather",)) for m in no_sync)
    else:
        compute = median(m.forward_seconds + m.backward_seconds
                         - collective_seconds(m, ("all_gather", "reduce_scatter", "all_reduce")) for m in mbs)
    rs_per_sync = median(sum(c.seconds for c in g) for g in rs_by_sync.values())
    bwd_sync = median(m.backward_seconds for m in mbs if m.sync)
    bwd_nosync = median(m.backward_seconds for m in no_sync)
    if bwd_sync is not None and bwd_nosync is not None and rs:
        exposed_rs, source = max(bwd_sync - bwd_nosync, 0.0), "backward of sync minus no-sync micro-batches"
    else:
        exposed_rs, source = (rs_per_sync, "reduce-scatter seconds per sync") if rs else (0.0, "no reduce-scatter")
    first_of_window = {}
    for m in mbs:
        key = (m.tag, m.step)
        first_of_window[key] = min(first_of_window.get(key, m.micro_batch), m.micro_batch)

    def first(m) -> bool:
        return m.micro_batch == first_of_window[(m.tag, m.step)]

    bwd_first = median(m.backward_seconds for m in no_sync if first(m))
    bwd_later = median(m.backward_seconds for m in no_sync if not first(m))
    accumulation = bwd_later - bwd_first if (bwd_first is not None and bwd_later is not None) else 0.0
    syncs = len(rs_by_sync)
    skipped = sum(1 for m in mbs if not m.sync)
    ag_exposed = busy_seconds(ag) / n_steps
    ar_extra, ar_saved = _replicate_all_reduce(records, mbs, n_steps, from_backwards=bool(no_sync and rs))
    opt = median(s.optimizer_seconds for s in steps)
    step = median(s.step_seconds for s in steps)
    ideal = (k * compute + syncs / n_steps * exposed_rs + ar_extra + ag_exposed + (opt or 0.0)
             if (k is not None and compute is not None) else None)

    ag_saved = 0.0  # per step, against every micro-batch syncing with the same reshard settings
    if k is not None:
        for index, unit in enumerate(units):
            mine = [c for c in ag if c.unit == index]
            baseline = k * (2 if unit.get("reshard_after_forward") else 1)
            per_call = median(c.seconds for c in mine)
            if per_call is not None:
                ag_saved += max(baseline - len(mine) / n_steps, 0.0) * per_call
    saved_per_step = skipped / n_steps * (exposed_rs - accumulation) + ag_saved + ar_saved
    rs_alg, rs_bus = _bandwidths(rs, n)
    ag_alg, ag_bus = _bandwidths(ag, n)
    ar = [c for c in records.collectives if c.kind == "all_reduce"]
    hsdp = {} if replicate_size < 2 else {
        "all_reduce_calls": len(ar),
        "all_reduce_bytes": sum(c.bytes for c in ar),
        "all_reduce_seconds": sum(c.seconds for c in ar),
        "all_reduce_calls_per_step": len(ar) / n_steps,
        "all_reduce_bytes_per_step": sum(c.bytes for c in ar) / n_steps,
    }
    return {
        **hsdp,
        "mesh": {"dp_replicate_size": replicate_size, "dp_shard_size": shard_size},
        "by_group": by_group(records.collectives, n_steps, shard_size, replicate_size),
        "reduce_scatter_calls": len(rs),
        "reduce_scatter_bytes": sum(c.bytes for c in rs),
        "reduce_scatter_seconds": sum(c.seconds for c in rs),
        "reduce_scatter_calls_per_step": len(rs) / n_steps,
        "reduce_scatter_bytes_per_step": sum(c.bytes for c in rs) / n_steps,
        "reduce_scatter_calls_per_sync": median(len(g) for g in rs_by_sync.values()) or 0,
        "reduce_scatter_algbw_GBps": rs_alg,
        "reduce_scatter_busbw_GBps": rs_bus,
        "all_gather_calls": len(ag),
        "all_gather_bytes": sum(c.bytes for c in ag),
        "all_gather_seconds": sum(c.seconds for c in ag),
        "all_gather_calls_per_step": len(ag) / n_steps,
        "all_gather_bytes_per_step": sum(c.bytes for c in ag) / n_steps,
        "all_gather_calls_per_micro_batch": median(ag_per_micro.get((m.tag, m.micro_batch), 0) for m in mbs),
        "all_gather_algbw_GBps": ag_alg,
        "all_gather_busbw_GBps": ag_bus,
        "syncs": syncs,
        "skipped_syncs": skipped,
        "seconds_per_sync": rs_per_sync or 0.0,
        "exposed_comm_seconds": exposed_rs,
        "exposed_reduce_scatter_source": source,
        "exposed_all_gather_seconds_per_step": ag_exposed,
        "exposed_comm_seconds_per_step": syncs / n_steps * exposed_rs + ar_extra + ag_exposed,
        "overlap_fraction": max(0.0, 1 - exposed_rs / rs_per_sync) if rs_per_sync and no_sync and rs else None,
        "accumulation_seconds": accumulation,
        "compute_seconds": compute,
        "ideal_seconds_per_step": ideal,
        "seconds_per_step_over_ideal": step / ideal if (step and ideal) else None,
        "estimated_seconds_saved": saved_per_step * n_steps,
        "estimated_seconds_saved_per_step": saved_per_step,
        "fsdp_units": units,
    }


def _replicate_all_reduce(records: ProfileRecords, mbs, n_steps: int, from_backwards: bool) -> tuple[float, float]:
    """HSDP's all-reduces across replicas: (exposed seconds per step not already in the exposed
    reduce-scatter, estimated seconds saved per step against all-reducing on every micro-batch).

    With no-sync micro-batches the exposed reduce-scatter comes from backward differences and holds
    the all-reduce already: nothing to add. Without (``sync_each_batch``, ``reduce_scatter_each_batch``)
    the all-reduce seconds per step are added. Saved: the micro-batches that reduce-scattered but did not
    all-reduce (``reduce_scatter_each_batch``'s non-boundary ones) x the median all-reduce seconds of a
    micro-batch that did.
    """
    ar = [c for c in records.collectives if c.kind == "all_reduce"]
    if not ar:
        return 0.0, 0.0
    per_micro: dict = defaultdict(float)
    for c in ar:
        per_micro[(c.tag, c.micro_batch)] += c.seconds
    deferred = sum(1 for m in mbs if m.sync and (m.tag, m.micro_batch) not in per_micro)
    extra = 0.0 if from_backwards else sum(per_micro.values()) / n_steps
    return extra, deferred / n_steps * (median(per_micro.values()) or 0.0)


def by_group(collectives, n_steps: int, shard_size: int, replicate_size: int) -> dict:
    """Per mesh dimension and collective kind, per optimizer step: what ran where.

    Returns:
        ``{"shard": {"size": S, "reduce_scatter": {...}, "all_gather": {...}},
        "replicate": {"size": R, "all_reduce": {...}}}`` (``replicate`` only under HSDP); each
        ``{...}`` holds ``calls_per_step``, ``bytes_per_step``, ``seconds_per_step`` (time the
        training thread spent in the calls: FSDP2 calls them synchronously on CPU, so all of it is
        exposed there; on CUDA they run on side streams and this is an upper bound of the exposed
        time), ``algbw_GBps`` and ``busbw_GBps`` (nccl-tests: ``(n - 1) / n`` for reduce-scatter and
        all-gather, ``2 (n - 1) / n`` for all-reduce, n the group's size).
    """
    def block(kind: str, n: int) -> dict:
        calls = [c for c in collectives if c.kind == kind]
        alg, bus = _bandwidths(calls, n)
        if kind == "all_reduce" and bus is not None:
            bus *= 2  # an all-reduce moves 2 (n - 1) / n of its buffer per process
        return {"calls_per_step": len(calls) / n_steps, "bytes_per_step": sum(c.bytes for c in calls) / n_steps,
                "seconds_per_step": sum(c.seconds for c in calls) / n_steps, "algbw_GBps": alg, "busbw_GBps": bus}

    out = {"shard": {"size": shard_size, "reduce_scatter": block("reduce_scatter", shard_size),
                     "all_gather": block("all_gather", shard_size)}}
    if replicate_size > 1:
        out["replicate"] = {"size": replicate_size, "all_reduce": block("all_reduce", replicate_size)}
    return out
