"""The what-if planner: step time, speedup and communication share per K on a target cluster, from a measured profile.

Input: the ``comm`` block of a ``train_summary.json`` written by
``accum-kit train --profile_comm`` (see
:func:`accum_kit.profiler.report.local_summary` for its keys). From it
(the main process's values; per micro-batch and per step are medians):

- ``c`` = ``forward_seconds`` + ``backward_seconds_no_sync``: compute per
  micro-batch, seconds;
- ``bytes`` = ``allreduce_bytes`` / ``syncs``: gradient bytes all-reduced per
  synchronised backward;
- ``overlap`` = ``overlap_fraction``: the share of the all-reduce hidden behind
  the backward computation;
- ``o`` = ``seconds_per_step`` - (K_p c + exposed_p): per-step time that is
  neither micro-batch compute nor exposed communication (optimizer step,
  zeroing, batch fetching), at least ``optimizer_seconds``; K_p is the
  profiled run's K (``micro_batches`` / ``optimizer_steps``);
- the measured bus bandwidth ``bytes / seconds_per_sync x 2 (n_p - 1) / n_p``
  (used with ``--interconnect measured``). The comm block's own ``busbw_GBps``
  divides by the mean time per sync; the median used here is the one its
  overlap fraction refers to, so that at the profiled n the model gives back
  the measured exposed time.

Model, for n processes, bus bandwidth ``busbw`` (bytes/s) and K micro-batches per
optimizer step:

- ring all-reduce time ``t_ar = 2 (n - 1) / n x bytes / busbw``: the
  definition of bus bandwidth in nccl-tests, doc/PERFORMANCE.md
  (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md);
- exposed communication per sync ``e = t_ar x (1 - overlap)``;
- step time with no_sync (one all-reduce per step) ``K c + e + o``; without
  (``sync_each_batch``, one all-reduce per micro-batch) ``K (c + e) + o``;
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
from ..errors import UsageError
from .ddp_costs import syncs_per_window
from ..engines.costs import all_reduce_seconds as ring_allreduce_seconds  # the cost table's all-reduce, under its old name here

GB = 1e9

#: ``--interconnect`` name -> (nominal bus bandwidth per link, GB/s per direction; its public source).
#: Nominal peaks: the bus bandwidth an all-reduce reaches is lower (measure it with nccl-tests'
#: ``all_reduce_perf``, or profile on the target and use ``measured``).
INTERCONNECTS = {
    "nvlink": (450.0, "NVIDIA H100 SXM, fourth-generation NVLink: 900 GB/s total per GPU, i.e. 450 GB/s each "
                      "way (https://www.nvidia.com/en-us/data-center/nvlink/); within one machine only"),
    "infiniband": (50.0, "InfiniBand NDR: 400 Gb/s = 50 GB/s per port each way, one port per GPU "
                         "(https://www.nvidia.com/en-us/networking/infiniband/connectx-7/)"),
    "ethernet": (12.5, "100 Gigabit Ethernet (IEEE 802.3): 100 Gb/s = 12.5 GB/s per port each way"),
    "measured": (None, "the profile's: bytes per sync / seconds_per_sync x 2 (n - 1) / n, nccl-tests' definition"),
}
DEFAULT_ACCUMULATION_STEPS = (1, 2, 4, 8, 16, 32)
DEFAULT_MAX_COMM_SHARE = 0.1
#: The keys of the comm block (:func:`accum_kit.profiler.report.local_summary`) the model reads.
COMM_KEYS = ("world_size", "optimizer_steps", "micro_batches", "allreduce_calls", "allreduce_bytes", "syncs",
             "seconds_per_sync", "overlap_fraction", "exposed_comm_seconds", "forward_seconds",
             "backward_seconds_no_sync", "optimizer_seconds", "seconds_per_step")
PROFILE_FIX = "pass the train_summary.json of `accum-kit train --profile_comm` on 2 or more processes"


@dataclass(frozen=True)
class MeasuredProfile:
    """The profile's figures the model needs (seconds, bytes, GB/s); see the module docstring."""

    path: str
    world_size: int
    gradient_accumulation_steps: int  # K_p of the profiled run
    per_device_train_batch_size: int | None
    model: str | None
    forward_seconds: float
    backward_no_sync_seconds: float
    compute_seconds: float  # c
    bytes_per_sync: float
    seconds_per_sync: float
    busbw_GBps: float  # bytes_per_sync / seconds_per_sync x 2 (n - 1) / n, GB/s
    overlap_fraction: float
    exposed_comm_seconds: float
    optimizer_seconds: float
    step_seconds: float
    other_seconds: float  # o: per-step time besides K_p c + exposed, at least optimizer_seconds


def profile_number(comm: dict, key: str, path: str, fix: str = PROFILE_FIX) -> float:
    """``comm[key]`` of the profile at ``path`` as a finite float.

    Raises:
        UsageError (``--from_profile``): the key is missing or not a finite number; ``fix`` says what to pass.
    """
    value = comm.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError("--from_profile", f"{path}: the comm block has no number under {key!r} (got {value!r})", fix)
    return float(value)


def load_profile(path: str) -> MeasuredProfile:
    """Read the figures of :class:`MeasuredProfile` from a ``train_summary.json``.

    Raises:
        UsageError (``--from_profile``): a missing or unreadable file, no ``comm``
            block (rerun with ``--profile_comm``), a 1-process profile or one
            without an all-reduce, or no no-sync micro-batch (K of 1 or
            ``--sync_each_batch``), so that c or the overlap cannot be measured.
    """
    summary = checks.json_file("--from_profile", path, PROFILE_FIX)
    comm = summary.get("comm") if isinstance(summary, dict) else None
    if not isinstance(comm, dict):
        raise UsageError("--from_profile", f"{path} has no comm block",
                         "rerun `accum-kit train` with --profile_comm and pass its train_summary.json")
    n = int(profile_number(comm, "world_size", path))
    if n < 2 or not comm.get("allreduce_calls") or not comm.get("syncs"):
        raise UsageError("--from_profile", f"{path} is a {n}-process profile with no all-reduce measured",
                         "profile on 2 or more processes, e.g. accelerate launch --config_file "
                         "accelerate_configs/cpu_ddp.yaml -m accum_kit train --profile_comm ...")
    if comm.get("backward_seconds_no_sync") is None or comm.get("overlap_fraction") is None:
        raise UsageError("--from_profile", f"{path} has no no-sync micro-batch, so neither the compute per "
                         "micro-batch nor the overlap was measured",
                         "profile with --gradient_accumulation_steps 2 or more and without --sync_each_batch")
    fwd, bwd = profile_number(comm, "forward_seconds", path), profile_number(comm, "backward_seconds_no_sync", path)
    steps = profile_number(comm, "optimizer_steps", path)
    k_p = round(profile_number(comm, "micro_batches", path) / steps) if steps else 0
    if k_p < 1:
        raise UsageError("--from_profile", f"{path} records no optimizer step", PROFILE_FIX)
    c = fwd + bwd
    if c <= 0:
        raise UsageError("--from_profile", f"{path}: compute per micro-batch is {c} s", PROFILE_FIX)
    exposed, opt = profile_number(comm, "exposed_comm_seconds", path), profile_number(comm, "optimizer_seconds", path)
    step = profile_number(comm, "seconds_per_step", path)
    bytes_per_sync = profile_number(comm, "allreduce_bytes", path) / profile_number(comm, "syncs", path)
    per_sync = profile_number(comm, "seconds_per_sync", path)
    if per_sync <= 0:
        raise UsageError("--from_profile", f"{path}: the all-reduce took {per_sync} s per sync", PROFILE_FIX)
    return MeasuredProfile(
        path=str(path), world_size=n, gradient_accumulation_steps=k_p,
        per_device_train_batch_size=summary.get("per_device_train_batch_size"), model=summary.get("model"),
        forward_seconds=fwd, backward_no_sync_seconds=bwd, compute_seconds=c,
        bytes_per_sync=bytes_per_sync,
        seconds_per_sync=per_sync, busbw_GBps=bytes_per_sync / per_sync * 2 * (n - 1) / n / GB,
        overlap_fraction=profile_number(comm, "overlap_fraction", path), exposed_comm_seconds=exposed,
        optimizer_seconds=opt, step_seconds=step,
        # Medians of different things need not add up: never below the optimizer step itself.
        other_seconds=max(step - k_p * c - exposed, opt),
    )


def settings_from_profile(path: str, per_device_train_batch_size: int | None,
                          gradient_accumulation_steps: int | None, take_k: bool = True):
    """The profiled run's batch size and K where the flags leave them unset: a flag given on the command line wins.

    Args:
        path: a ``train_summary.json`` (its top-level ``per_device_train_batch_size``
            and ``gradient_accumulation_steps``; under an accumulation schedule, K at step 0).
        per_device_train_batch_size, gradient_accumulation_steps: the flags' values (None: not given).
        take_k: False when K is decided otherwise (``--target_batch_size``, ``--accumulation_schedule``).

    Returns:
        ``(B, K, note)``: K stays None when not taken; ``note`` says what came from the profile, or None.

    Raises:
        UsageError: the file is unreadable (``--from_profile``), or does not record a
            value the flags left unset (names that flag).
    """
    summary = checks.json_file("--from_profile", path, PROFILE_FIX)
    summary = summary if isinstance(summary, dict) else {}
    taken = []

    def recorded(key: str) -> int:
        value = summary.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"--{key}", f"not given, and {path} records no usable value (got {value!r})",
                             f"pass --{key}")
        taken.append(f"--{key} {value}")
        return value

    if per_device_train_batch_size is None:
        per_device_train_batch_size = recorded("per_device_train_batch_size")
    if gradient_accumulation_steps is None and take_k:
        gradient_accumulation_steps = recorded("gradient_accumulation_steps")
    note = f"{' and '.join(taken)} from {path} (a flag on the command line overrides)" if taken else None
    return per_device_train_batch_size, gradient_accumulation_steps, note


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


def predict(K: int, c: float, exposed: float, other: float, examples_per_micro_batch: int | None = None) -> WhatIfRow:
    """The model's row for one K from ``c``, exposed communication per sync ``e`` and per-step ``o`` (seconds).

    ``examples_per_micro_batch`` is B x n over all processes (for the throughput column).
    """
    # syncs per window from the cost table (planning.ddp_costs): 1 with no_sync, K with sync_each_batch
    e_ns, e_se = (syncs_per_window(policy, K) * exposed for policy in ("no_sync", "sync_each_batch"))
    ns = K * c + e_ns + other
    se = K * c + e_se + other
    rate = examples_per_micro_batch * K / ns if examples_per_micro_batch else None
    return WhatIfRow(K=K, no_sync_step_seconds=ns, sync_each_batch_step_seconds=se, speedup=se / ns,
                     comm_share_no_sync=e_ns / ns, comm_share_sync_each_batch=e_se / se,
                     examples_per_second_no_sync=rate)


def solve_k_for_comm_share(c: float, exposed: float, other: float, max_comm_share: float) -> int:
    """The smallest K >= 1 with ``e / (K c + e + o) <= max_comm_share`` (no_sync), from the closed form.

    ``K >= (e (1 - s) / s - o) / c``; the integer is then checked against the
    share itself so that rounding never returns a K one off.
    """
    share = lambda k: exposed / (k * c + exposed + other)  # noqa: E731
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
                       max_comm_share, compare_bench, fsdp: bool = False, replicate_size: int | None = None) -> None:
    """Ranges and combinations of the what-if flags (values may be None: not given).

    Raises:
        UsageError: naming the flag: a what-if flag without ``--from_profile`` (``fsdp``: allowed),
            a non-positive count or bandwidth, ``--max_comm_share`` outside
            (0, 1), processes not a multiple of machines, NVLink across machines.
    """
    if from_profile is None and not fsdp:  # --fsdp plans use them without a profile
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
    # under HSDP with one replica per machine the shard group's ring stays inside a machine: NVLink is right there
    inside = fsdp and replicate_size is not None and replicate_size % machines == 0
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
    p = load_profile(from_profile)
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
    t_ar = ring_allreduce_seconds(p.bytes_per_sync, n, busbw)
    e = t_ar * (1 - p.overlap_fraction)
    c, o = p.compute_seconds, p.other_seconds
    micro = per_device_train_batch_size * n if per_device_train_batch_size else None
    rows = tuple(predict(k, c, e, o, micro) for k in sorted(set(accumulation_steps)))
    k_star = solve_k_for_comm_share(c, e, o, max_comm_share)
    ks = [r.K for r in rows]
    show = show_K if show_K is not None else max([k for k in ks if k <= 8] or ks[:1])
    arithmetic = _arithmetic(p, n, busbw, t_ar, e, predict(show, c, e, o, micro), max_comm_share, k_star)
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
