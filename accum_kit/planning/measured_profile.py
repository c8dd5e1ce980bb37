"""The one reader of a profile: the ``train_summary.json`` of ``accum-kit train --profile_comm`` (torch-free).

``plan --from_profile`` (the what-if planner, DDP), ``plan --fsdp --from_profile`` (FSDP2 and
HSDP) and ``plan``'s defaults for the per-device batch size, K and the process count all read
the file here. The ``comm`` block (written by :func:`accum_kit.profiler.report.local_summary`,
and under FSDP2 :func:`accum_kit.profiler.sharded.sharded_summary`; the main process's values,
medians per micro-batch and per step) becomes one :class:`MeasuredProfile`: the inputs of the
step-time model (:mod:`accum_kit.planning.step_time`) and the bus bandwidths measured.

What the profile recorded decides how it is read (:data:`READERS`): gradients all-reduced
(DDP: ``allreduce_calls``) or reduce-scattered (FSDP2 / HSDP: ``reduce_scatter_calls``).

- all-reduced: ``c`` = ``forward_seconds`` + ``backward_seconds_no_sync``; bytes per sync =
  ``allreduce_bytes`` / ``syncs``; the measured bus bandwidth = bytes per sync /
  ``seconds_per_sync`` x 2 (n - 1) / n (:func:`accum_kit.engines.costs.bus_bandwidth`; the comm
  block's own ``busbw_GBps`` divides by the mean time per sync, while its overlap fraction refers to
  the median used here, so that at the profiled n the model gives back the measured exposed time);
  exposed per step = the exposed all-reduce of the window's one sync;
- reduce-scattered: ``c`` = ``compute_seconds``, ``a`` = ``accumulation_seconds``; the
  reduce-scatter's bus bandwidth is effective: bytes per sync x (n - 1) / n over its exposed time
  per sync (under HSDP the all-reduce across replicas taken out of it first; n the shard group);
  the all-gather's is the block's ``all_gather_busbw_GBps``; the all-reduce's across replicas the
  block's ``by_group`` figure.

For both, ``o`` = step - (the model's window of the profiled no_sync run without ``o``:
``K_p (c - a) + (K_p - 1) a`` + its exposed communication per step), at least ``optimizer_seconds``
(medians of different things need not add up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import checks
from ..engines.bandwidth import GB, bus_bandwidth
from ..errors import UsageError
from .step_time import window_seconds

#: What to pass, by what the plan needs: a DDP profile (the what-if planner) or a sharded one (``--fsdp``).
PROFILE_FIX = "pass the train_summary.json of `accum-kit train --profile_comm` on 2 or more processes"
SHARDED_PROFILE_FIX = ("pass the train_summary.json of `accelerate launch --config_file "
                       "accelerate_configs/cpu_fsdp.yaml -m accum_kit train --profile_comm ...` (2+ processes, "
                       "K >= 2, no_sync)")
FIXES = {"all_reduce": PROFILE_FIX, "sharded": SHARDED_PROFILE_FIX}


@dataclass(frozen=True)
class MeasuredProfile:
    """A profile's figures (seconds per micro-batch or per step, bytes, GB/s), see the module docstring.

    Common: ``world_size`` (n_p), ``gradient_accumulation_steps`` (K_p), ``compute_seconds`` (c),
    ``accumulation_seconds`` (a; 0 when not measured), ``exposed_comm_seconds_per_step``,
    ``optimizer_seconds``, ``step_seconds``, ``other_seconds`` (o). ``collectives`` says which kind of
    profile it is: ``all_reduce`` (DDP; the fields from ``forward_seconds`` to ``exposed_comm_seconds``
    are set) or ``sharded`` (FSDP2 / HSDP; the fields from ``exposed_reduce_scatter_seconds`` on).
    """

    path: str
    collectives: str
    world_size: int
    gradient_accumulation_steps: int
    compute_seconds: float
    optimizer_seconds: float
    step_seconds: float
    other_seconds: float
    exposed_comm_seconds_per_step: float
    per_device_train_batch_size: int | None = None
    model: str | None = None
    block_size: int | None = None
    policy: str | None = None
    accumulation_seconds: float = 0.0
    overlap_fraction: float | None = None
    # all-reduced gradients (DDP)
    forward_seconds: float | None = None
    backward_no_sync_seconds: float | None = None
    bytes_per_sync: float | None = None
    seconds_per_sync: float | None = None
    busbw_GBps: float | None = None  # bytes_per_sync / seconds_per_sync x 2 (n - 1) / n, GB/s
    exposed_comm_seconds: float | None = None  # per sync
    # reduce-scattered gradients (FSDP2, HSDP)
    exposed_reduce_scatter_seconds: float | None = None  # per sync
    reduce_scatter_bytes_per_sync: float | None = None
    reduce_scatter_busbw_GBps: float | None = None  # effective: S (n-1)/n / exposed per sync
    all_gather_busbw_GBps: float | None = None
    units: tuple = ()
    replicate_size: int = 1  # HSDP's R (1: plain FSDP2 or DDP)
    all_reduce_busbw_GBps: float | None = None  # HSDP: measured across replicas


def profile_number(comm: dict, key: str, path: str, fix: str = PROFILE_FIX) -> float:
    """``comm[key]`` of the profile at ``path`` as a finite float.

    Raises:
        UsageError (``--from_profile``): the key is missing or not a finite number; ``fix`` says what to pass.
    """
    value = comm.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError("--from_profile", f"{path}: the comm block has no number under {key!r} (got {value!r})", fix)
    return float(value)


def read_summary(path: str, fix: str = PROFILE_FIX) -> dict:
    """The summary at ``path`` as a dict ({} when the JSON is not an object).

    Raises:
        UsageError (``--from_profile``): a missing or unreadable file.
    """
    summary = checks.json_file("--from_profile", path, fix)
    return summary if isinstance(summary, dict) else {}


def _steps(comm: dict, path: str, fix: str) -> int:
    steps = profile_number(comm, "optimizer_steps", path, fix)
    return round(profile_number(comm, "micro_batches", path, fix) / steps) if steps else 0


def _all_reduced(comm: dict, path: str) -> dict:
    """The DDP fields (see the module docstring)."""
    fix = PROFILE_FIX
    n = int(profile_number(comm, "world_size", path, fix))
    if n < 2 or not comm.get("allreduce_calls") or not comm.get("syncs"):
        raise UsageError("--from_profile", f"{path} is a {n}-process profile with no all-reduce measured",
                         "profile on 2 or more processes, e.g. accelerate launch --config_file "
                         "accelerate_configs/cpu_ddp.yaml -m accum_kit train --profile_comm ...")
    if comm.get("backward_seconds_no_sync") is None or comm.get("overlap_fraction") is None:
        raise UsageError("--from_profile", f"{path} has no no-sync micro-batch, so neither the compute per "
                         "micro-batch nor the overlap was measured",
                         "profile with --gradient_accumulation_steps 2 or more and without --sync_each_batch")
    fwd, bwd = profile_number(comm, "forward_seconds", path), profile_number(comm, "backward_seconds_no_sync", path)
    k_p = _steps(comm, path, fix)
    if k_p < 1:
        raise UsageError("--from_profile", f"{path} records no optimizer step", fix)
    c = fwd + bwd
    if c <= 0:
        raise UsageError("--from_profile", f"{path}: compute per micro-batch is {c} s", fix)
    exposed = profile_number(comm, "exposed_comm_seconds", path)
    bytes_per_sync = profile_number(comm, "allreduce_bytes", path) / profile_number(comm, "syncs", path)
    per_sync = profile_number(comm, "seconds_per_sync", path)
    if per_sync <= 0:
        raise UsageError("--from_profile", f"{path}: the all-reduce took {per_sync} s per sync", fix)
    return dict(world_size=n, gradient_accumulation_steps=k_p, compute_seconds=c, forward_seconds=fwd,
                backward_no_sync_seconds=bwd, bytes_per_sync=bytes_per_sync, seconds_per_sync=per_sync,
                busbw_GBps=bus_bandwidth(bytes_per_sync / per_sync / GB, "all_reduce", n),
                overlap_fraction=profile_number(comm, "overlap_fraction", path), exposed_comm_seconds=exposed,
                exposed_comm_seconds_per_step=exposed)  # a no_sync window synchronises once


def _reduce_scattered(comm: dict, path: str) -> dict:
    """The FSDP2 / HSDP fields (see the module docstring)."""
    fix = SHARDED_PROFILE_FIX
    if comm.get("backward_seconds_no_sync") is None:
        raise UsageError("--from_profile", f"{path} has no no-sync micro-batch, so the reduce-scatter's exposed "
                         "time was not measured", "profile with --gradient_accumulation_steps 2 or more and "
                         "--accumulation_policy no_sync")
    world = int(profile_number(comm, "world_size", path, fix))
    replicas = int((comm.get("mesh") or {}).get("dp_replicate_size") or 1)
    n = world // replicas  # the reduce-scatter's group: the shard group
    k_p = _steps(comm, path, fix)
    c = profile_number(comm, "compute_seconds", path, fix)
    if k_p < 1 or c <= 0:
        raise UsageError("--from_profile", f"{path} records no optimizer step or no compute", fix)
    exposed = profile_number(comm, "exposed_comm_seconds", path, fix)
    syncs = max(profile_number(comm, "syncs", path, fix), 1)
    ar_busbw = None
    if replicas > 1:  # the exposed time per sync holds the all-reduce across replicas too: take it out
        exposed = max(exposed - float(comm.get("all_reduce_seconds") or 0.0) / syncs, 0.0)
        ar_busbw = (comm.get("by_group") or {}).get("replicate", {}).get("all_reduce", {}).get("busbw_GBps")
    per_sync = profile_number(comm, "reduce_scatter_bytes", path, fix) / syncs
    rs_busbw = (bus_bandwidth(per_sync / exposed / GB, "reduce_scatter", n) if exposed > 0
                else profile_number(comm, "reduce_scatter_busbw_GBps", path, fix))
    return dict(world_size=world, gradient_accumulation_steps=k_p, compute_seconds=c,
                accumulation_seconds=float(comm.get("accumulation_seconds") or 0.0),
                overlap_fraction=comm.get("overlap_fraction"),
                exposed_reduce_scatter_seconds=exposed, reduce_scatter_bytes_per_sync=per_sync,
                reduce_scatter_busbw_GBps=rs_busbw,
                all_gather_busbw_GBps=profile_number(comm, "all_gather_busbw_GBps", path, fix),
                exposed_comm_seconds_per_step=profile_number(comm, "exposed_comm_seconds_per_step", path, fix),
                units=tuple(comm.get("fsdp_units") or ()), replicate_size=replicas, all_reduce_busbw_GBps=ar_busbw)


#: What a profile recorded -> how its comm block is read.
READERS = {"all_reduce": _all_reduced, "sharded": _reduce_scattered}
#: What a plan needs and the profile lacks -> (problem, fix).
WRONG_KIND = {
    "sharded": ("is not an FSDP2 profile (no reduce-scatter recorded)",
                SHARDED_PROFILE_FIX + "; a DDP profile goes to the what-if planner, without --fsdp"),
}


def profile_kind(comm: dict) -> str:
    """``sharded`` when the profile recorded reduce-scatters (FSDP2, HSDP), else ``all_reduce`` (DDP)."""
    return "sharded" if comm.get("reduce_scatter_calls") else "all_reduce"


def load_profile(path: str, collectives: str | None = None) -> MeasuredProfile:
    """Read a ``train --profile_comm`` summary into a :class:`MeasuredProfile` (see the module docstring).

    Args:
        path: the ``train_summary.json``.
        collectives: the kind the plan needs, ``all_reduce`` (the what-if planner) or ``sharded``
            (``--fsdp``); None: whichever the profile is.

    Raises:
        UsageError (``--from_profile``): a missing or unreadable file; no ``comm`` block (rerun with
            ``--profile_comm``); a profile of the other kind (a DDP profile for ``--fsdp``; an FSDP2
            one, which has no all-reduce of the gradient, for the what-if planner); a 1-process profile;
            no no-sync micro-batch (K of 1, ``--sync_each_batch``), so that c, the overlap or the exposed
            reduction cannot be measured; no optimizer step, no compute, or a non-positive time per sync.
    """
    fix = FIXES.get(collectives, PROFILE_FIX)
    summary = read_summary(path, fix)
    comm = summary.get("comm")
    if not isinstance(comm, dict):
        raise UsageError("--from_profile", f"{path} has no comm block", fix if collectives == "sharded" else
                         "rerun `accum-kit train` with --profile_comm and pass its train_summary.json")
    kind = profile_kind(comm)
    if collectives is not None and kind != collectives and collectives in WRONG_KIND:
        problem, wrong_fix = WRONG_KIND[collectives]
        raise UsageError("--from_profile", f"{path} {problem}", wrong_fix)
    fields = READERS[collectives or kind](comm, str(path))
    K_p, c = fields["gradient_accumulation_steps"], fields["compute_seconds"]
    a = fields.get("accumulation_seconds", 0.0)
    opt = profile_number(comm, "optimizer_seconds", path, fix)
    step = profile_number(comm, "seconds_per_step", path, fix)
    # the profiled no_sync window by the step-time model, without o: K_p (c - a) + (K_p - 1) a + exposed
    window = window_seconds(K_p, c, accumulation_seconds=a, held_adds=K_p - 1,
                            communication_seconds=fields["exposed_comm_seconds_per_step"]).seconds
    return MeasuredProfile(path=str(path), collectives=collectives or kind, optimizer_seconds=opt, step_seconds=step,
                           other_seconds=max(step - window, opt),
                           per_device_train_batch_size=summary.get("per_device_train_batch_size"),
                           model=summary.get("model"), block_size=summary.get("block_size"),
                           policy=summary.get("accumulation_policy"), **fields)


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
    summary = read_summary(path)
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
