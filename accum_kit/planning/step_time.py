"""The one step-time model: seconds of one optimizer step (one window of K micro-batches), every engine (torch-free).

Per window, in seconds::

    step = K (c - a) + adds x a  +  (1 - overlap) x T  +  o
           \\____ compute ____/     \\_ exposed comm _/

- ``K``: micro-batches per window, per process (a measured mean may be fractional);
- ``c``: compute per micro-batch, seconds: forward + backward without its communication, as
  measured on micro-batches that add into a held gradient (the no-sync micro-batches a profile
  or the bench times);
- ``a``: accumulation per micro-batch, seconds: the part of ``c`` spent adding a backward's
  gradient into the whole gradient held since the window's first micro-batch (FSDP2's
  ``unsharded_param.grad``, DDP's ``.grad``); 0 when it was not measured, and ``c`` then stands
  for every micro-batch;
- ``adds``: micro-batches per window that make that add, from the cost table
  (:attr:`accum_kit.engines.costs.PolicyCosts.held_gradient_adds`): ``K - 1`` where the window holds
  the whole gradient (every DDP policy, the ``no_sync`` policies, ZeRO-1), 0 where every micro-batch
  reduces it to a shard (sharded ``sync_each_batch``, ``reduce_scatter_each_batch``, ZeRO-2/3);
- ``T``: seconds of the window's collectives. Calls and bytes come from the one cost table,
  :func:`accum_kit.engines.costs.policy_costs` (per engine, policy and R x S mesh), and each
  collective of S bytes over n processes takes ``S x busbw_factor(kind, n) / busbw``
  (:func:`accum_kit.engines.costs.collective_seconds`; ``2 (n - 1) / n`` for an all-reduce,
  ``(n - 1) / n`` for an all-gather or a reduce-scatter: the bus bandwidth of nccl-tests,
  https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), at the bus bandwidth
  (bytes/s = GB/s x 1e9) of the group's link (:class:`BusBandwidths`). Where a measurement gives
  the seconds of one synchronised backward's reduction directly (the bench, the profiler),
  ``T = syncs x seconds_per_sync`` plus what the window measured besides
  (:class:`MeasuredCommunication`), with ``syncs`` from the same table;
- ``overlap``: the fraction of ``T`` hidden under backward compute, in [0, 1]. 0 counts every
  collective exposed, which is what CPU (gloo) runs show (FSDP2's collectives block the
  training thread); the what-if planner applies a DDP profile's measured fraction;
- ``o``: per-step time besides micro-batches and communication (optimizer step, zeroing,
  fetching batches), seconds.

Assumptions (what the model leaves out): one overlap fraction for every collective of the
window; time linear in bytes (no per-call latency, no small-message effects); a ring at one
bus bandwidth per group (no NCCL trees or two-level algorithms); every process as fast as the
measured one (no stragglers); ``c``, ``a`` and ``o`` transfer unchanged to the planned run
(same hardware and micro-batch). ``a`` is the whole gradient's add only: the add of a shard
into a held shard (1/S of it, ``sync_each_batch`` and ``reduce_scatter_each_batch`` under
sharding) is left in ``c``.

Who calls it: the what-if planner (:mod:`accum_kit.planning.whatif`), ``plan --fsdp``
(:mod:`accum_kit.planning.fsdp_plan`) and its engine comparison
(:mod:`accum_kit.planning.topology`), the FSDP2 bench comparison
(:mod:`accum_kit.planning.fsdp_compare`), the bench's ideals (DDP's and FSDP2's, :mod:`accum_kit.bench.report_ddp`, :mod:`accum_kit.bench.report_fsdp2`)
and the profiler's ideal step (:mod:`accum_kit.profiler.sharded`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engines.costs import PolicyCosts, comm_seconds


@dataclass(frozen=True)
class StepTime:
    """One optimizer step by part (seconds): ``seconds = compute_seconds + exposed_seconds + other_seconds``.

    Attributes:
        accumulation_steps: K.
        compute_seconds: ``K (c - a) + adds x a``.
        communication_seconds: T, the window's collectives on the wire.
        exposed_seconds: ``(1 - overlap) T``, the part of T the step waits for.
        other_seconds: o.
        seconds: the step.
    """

    accumulation_steps: float
    compute_seconds: float
    communication_seconds: float
    exposed_seconds: float
    other_seconds: float
    seconds: float


def _check(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number (got {value!r})")


def window_seconds(accumulation_steps: float, compute_seconds: float, *, communication_seconds: float = 0.0,
                   overlap: float = 0.0, other_seconds: float = 0.0, accumulation_seconds: float = 0.0,
                   held_adds: float = 0) -> StepTime:
    """The model of the module docstring from its terms: ``K (c - a) + adds a + (1 - overlap) T + o``.

    Args:
        accumulation_steps: K, micro-batches per window (a measured mean may be fractional; 0: an empty window).
        compute_seconds: c, seconds per micro-batch.
        communication_seconds: T, seconds of the window's collectives.
        overlap: share of T hidden under backward compute, in [0, 1].
        other_seconds: o, seconds per step.
        accumulation_seconds: a, seconds per add into a held whole gradient (part of c).
        held_adds: adds per window (the cost table's ``held_gradient_adds``), in [0, K].

    The seconds are taken as given (a measured difference of medians may come out slightly negative); only
    the structure is checked.

    Raises:
        ValueError: a term that is not a finite number, K < 0, overlap outside [0, 1], or adds outside [0, K].
    """
    for name, value in (("K", accumulation_steps), ("c", compute_seconds), ("T", communication_seconds),
                        ("overlap", overlap), ("o", other_seconds), ("a", accumulation_seconds),
                        ("adds", held_adds)):
        _check(name, value)
    if accumulation_steps < 0:
        raise ValueError(f"K must be >= 0 micro-batches per window (got {accumulation_steps})")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1] (got {overlap})")
    if not 0 <= held_adds <= accumulation_steps:
        raise ValueError(f"adds must be in [0, K = {accumulation_steps}] (got {held_adds})")
    compute = accumulation_steps * (compute_seconds - accumulation_seconds) + held_adds * accumulation_seconds
    exposed = communication_seconds * (1 - overlap)
    return StepTime(accumulation_steps=accumulation_steps, compute_seconds=compute,
                    communication_seconds=communication_seconds, exposed_seconds=exposed,
                    other_seconds=other_seconds, seconds=compute + exposed + other_seconds)


@dataclass(frozen=True)
class BusBandwidths:
    """Prices the cost table's collectives from bus bandwidth, GB/s (1e9 bytes/s) per group's link.

    Attributes:
        shard_GBps: the shard group's reduce-scatters (and all-gathers unless ``all_gather_GBps``).
        all_gather_GBps: the all-gathers, when measured apart (None: ``shard_GBps``).
        replicate_GBps: the all-reduces (DDP over W, HSDP across replicas, ZeRO over W); None: ``shard_GBps``.
    """

    shard_GBps: float | None = None
    all_gather_GBps: float | None = None
    replicate_GBps: float | None = None

    def seconds(self, costs: PolicyCosts) -> dict:
        """``{"reduce_scatter", "all_gather", "all_reduce", "total"}`` seconds per window
        (:func:`accum_kit.engines.costs.comm_seconds`).

        Raises:
            ValueError: bytes to send in a group with no bandwidth given.
        """
        return comm_seconds(costs, shard_GBps=self.shard_GBps, all_gather_GBps=self.all_gather_GBps,
                            replicate_GBps=self.replicate_GBps)


@dataclass(frozen=True)
class MeasuredCommunication:
    """Prices the table's synchronised backwards from a measurement, seconds.

    Attributes:
        seconds_per_sync: one synchronised backward's reduction (e.g. the bench's exposed all-reduce
            per sync), times the table's ``syncs``.
        seconds_per_window: communication measured per window that ``syncs`` do not count (e.g. the
            exposed all-gathers of an FSDP2 window).
    """

    seconds_per_sync: float
    seconds_per_window: float = 0.0

    def seconds(self, costs: PolicyCosts) -> dict:
        """``{"syncs": syncs x seconds_per_sync, "measured": seconds_per_window, "total"}`` seconds per window."""
        synced = costs.syncs * self.seconds_per_sync
        return {"syncs": synced, "measured": self.seconds_per_window, "total": synced + self.seconds_per_window}


#: forward / (forward + backward) of a micro-batch's compute: backward costs two forwards (Kaplan et al. 2020,
#: "Scaling Laws for Neural Language Models": C = 6N per token, 2N of it forward)
FORWARD_SHARE = 1 / 3


def recompute_factor(costs: PolicyCosts, forward_share: float = FORWARD_SHARE) -> float:
    """``1 + recompute_forward_fraction x forward_share``: what activation checkpointing multiplies ``c`` by.

    ``recompute_forward_fraction`` is the cost table's (:func:`accum_kit.engines.costs.policy_costs` with
    ``activation_checkpointing=True``: the blocks' share of one forward; 0 without checkpointing, factor 1).
    ``c`` must then be measured without checkpointing.
    """
    return 1 + costs.recompute_forward_fraction * forward_share


def step_time(costs: PolicyCosts, compute_seconds: float, pricing: BusBandwidths | MeasuredCommunication, *,
              overlap: float = 0.0, other_seconds: float = 0.0, accumulation_seconds: float = 0.0) -> StepTime:
    """One step of the policy, engine and mesh that ``costs`` prices (:func:`accum_kit.engines.costs.policy_costs`).

    K and the adds come from ``costs``; T from ``pricing``; ``c`` times :func:`recompute_factor` (1 unless the
    costs are activation checkpointing's); the rest as :func:`window_seconds`.

    Raises:
        ValueError: as :func:`window_seconds` and :meth:`BusBandwidths.seconds`.
    """
    compute_seconds = compute_seconds * recompute_factor(costs)
    return window_seconds(costs.accumulation_steps, compute_seconds,
                          communication_seconds=pricing.seconds(costs)["total"], overlap=overlap,
                          other_seconds=other_seconds, accumulation_seconds=accumulation_seconds,
                          held_adds=costs.held_gradient_adds)
