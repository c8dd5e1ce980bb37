"""The what-if planner: step time, speedup and communication share per K on a target cluster, from a measured profile.

Input: the ``comm`` block of a ``train_summary.json`` written by
``accum-kit train --profile_comm``, read by the one profile reader
(:func:`accum_kit.planning.measured_profile.load_profile`, whose docstring
defines every figure): ``c`` (forward + no-sync backward per micro-batch),
bytes per synchronised backward, the overlap fraction, ``o`` and the
measured bus bandwidth (used with ``--interconnect measured``).

Model, for n processes, bus bandwidth ``busbw`` (bytes/s) and K micro-batches per
optimizer step:

- ring all-reduce time ``t_ar = 2 (n - 1) / n x bytes / busbw``: the
  definition of bus bandwidth in nccl-tests, doc/PERFORMANCE.md
  (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md);
- exposed communication per sync ``e = t_ar x (1 - overlap)``;
- step time with no_sync (one all-reduce per step) ``K c + e + o``; without
  (``sync_each_batch``, one all-reduce per micro-batch) ``K (c + e) + o``.
  Both are the step-time model of :mod:`accum_kit.planning.step_time`
  (``K (c - a) + adds a + (1 - overlap) T + o``) with DDP's row of the cost
  table (:func:`accum_kit.engines.costs.ddp_costs`: syncs K or 1, T = syncs
  x t_ar; a DDP profile measures no separate ``a``, so ``K c``);
- speedup = the second over the first; communication share = exposed
  communication over step time (``e / (K c + e + o)`` with no_sync);
- the K that keeps no_sync's share at most ``s``: the smallest integer
  ``K >= (e (1 - s) / s - o) / c``, at least 1. Without no_sync the share
  ``K e / (K (c + e) + o)`` grows towards ``e / (c + e)``: accumulation alone
  does not lower it.

What the model leaves out: stragglers (every process is as fast as the
profiled main process); hierarchical all-reduce (NCCL's trees, or a two-level
intra-node / inter-node all-reduce: the whole ring runs at the one
``busbw``); compression hooks (fp16 / bf16 / PowerSGD change the bytes);
per-bucket latency and small-message effects (``t_ar`` is linear in bytes;
at small buckets the fixed cost per call dominates); and overlap that changes
with bandwidth (the profiled overlap fraction is applied to the target's
``t_ar``, although a faster link hides a larger share). The compute ``c``
and ``o`` are the profiled machine's: profile on the hardware you plan for.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .. import checks
from ..engines.bandwidth import GB  # noqa: F401 (re-exported)
from ..engines.bandwidth import all_reduce_seconds as ring_allreduce_seconds  # the one all-reduce formula, its old name here
from ..engines.costs import ddp_costs
from ..errors import UsageError
from .interconnects import INTERCONNECTS
from .measured_profile import (  # noqa: F401 (PROFILE_FIX, profile_number, settings_from_profile: re-exported)
    PROFILE_FIX,
    MeasuredProfile,
    load_profile,
    profile_number,
    settings_from_profile,
)
from .step_time import BusBandwidths, MeasuredCommunication, StepTime, step_time

DEFAULT_ACCUMULATION_STEPS = (1, 2, 4, 8, 16, 32)
DEFAULT_MAX_COMM_SHARE = 0.1
#: The keys of the comm block (:func:`accum_kit.profiler.report.local_summary`) the model reads.
COMM_KEYS = ("world_size", "optimizer_steps", "micro_batches", "allreduce_calls", "allreduce_bytes", "syncs",
             "seconds_per_sync", "overlap_fraction", "exposed_comm_seconds", "forward_seconds",
             "backward_seconds_no_sync", "optimizer_seconds", "seconds_per_step")
#: The two DDP policies the what-if compares, and the order of their columns.
MODES = ("no_sync", "sync_each_batch")


@dataclass(frozen=True)
class WhatIfRow:
    """Predictions for one K (seconds; shares in [0, 1])."""

    K: int
    no_sync_step_seconds: float  # K c + e + o
    sync_each_batch_step_seconds: float  # K (c + e) + o
    speedup: float  # sync_each_batch / no_sync
    comm_share_no_sync: float  # e / no_sync step
    comm_share_sync_each_batch: float  # K e / sync_each_batch step
    examples_per_second_no_sync: float | None  # B K n / no_sync step (None without a per-device batch)


def _row(steps: dict[str, StepTime], examples_per_micro_batch: int | None) -> "WhatIfRow":
    """A :class:`WhatIfRow` from the model's step of each mode (``MODES``)."""
    ns, se = steps["no_sync"], steps["sync_each_batch"]
    K = ns.accumulation_steps
    rate = examples_per_micro_batch * K / ns.seconds if examples_per_micro_batch else None
    return WhatIfRow(K=K, no_sync_step_seconds=ns.seconds, sync_each_batch_step_seconds=se.seconds,
                     speedup=se.seconds / ns.seconds, comm_share_no_sync=ns.exposed_seconds / ns.seconds,
                     comm_share_sync_each_batch=se.exposed_seconds / se.seconds, examples_per_second_no_sync=rate)


def predict(K: int, c: float, exposed: float, other: float, examples_per_micro_batch: int | None = None) -> WhatIfRow:
    """The model's row for one K from ``c``, exposed communication per sync ``e`` and per-step ``o`` (seconds).

    The step-time model (:func:`accum_kit.planning.step_time.step_time`) with DDP's syncs per window from the
    cost table (1 with no_sync, K with sync_each_batch) priced at ``e`` each: ``K c + e + o`` and
    ``K (c + e) + o``. ``examples_per_micro_batch`` is B x n over all processes (for the throughput column).
    """
    return _row({mode: step_time(ddp_costs(mode, world_size=1, accumulation_steps=K, gradient_bytes=0.0), c,
                                 MeasuredCommunication(exposed), other_seconds=other) for mode in MODES},
                examples_per_micro_batch)


def predict_from_profile(K: int, p: MeasuredProfile, num_processes: int, busbw_GBps: float,
                         examples_per_micro_batch: int | None = None) -> WhatIfRow:
    """The model's row for one K on ``num_processes`` at ``busbw_GBps``: DDP's rows of the cost table (the profile's
    bytes per sync, all-reduced over n), priced at the bus bandwidth, the profile's overlap hiding part of it."""
    link = BusBandwidths(replicate_GBps=busbw_GBps)
    return _row({mode: step_time(ddp_costs(mode, world_size=num_processes, accumulation_steps=K,
                                           gradient_bytes=p.bytes_per_sync), p.compute_seconds, link,
                                 overlap=p.overlap_fraction, other_seconds=p.other_seconds,
                                 accumulation_seconds=p.accumulation_seconds) for mode in MODES},
                examples_per_micro_batch)


def solve_k_for_comm_share(c: float, exposed: float, other: float, max_comm_share: float) -> int:
    """The smallest K >= 1 with ``e / (K c + e + o) <= max_comm_share`` (no_sync), from the closed form.

    ``K >= (e (1 - s) / s - o) / c`` (the model's no_sync share solved for K); the integer is then
    checked against the model's share itself (:func:`predict`) so that rounding never returns a K one off.
    """
    share = lambda k: predict(k, c, exposed, other).comm_share_no_sync  # noqa: E731
    bound = (exposed * (1 - max_comm_share) / max_comm_share - other) / c
    k = max(1, math.ceil(bound))
    while share(k) > max_comm_share:
        k += 1
    while k > 1 and share(k - 1) <= max_comm_share:
        k -= 1
    return k


@dataclass(frozen=True)
class WhatIfReport:
    """The what-if section of ``accum-kit plan``: inputs, target, derived times, one row per K, the solved K."""

    profile: MeasuredProfile
    num_machines: int
    num_processes: int
    interconnect: str
    busbw_GBps: float
    busbw_source: str
    allreduce_seconds: float  # t_ar per sync at the target
    exposed_comm_seconds: float  # e = t_ar (1 - overlap)
    max_comm_share: float
    k_for_max_comm_share: int
    rows: tuple[WhatIfRow, ...]
    arithmetic: dict  # the formulas with the numbers for one K (``shown_for_K``)
    notes: tuple[str, ...] = ()
    comparison: dict | None = None  # predicted vs a bench.json's measured, see accum_kit.planning.whatif_bench

    def to_dict(self) -> dict:
        """Plain JSON-ready dicts (what ``--json`` prints under ``whatif``)."""
        return asdict(self)


def check_whatif_flags(from_profile, num_machines, num_processes, interconnect, busbw_GBps, accumulation_steps,
                       max_comm_share, compare_bench, needs_profile: bool = True,
                       replicate_size: int | None = None) -> None:
    """Ranges and combinations of the target flags (values may be None: not given).

    Args:
        needs_profile: the plan section reading these flags predicts from a profile only (the what-if);
            False for one that uses them without (``--fsdp``'s, see :data:`accum_kit.planning.plan_report.SECTIONS`).
        replicate_size: HSDP's R when given: a shard group inside one machine may use NVLink.

    Raises:
        UsageError: naming the flag: a target flag without ``--from_profile`` (where ``needs_profile``),
            a non-positive count or bandwidth, ``--max_comm_share`` outside
            (0, 1), processes not a multiple of machines, NVLink across machines.
    """
    if from_profile is None and needs_profile:
        for flag, value in (("--num_machines", num_machines), ("--interconnect", interconnect),
                            ("--busbw_GBps", busbw_GBps), ("--compare_bench", compare_bench)):
            if value is not None:
                raise UsageError(flag, "only used by the what-if planner", "pass --from_profile train_summary.json too")
        return
    if num_machines is not None:
        checks.at_least("--num_machines", num_machines)
    if interconnect is not None:
        checks.one_of("--interconnect", interconnect, INTERCONNECTS)
    if busbw_GBps is not None:
        checks.positive("--busbw_GBps", busbw_GBps, fix="pass the bus bandwidth per link in GB/s, e.g. 50")
    if not accumulation_steps:
        raise UsageError("--accumulation_steps", "no value given", "pass one or more integers, e.g. 1 2 4 8 16 32")
    for k in accumulation_steps:
        checks.at_least("--accumulation_steps", k, fix="pass positive integers, e.g. 1 2 4 8 16 32")
    checks.positive("--max_comm_share", max_comm_share, fix="pass a fraction between 0 and 1, e.g. 0.1")
    if max_comm_share >= 1:
        raise UsageError("--max_comm_share", f"must be < 1 (got {max_comm_share})",
                         "pass a fraction between 0 and 1, e.g. 0.1")
    machines = num_machines or 1
    if num_processes is not None and num_processes % machines:
        raise UsageError("--num_processes", f"{num_processes} processes do not split evenly over {machines} machines",
                         "pass the total over all machines, a multiple of --num_machines")
    # with a replica per machine (or several) the shard group's ring stays inside a machine: NVLink is right there
    inside = replicate_size is not None and replicate_size % machines == 0
    if machines > 1 and interconnect == "nvlink" and busbw_GBps is None and not inside:
        raise UsageError("--interconnect", f"NVLink links GPUs within one machine; a ring over {machines} machines "
                         "runs at the network's speed", "use infiniband or ethernet, or pass --busbw_GBps")


def _g(x: float) -> str:
    return f"{x:.4g}"


def _arithmetic(p: MeasuredProfile, n: int, busbw: float, t_ar: float, e: float, row: WhatIfRow, s: float,
                k_star: int) -> dict:
    """The model's formulas with this plan's numbers, one string per quantity (for one K)."""
    K, c, o = row.K, p.compute_seconds, p.other_seconds
    return {
        "shown_for_K": K,
        "c": f"c = forward + no-sync backward = {_g(p.forward_seconds)} + {_g(p.backward_no_sync_seconds)} = {_g(c)} s",
        "o": f"o = step - K_p c - exposed_p = {_g(p.step_seconds)} - {p.gradient_accumulation_steps} x {_g(c)} - "
             f"{_g(p.exposed_comm_seconds)} = {_g(o)} s (at least the optimizer step, {_g(p.optimizer_seconds)} s)",
        "t_ar": f"t_ar = 2 (n-1)/n x bytes / busbw = 2 x {n - 1}/{n} x {p.bytes_per_sync:.6g} B / "
                f"{_g(busbw)} GB/s = {_g(t_ar)} s",
        "exposed": f"e = t_ar x (1 - overlap) = {_g(t_ar)} x (1 - {_g(p.overlap_fraction)}) = {_g(e)} s",
        "no_sync": f"no_sync = K c + e + o = {K} x {_g(c)} + {_g(e)} + {_g(o)} = {_g(row.no_sync_step_seconds)} s",
        "sync_each_batch": f"sync_each_batch = K (c + e) + o = {K} x ({_g(c)} + {_g(e)}) + {_g(o)} = "
                           f"{_g(row.sync_each_batch_step_seconds)} s",
        "speedup": f"speedup = {_g(row.sync_each_batch_step_seconds)} / {_g(row.no_sync_step_seconds)} = "
                   f"{_g(row.speedup)}",
        "comm_share": f"comm share (no_sync) = e / step = {_g(e)} / {_g(row.no_sync_step_seconds)} = "
                      f"{row.comm_share_no_sync:.1%}",
        "k_for_max_comm_share": f"K >= (e (1 - s)/s - o) / c = ({_g(e)} x {_g(1 - s)}/{_g(s)} - {_g(o)}) / {_g(c)} "
                                f"-> K = {k_star}",
    }


def make_whatif(from_profile: str, *, num_processes: int | None = None, num_machines: int | None = None,
                interconnect: str | None = None, busbw_GBps: float | None = None,
                accumulation_steps=DEFAULT_ACCUMULATION_STEPS, max_comm_share: float = DEFAULT_MAX_COMM_SHARE,
                per_device_train_batch_size: int | None = None, show_K: int | None = None) -> WhatIfReport:
    """The what-if report, from keywords named like the flags of ``accum-kit plan``.

    Args:
        from_profile: path of a ``train_summary.json`` with a ``comm`` block.
        num_processes: target processes over all machines (None: the profile's world size).
        num_machines: target machines (None: 1).
        interconnect: a key of :data:`INTERCONNECTS` (None: ``measured``) choosing the default busbw.
        busbw_GBps: bus bandwidth per link, GB/s; overrides the interconnect's figure.
        accumulation_steps: the K values to predict.
        max_comm_share: target communication share of a no_sync step, in (0, 1).
        per_device_train_batch_size: B, for the throughput column and a note if it differs from the profile's.
        show_K: the K whose arithmetic is spelled out (None: the largest listed K <= 8).

    ``comparison`` stays None: :func:`accum_kit.planning.whatif_bench.compare_with_bench`
    fills it (``--compare_bench``).

    Raises:
        UsageError: naming the flag (see :func:`check_whatif_flags` and :func:`load_profile`).
    """
    check_whatif_flags(from_profile, num_machines, num_processes, interconnect, busbw_GBps, accumulation_steps,
                       max_comm_share, None)
    p = load_profile(from_profile, "all_reduce")
    n, machines = num_processes or p.world_size, num_machines or 1
    name = interconnect or "measured"
    if busbw_GBps is not None:
        busbw, source = float(busbw_GBps), "--busbw_GBps"
    elif name == "measured":
        busbw, source = p.busbw_GBps, INTERCONNECTS["measured"][1]
    else:
        busbw, source = INTERCONNECTS[name]
    if busbw <= 0:
        raise UsageError("--interconnect", f"the profile's measured busbw is {busbw} GB/s",
                         "pass --busbw_GBps or another --interconnect")
    t_ar = ring_allreduce_seconds(p.bytes_per_sync, n, busbw)  # one sync, for the arithmetic
    e = t_ar * (1 - p.overlap_fraction)
    c, o = p.compute_seconds, p.other_seconds
    micro = per_device_train_batch_size * n if per_device_train_batch_size else None
    rows = tuple(predict_from_profile(k, p, n, busbw, micro) for k in sorted(set(accumulation_steps)))
    k_star = solve_k_for_comm_share(c, e, o, max_comm_share)
    ks = [r.K for r in rows]
    show = show_K if show_K is not None else max([k for k in ks if k <= 8] or ks[:1])
    arithmetic = _arithmetic(p, n, busbw, t_ar, e, predict_from_profile(show, p, n, busbw, micro), max_comm_share,
                             k_star)
    notes = []
    if n == 1:
        notes.append("1 target process: nothing to all-reduce; pass --num_processes (all machines)")
    if machines > 1 and name == "measured" and busbw_GBps is None:
        notes.append(f"the measured busbw comes from the profiled run; across {machines} machines the ring runs at "
                     "the network's speed: consider --interconnect infiniband/ethernet or --busbw_GBps")
    if per_device_train_batch_size and p.per_device_train_batch_size not in (None, per_device_train_batch_size):
        notes.append(f"c was measured at --per_device_train_batch_size {p.per_device_train_batch_size}, not "
                     f"{per_device_train_batch_size}: profile at the micro-batch you plan for")
    if name != "measured" or busbw_GBps is not None:
        notes.append("c, o and the overlap are the profiled machine's; only the all-reduce time is rescaled")
    return WhatIfReport(profile=p, num_machines=machines, num_processes=n, interconnect=name, busbw_GBps=busbw,
                        busbw_source=source, allreduce_seconds=t_ar, exposed_comm_seconds=e,
                        max_comm_share=max_comm_share, k_for_max_comm_share=k_star, rows=rows,
                        arithmetic=arithmetic, notes=tuple(notes))


def format_whatif(r: WhatIfReport) -> list[str]:
    """Text lines of the what-if section: inputs, target, one table row per K, the solved K, the arithmetic."""
    from tabulate import tabulate

    p, a = r.profile, r.arithmetic
    lines = [
        "", f"What-if (model fed by {p.path}: {p.world_size} processes, K_p = {p.gradient_accumulation_steps})",
        f"  measured: c = {_g(p.compute_seconds)} s per micro-batch, {p.bytes_per_sync:.6g} B per sync, "
        f"all-reduce {_g(p.seconds_per_sync)} s per sync at busbw {_g(p.busbw_GBps)} GB/s, "
        f"overlap {p.overlap_fraction:.1%}, o = {_g(p.other_seconds)} s per step",
        f"  target: {r.num_processes} processes on {r.num_machines} machine(s), {r.interconnect} busbw "
        f"{_g(r.busbw_GBps)} GB/s ({r.busbw_source})",
        f"  t_ar = {_g(r.allreduce_seconds)} s per sync, exposed e = {_g(r.exposed_comm_seconds)} s",
    ]
    table = [(w.K, _g(w.no_sync_step_seconds), _g(w.sync_each_batch_step_seconds), f"{w.speedup:.3f}x",
              f"{w.comm_share_no_sync:.1%}", f"{w.comm_share_sync_each_batch:.1%}",
              _g(w.examples_per_second_no_sync) if w.examples_per_second_no_sync else "n/a") for w in r.rows]
    headers = ("K", "no_sync s/step", "sync_each_batch s/step", "speedup", "comm share no_sync",
               "comm share sync_each", "examples/s no_sync")
    lines.append("\n".join(f"  {line}" for line in tabulate(table, headers=headers, tablefmt="simple",
                                                           disable_numparse=True).splitlines()))
    lines.append(f"  K for comm share <= {r.max_comm_share:.0%} (no_sync): --gradient_accumulation_steps "
                 f"{r.k_for_max_comm_share}; without no_sync the share tends to e / (c + e) = "
                 f"{r.exposed_comm_seconds / (p.compute_seconds + r.exposed_comm_seconds):.1%} whatever K")
    lines.append(f"  arithmetic (K = {a['shown_for_K']}):")
    lines += [f"    {a[key]}" for key in ("c", "o", "t_ar", "exposed", "no_sync", "sync_each_batch", "speedup",
                                           "comm_share", "k_for_max_comm_share")]
    lines += [f"  note: {n}" for n in r.notes]
    lines.append("  left out: stragglers, hierarchical all-reduce (NCCL trees, intra/inter-node levels), "
                 "compression hooks, per-bucket latency, overlap changing with bandwidth")
    return lines
