"""``accum-kit plan --fsdp``: which accumulation policy to run under FSDP2, from memory and communication.

For each policy of :data:`accum_kit.engines.policies.POLICIES` the plan gives what it
holds per process (:func:`accum_kit.engines.costs.policy_costs`), whether
that fits the free memory, its communication per optimizer step in calls,
bytes and seconds, and the saving against ``sync_each_batch``; it recommends
the fastest policy that fits and spells out the arithmetic. Torch-free.

Time model (seconds per optimizer step, one window of K micro-batches):

- a ring all-gather or reduce-scatter of S bytes over W processes takes
  ``S (W - 1) / W / busbw`` (nccl-tests' bus bandwidth for both,
  https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md);
- communication per step = the policy's reduce-scattered bytes at the
  reduce-scatter busbw + its all-gathered bytes at the all-gather busbw;
- with a profile (``--from_profile``, a ``train --profile_comm`` summary under
  FSDP2): the step-time model of :mod:`accum_kit.planning.step_time`,
  ``K (c - a) + adds x a + communication + o`` (overlap 0), with ``adds`` from
  the cost table (``K - 1`` for the three ``no_sync`` policies, which add each
  backward's gradients into the unsharded gradient held since the window's
  first micro-batch; 0 for ``sync_each_batch`` and ``reduce_scatter_each_batch``,
  which reduce it to a shard every micro-batch), ``c`` the profiled compute per
  micro-batch (``compute_seconds``, measured on micro-batches that add into the
  held gradient), ``a`` the profiled accumulation per micro-batch
  (``accumulation_seconds``) and ``o`` the profiled step minus the model's
  window of it (:func:`accum_kit.planning.measured_profile.load_profile`), at
  least the optimizer step; without a
  profile the plan ranks the policies by communication alone (their compute
  is the same: parameters do not change inside a window).

Every collective is counted as exposed (none hidden behind compute), which
is what the profile measures on CPU (gloo), where FSDP2's collectives block
the training thread. On GPUs FSDP2 prefetches all-gathers and overlaps
reduce-scatters with the backward, so the absolute seconds are an upper
bound; the ranking and the bytes stand.

Bus bandwidth: ``--busbw_GBps``, else ``--interconnect`` (nominal peaks of
:data:`accum_kit.planning.interconnects.INTERCONNECTS`), else the profile's measured
ones (all-gather: its ``all_gather_busbw_GBps``; reduce-scatter: its exposed
reduce-scatter per sync, which includes FSDP2's copy into the buffer, as an
effective bus bandwidth), else NVLink on one machine and InfiniBand across
machines.

Memory: ``--free_memory_GB`` is what is left per GPU for accumulation
(gradients held and gathered parameters kept between micro-batches) after
the model shards, the optimizer state and the activations; measure it, or
give ``--gpu_memory_GB`` and the plan subtracts the shards and the optimizer
state (not the activations: it says so).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .. import checks
from ..engines.bandwidth import GB
from ..engines.costs import policy_costs
from ..engines.model_units import ShardedModel, dtype_bytes, gpt2_units
from ..engines.policies import policies_for
from ..errors import UsageError
from .fsdp_format import arithmetic_lines
from .interconnects import INTERCONNECTS
from .measured_profile import SHARDED_PROFILE_FIX as PROFILE_FIX  # noqa: F401 (its name here before the one reader)
from .measured_profile import MeasuredProfile, load_profile
from .step_time import BusBandwidths, step_time
from .topology import compare_engines, shard_group_inside_machine

MIXED_PRECISION = ("no", "bf16", "fp16")


@dataclass(frozen=True)
class PolicyPlan:
    """One policy in the plan (bytes per process; seconds per optimizer step)."""

    policy: str
    costs: dict  # PolicyCosts.to_dict()
    memory_needed_bytes: float  # gradients held + gathered parameters kept between micro-batches
    fits: bool | None  # None: no memory given
    reduce_scatter_seconds: float
    all_gather_seconds: float
    comm_seconds: float
    step_seconds: float | None  # with a profile
    saved_seconds_vs_sync_each_batch: float
    speedup_vs_sync_each_batch: float | None  # with a profile
    all_reduce_seconds: float = 0.0  # HSDP: across replicas


@dataclass(frozen=True)
class FSDPPlan:
    """The FSDP2 section of ``accum-kit plan``."""

    model: dict  # ShardedModel as a dict, with P, P_f, P_0
    num_processes: int
    num_machines: int
    gradient_accumulation_steps: int
    mixed_precision: str
    element_bytes: dict  # b_p, b_c, b_r
    interconnect: str
    busbw_all_gather_GBps: float
    busbw_reduce_scatter_GBps: float
    busbw_source: str
    free_memory_bytes: float | None
    free_memory_source: str
    profile: MeasuredProfile | None
    rows: tuple[PolicyPlan, ...]
    recommended: str | None
    arithmetic: dict
    notes: tuple[str, ...] = ()
    comparison: dict | None = None  # predicted vs a bench.json, see accum_kit.planning.fsdp_compare
    replicate_size: int = 1  # HSDP's R
    busbw_all_reduce_GBps: float | None = None  # HSDP: the link across replicas
    busbw_all_reduce_source: str = ""
    engines: dict | None = None  # several machines: DDP / FSDP2 / HSDP, see accum_kit.planning.topology

    def to_dict(self) -> dict:
        return asdict(self)


#: The flags only ``--fsdp`` reads -> what is wrong when one comes without it (the fix: pass --fsdp too).
FSDP_FLAGS = {
    "--model_preset": "only used when planning FSDP2 policies",
    "--num_parameters": "only used when planning FSDP2 policies",
    "--num_layers": "only used when planning FSDP2 policies",
    "--gpu_memory_GB": "only used when planning FSDP2 policies",
    "--free_memory_GB": "only used when planning FSDP2 policies",
    "--parallelism_config_dp_replicate_size": "only used when planning sharded runs",
    "--inter_node_busbw_GBps": "only used when planning sharded runs",
}


def check_fsdp_flags(model_preset, num_parameters, num_layers, gpu_memory_GB, free_memory_GB, mixed_precision,
                     vocab_size) -> None:
    """Ranges and combinations of the ``--fsdp`` flags (whether they may be given at all: :data:`FSDP_FLAGS`).

    Raises:
        UsageError: both a preset and a parameter count; a count without ``--num_layers``; non-positive
            sizes; an unknown precision.
    """
    given = {"--gpu_memory_GB": gpu_memory_GB, "--free_memory_GB": free_memory_GB}
    if model_preset is not None and num_parameters is not None:
        raise UsageError("--num_parameters", "conflicts with --model_preset", "pass one of them")
    if num_parameters is not None:
        checks.at_least("--num_parameters", num_parameters)
        if num_layers is None:
            raise UsageError("--num_layers", "needed with --num_parameters (the units FSDP2 reshards after forward)",
                             "pass the number of transformer layers, e.g. --num_layers 32")
    if num_layers is not None:
        checks.at_least("--num_layers", num_layers)
    for flag in ("--gpu_memory_GB", "--free_memory_GB"):
        if given[flag] is not None:
            checks.positive(flag, given[flag], fix="pass gigabytes (1e9 bytes) per GPU, e.g. 80")
    checks.one_of("--mixed_precision", mixed_precision, MIXED_PRECISION)
    checks.at_least("--vocab_size", vocab_size)


def _structure(model_preset, num_parameters, num_layers, vocab_size, block_size, profile) -> ShardedModel:
    if model_preset is not None:
        return gpt2_units(model_preset, vocab_size, block_size or (profile.block_size if profile else None) or 128)
    if num_parameters is not None:
        per_layer, rest = divmod(num_parameters, num_layers)
        return ShardedModel(tuple([per_layer] * num_layers), (rest,) if rest else (),
                            f"--num_parameters {num_parameters} in --num_layers {num_layers} layer units "
                            "(the rest, if any, in one unit kept after forward)")
    if profile is not None and any(u.get("reshard_after_forward") for u in profile.units):
        return ShardedModel.from_units(list(profile.units), f"the FSDP2 units of {profile.path}")
    if profile is not None and (profile.model or "").startswith("preset:"):
        return gpt2_units(profile.model.removeprefix("preset:"), vocab_size, profile.block_size or 128)
    raise UsageError("--model_preset", "no model to plan for", "pass --model_preset, or --num_parameters with "
                     "--num_layers, or --from_profile of a run whose layers reshard after forward")


def _bandwidth(interconnect, busbw_GBps, machines, profile) -> tuple[str, float, float, str]:
    if busbw_GBps is not None:
        return interconnect or "given", busbw_GBps, busbw_GBps, "--busbw_GBps"
    name = interconnect or ("measured" if profile is not None else ("nvlink" if machines == 1 else "infiniband"))
    if name == "measured":
        if profile is None:
            raise UsageError("--interconnect", "measured needs a profile", "pass --from_profile, or another "
                             "--interconnect, or --busbw_GBps")
        return name, profile.all_gather_busbw_GBps, profile.reduce_scatter_busbw_GBps, (
            f"the profile's: all-gather busbw {profile.all_gather_busbw_GBps:.4g} GB/s; reduce-scatter "
            f"{profile.reduce_scatter_busbw_GBps:.4g} GB/s effective (bytes per sync (n-1)/n over its exposed time)")
    peak, source = INTERCONNECTS[name]
    default = "" if interconnect else " (default for " + ("one machine" if machines == 1 else "several machines") + ")"
    return name, peak, peak, source + default


def make_fsdp_plan(*, num_processes: int, gradient_accumulation_steps: int, num_machines: int | None = None,
                   model_preset: str | None = None, num_parameters: int | None = None, num_layers: int | None = None,
                   vocab_size: int = 384, block_size: int | None = None, mixed_precision: str = "no",
                   gpu_memory_GB: float | None = None, free_memory_GB: float | None = None,
                   interconnect: str | None = None, busbw_GBps: float | None = None,
                   from_profile: str | None = None, replicate_size: int | None = None,
                   inter_node_busbw_GBps: float | None = None) -> FSDPPlan:
    """The FSDP2 plan from keywords named like the flags (see the module docstring for the model).

    Args:
        num_processes: W, over all machines. gradient_accumulation_steps: K.
        num_machines: machines (None: 1); with more than one the default link is InfiniBand.
        model_preset / num_parameters + num_layers: the model (else the profile's units or preset).
        vocab_size, block_size: of a preset (block_size: its positions; None: the profile's, else 128).
        mixed_precision: ``no``, ``bf16``, ``fp16`` (accum-kit's plugin: fp32 master, low-precision gathers,
            fp32 reduction).
        gpu_memory_GB / free_memory_GB: memory per GPU (1e9 bytes); free wins.
        interconnect, busbw_GBps: the bus bandwidth (see the module docstring).
        from_profile: an FSDP2 ``train --profile_comm`` summary.
        replicate_size: HSDP's R (replicas; the shard group is S = W / R); None: the profile's mesh, else 1.
            With R > 1 the plan covers all five policies, reduce-scatters and all-gathers in the shard
            group (at the bandwidths above) and all-reduces across replicas.
        inter_node_busbw_GBps: bus bandwidth of the all-reduce across replicas, GB/s; None: the profile's
            measured one, else InfiniBand's nominal peak.

    Raises:
        UsageError: naming the flag.
    """
    check_fsdp_flags(model_preset, num_parameters, num_layers, gpu_memory_GB, free_memory_GB, mixed_precision,
                     vocab_size)
    profile = load_profile(from_profile, "sharded") if from_profile is not None else None
    machines = num_machines or 1
    W, K = num_processes, gradient_accumulation_steps
    model = _structure(model_preset, num_parameters, num_layers, vocab_size, block_size, profile)
    b_p, b_c, b_r = dtype_bytes(mixed_precision)
    name, ag_bw, rs_bw, bw_source = _bandwidth(interconnect, busbw_GBps, machines, profile)
    R = replicate_size or (profile.replicate_size if profile is not None else 1)
    if W % R:
        raise UsageError("--parallelism_config_dp_replicate_size", f"{R} does not divide --num_processes {W}",
                         "pass the number of machines, or a divisor of --num_processes")
    ar_bw, ar_source = _replicate_bandwidth(R, inter_node_busbw_GBps, profile)
    costs = {p: policy_costs(p, model, world_size=W, accumulation_steps=K, param_bytes=b_p, compute_bytes=b_c,
                             reduce_bytes=b_r, replicate_size=R) for p in policies_for(R > 1)}
    base = costs["sync_each_batch"]
    if free_memory_GB is not None:
        free, free_source = free_memory_GB * GB, "--free_memory_GB"
    elif gpu_memory_GB is not None:
        free = gpu_memory_GB * GB - base.parameter_shard_bytes - base.optimizer_state_bytes
        free_source = (f"--gpu_memory_GB {gpu_memory_GB:g} minus parameter shards and AdamW state "
                       f"({(base.parameter_shard_bytes + base.optimizer_state_bytes) / GB:.4g} GB); activations "
                       "not subtracted: pass --free_memory_GB measured to include them")
    else:
        free, free_source = None, "not given (--gpu_memory_GB or --free_memory_GB): every policy is listed as fitting"

    links = BusBandwidths(shard_GBps=rs_bw, all_gather_GBps=ag_bw, replicate_GBps=ar_bw)
    base_comm = links.seconds(base)["total"]
    base_step = predicted_step(profile, base, links) if profile else None
    rows = []
    for p, c in costs.items():
        t = links.seconds(c)
        rs_s, ag_s, comm = t["reduce_scatter"], t["all_gather"], t["total"]
        step = predicted_step(profile, c, links) if profile else None
        need = c.accumulation_bytes
        rows.append(PolicyPlan(policy=p, costs=c.to_dict(), memory_needed_bytes=need,
                               fits=None if free is None else need <= free, reduce_scatter_seconds=rs_s,
                               all_gather_seconds=ag_s, comm_seconds=comm, step_seconds=step,
                               saved_seconds_vs_sync_each_batch=base_comm - comm,
                               speedup_vs_sync_each_batch=base_step / step if step else None,
                               all_reduce_seconds=t["all_reduce"]))
    fitting = [r for r in rows if r.fits is not False]
    best = min(fitting, key=lambda r: (round(r.comm_seconds, 12), r.memory_needed_bytes)) if fitting else None
    notes = []
    if W < 2:
        notes.append("1 process: FSDP has nothing to shard or communicate; pass --num_processes (all machines)")
    if best is None:
        notes.append("no policy fits: sync_each_batch needs P b_p / W per process, which more processes shrink "
                     "(or offload parameters / optimizer state, which this plan does not model)")
    if profile is not None and profile.world_size != W:
        notes.append(f"c and o were measured on {profile.world_size} processes; only the communication is "
                     f"recomputed for {W}")
    if K == 1:
        notes.append("K = 1: every policy does the same (one micro-batch per window)")
    if profile is None:
        notes.append("no profile: policies ranked by communication alone (compute is the same for all); pass "
                     "--from_profile for step times")
    # every engine priced from the same table; intra: the plan's shard link when its shard group stays inside a
    # machine (HSDP), else NVLink's peak on several machines; inter: the link across replicas when there is one,
    # else the plan's shard link (its ring spans the machines); on one machine every link is the plan's own
    if machines > 1:
        intra = rs_bw if shard_group_inside_machine(base, machines) else INTERCONNECTS["nvlink"][0]
        inter, inter_source = (ar_bw, ar_source) if ar_bw is not None else (rs_bw, bw_source)
    else:
        intra, inter, inter_source = rs_bw, rs_bw, bw_source
    engines = compare_engines(model, world=W, machines=machines, K=K, element_bytes=(b_p, b_c, b_r),
                              intra_GBps=intra, inter_GBps=inter, inter_source=inter_source,
                              gpu_memory_GB=gpu_memory_GB, profile=profile)

    arithmetic = arithmetic_lines(model, W, K, (b_p, b_c, b_r), ag_bw, rs_bw, costs, rows, best, free, profile, ar_bw)
    return FSDPPlan(model={**asdict(model), "P": model.parameters, "P_f": model.layer_parameters,
                           "P_0": model.other_parameters, "U_f": len(model.resharded), "U_0": len(model.kept)},
                    num_processes=W, num_machines=machines, gradient_accumulation_steps=K,
                    mixed_precision=mixed_precision, element_bytes={"b_p": b_p, "b_c": b_c, "b_r": b_r},
                    interconnect=name, busbw_all_gather_GBps=ag_bw, busbw_reduce_scatter_GBps=rs_bw,
                    busbw_source=bw_source, free_memory_bytes=free, free_memory_source=free_source, profile=profile,
                    rows=tuple(rows), recommended=best.policy if best else None, arithmetic=arithmetic,
                    notes=tuple(notes), replicate_size=R, busbw_all_reduce_GBps=ar_bw,
                    busbw_all_reduce_source=ar_source, engines=engines)


def _replicate_bandwidth(R: int, given: float | None, profile) -> tuple[float | None, str]:
    """(bus bandwidth of the all-reduce across replicas, its source); (None, "") without replicas."""
    if R < 2:
        return None, ""
    if given is not None:
        checks.positive("--inter_node_busbw_GBps", given, fix="pass GB/s, e.g. 25 for InfiniBand NDR")
        return given, "--inter_node_busbw_GBps"
    if profile is not None and profile.all_reduce_busbw_GBps:
        return profile.all_reduce_busbw_GBps, "the profile's measured all-reduce across replicas"
    peak, source = INTERCONNECTS["infiniband"]
    return peak, source + " (default across machines)"


def predicted_step(profile: MeasuredProfile, costs, links: BusBandwidths) -> float:
    """Seconds per optimizer step of the policy ``costs`` prices, from a profile and the bus bandwidths.

    The step-time model (:func:`accum_kit.planning.step_time.step_time`) with every collective exposed:
    ``K (c - a) + adds x a + comm + o``, the adds from the cost table (see the module docstring).

    Raises:
        ValueError: bytes to send in a group without a bandwidth.
    """
    return step_time(costs, profile.compute_seconds, links, accumulation_seconds=profile.accumulation_seconds,
                     other_seconds=profile.other_seconds).seconds
