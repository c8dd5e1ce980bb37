"""What each accumulation policy costs under FSDP2, per window and per process, as formulas (torch-free).

FSDP2 (torch's ``fully_shard``) splits a model into units, one per
``fully_shard`` call. Accelerate's ``TRANSFORMER_BASED_WRAP`` makes each
transformer layer a unit, a unit of the final norm with the output head (and
the input embedding when it is tied to the head), and the root unit with
the rest (``accelerate.utils.fsdp_utils.fsdp2_prepare_model``). A unit's
parameters are all-gathered before its forward and, when they were freed
after the forward, again before its backward; its gradients are
reduce-scattered after a synchronised backward. The layers free their
parameters after forward (``reshard_after_forward=True``, the config's
default); the root (FSDP2's own rule for the root) and the head unit
(Accelerate builds it with ``reshard_after_forward=False``) keep them until
their backward. Every unit frees them after its backward unless told not to
(``set_reshard_after_backward(False)``).

Symbols: U_f units resharded after forward (the layers) holding P_f
parameters, U_0 units kept after forward holding P_0, P = P_f + P_0
(counted as FSDP2 holds them: a tied weight once), W processes, K
micro-batches per window, bytes per element: ``b_p`` of the parameters as
stored (the fp32 master), ``b_c`` of the all-gathered parameters (the mixed
precision policy's ``param_dtype``), ``b_r`` of the reduced gradients (its
``reduce_dtype``; FSDP2's default is ``b_c``), ``b_o`` of optimizer state per
parameter (AdamW: two fp32 moments, 8).

Per window (calls; bytes S as nccl-tests defines them for these
collectives: the whole buffer, W times one process's shard,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

============================  =====================  =====================  =============================
policy                        reduce-scatters        all-gathers (calls)    all-gathered bytes
============================  =====================  =====================  =============================
sync_each_batch               K U, K P b_r           K (2 U_f + U_0)        K (2 P_f + P_0) b_c
no_sync                       U, P b_r               K (2 U_f + U_0)        K (2 P_f + P_0) b_c
no_sync_no_reshard_after_bwd  U, P b_r               U_0 + (K + 1) U_f      (P_0 + (K + 1) P_f) b_c
no_sync_no_reshard            U, P b_r               U_0 + U_f              P b_c
============================  =====================  =====================  =============================

Under HSDP (``R`` replicas of ``S`` processes, ``W = R S``; :mod:`accum_kit.engines.mesh`)
the reduce-scatters and all-gathers above run in the shard group (``S``
processes, the formulas unchanged), every synchronised unit's
reduce-scattered shard is then all-reduced across the replicate group
(``R`` processes; S as nccl-tests defines it for all-reduce: the buffer,
``P_unit b_r / S``), and the shards below are ``1/S``, not ``1/W``:

============================  =====================  ===========================
policy                        reduce-scatters        all-reduces across replicas
============================  =====================  ===========================
sync_each_batch               K U, K P b_r           K U, K P b_r / S
reduce_scatter_each_batch     K U, K P b_r           U, P b_r / S
the three no_sync policies    U, P b_r               U, P b_r / S
============================  =====================  ===========================

Per process, between two micro-batches of a window:

- parameter shards ``P b_p / W`` and optimizer state ``P b_o / W``: every policy;
- gradients held: ``P b_p / W`` with ``sync_each_batch`` (sharded, after each
  reduce-scatter); ``P b_r`` with the three ``no_sync`` policies (the unsharded
  gradient until the boundary: FSDP2's ``unsharded_param.grad``, or its
  ``unsharded_accumulated_grad`` when ``b_r`` differs from ``b_c``);
  ``P b_r / S`` with ``reduce_scatter_each_batch`` (the reduce-scattered
  shards summed until the boundary all-reduce: FSDP2's ``_partial_reduce_output``);
- gathered parameters kept: ``P b_c`` with the two ``no_sync_no_reshard``
  policies (``no_sync_no_reshard_after_backward`` between a backward and the
  next forward, ``no_sync_no_reshard`` all window), 0 otherwise.

Measured against these (tests/test_fsdp.py and docs/fsdp_costs.md): the
calls exactly, on a 2-layer GPT-2 (U_f = 2, U_0 = 2); the gradient bytes held
to the byte when every parameter's first dimension divides by W (FSDP2 pads
each parameter's first dimension to a multiple of W, which the formulas leave
out).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import UsageError
from ..job.models import PRESETS
from .policies import POLICIES

#: Bytes per element of the dtypes a run can use.
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
#: AdamW keeps two fp32 moments per parameter (torch.optim.AdamW, ``exp_avg`` and ``exp_avg_sq``).
ADAMW_STATE_BYTES = 8


@dataclass(frozen=True)
class ShardedModel:
    """How FSDP2 splits a model into units: the parameters (elements, unsharded) of each unit.

    Attributes:
        resharded: one entry per unit that frees its gathered parameters after
            forward (the transformer layers); their sum is P_f, their count U_f.
        kept: one entry per unit that keeps them until its backward (the root,
            Accelerate's output-head unit); sum P_0, count U_0.
        source: where the split comes from (for the report).
    """

    resharded: tuple[int, ...]
    kept: tuple[int, ...] = ()
    source: str = ""

    @property
    def parameters(self) -> int:
        """P = P_f + P_0."""
        return sum(self.resharded) + sum(self.kept)

    @property
    def layer_parameters(self) -> int:
        """P_f."""
        return sum(self.resharded)

    @property
    def other_parameters(self) -> int:
        """P_0."""
        return sum(self.kept)

    @property
    def units(self) -> int:
        """U = U_f + U_0."""
        return len(self.resharded) + len(self.kept)

    @classmethod
    def from_units(cls, units: list[dict], source: str = "") -> "ShardedModel":
        """From the profiler's ``fsdp_units`` (``parameters``, ``reshard_after_forward`` per unit)."""
        return cls(tuple(u["parameters"] for u in units if u["reshard_after_forward"]),
                   tuple(u["parameters"] for u in units if not u["reshard_after_forward"]), source)


def gpt2_units_for(n_layer: int, n_embd: int, vocab_size: int, n_positions: int, source: str = "") -> ShardedModel:
    """The FSDP2 units of a ``transformers`` GPT-2 (tied embedding and head) under ``TRANSFORMER_BASED_WRAP``.

    A GPT-2 block of width d has ``12 d^2 + 13 d`` parameters (attention
    ``c_attn`` 3d^2 + 3d and ``c_proj`` d^2 + d, MLP ``c_fc`` 4d^2 + 4d and
    ``c_proj`` 4d^2 + d, two LayerNorms 4d): one resharded unit each. Kept
    after forward: the output-head unit (the tied embedding/head
    ``vocab_size x d`` and the final LayerNorm 2d) and the root (the position
    embedding ``n_positions x d``).
    """
    d = n_embd
    block = 12 * d * d + 13 * d
    return ShardedModel(tuple([block] * n_layer), (vocab_size * d + 2 * d, n_positions * d),
                        source or f"GPT-2: {n_layer} blocks x {block} + head {vocab_size} x {d} + {2 * d} "
                                  f"+ positions {n_positions} x {d}")


def gpt2_units(preset: str, vocab_size: int, n_positions: int) -> ShardedModel:
    """:func:`gpt2_units_for` of a preset of :data:`accum_kit.job.models.PRESETS`.

    Raises:
        UsageError: unknown preset (names ``--model_preset``).
    """
    if preset not in PRESETS:
        raise UsageError("--model_preset", f"unknown preset {preset!r}", f"use one of {sorted(PRESETS)}")
    cfg = PRESETS[preset]
    units = gpt2_units_for(cfg["n_layer"], cfg["n_embd"], vocab_size, n_positions)
    return ShardedModel(units.resharded, units.kept, f"preset {preset} ({units.source})")


@dataclass(frozen=True)
class PolicyCosts:
    """One policy's communication per window and memory per process (bytes; calls).

    ``*_bytes`` of a collective is nccl-tests' S (the whole buffer); each
    process sends and receives ``(W - 1) / W`` of it. ``formulas`` gives each
    figure's formula with the numbers put in.
    """

    policy: str
    world_size: int
    accumulation_steps: int
    reduce_scatter_calls: int
    reduce_scatter_bytes: int
    all_gather_calls: int
    all_gather_bytes: int
    parameter_shard_bytes: float
    optimizer_state_bytes: float
    gradient_bytes: float
    gathered_parameter_bytes: float
    formulas: dict = field(default_factory=dict)
    replicate_size: int = 1
    all_reduce_calls: int = 0
    all_reduce_bytes: float = 0.0

    @property
    def shard_size(self) -> int:
        """S: processes a parameter is sharded over (W under plain FSDP2, W / R under HSDP)."""
        return self.world_size // self.replicate_size

    @property
    def all_reduce_group_size(self) -> int:
        """Processes an all-reduce spans: the replicate group (R) under HSDP and DDP, all W under ZeRO (R = 1)."""
        return self.replicate_size if self.replicate_size > 1 else self.world_size

    @property
    def accumulation_bytes(self) -> float:
        """What the window holds beyond shards and optimizer state: gradients + gathered parameters."""
        return self.gradient_bytes + self.gathered_parameter_bytes

    @property
    def total_bytes(self) -> float:
        """Shards + optimizer state + gradients + gathered parameters (activations not included)."""
        return self.parameter_shard_bytes + self.optimizer_state_bytes + self.accumulation_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "accumulation_bytes": self.accumulation_bytes, "total_bytes": self.total_bytes}


#: DeepSpeed ZeRO stages, rows of the same table as the FSDP2 policies (``policy_costs("zero2", ...)``).
ZERO_STAGES = ("zero1", "zero2", "zero3")
#: DeepSpeed's default ``reduce_bucket_size`` and ``allgather_bucket_size`` (elements, DeepSpeed 0.19.8).
ZERO_BUCKET_ELEMENTS = 500_000_000
#: The boundary's scalar all-reduce (gradient norm / overflow flag): its bytes per stage, as counted on gloo.
ZERO_SCALAR_BYTES = {"zero1": 4, "zero2": 4, "zero3": 8}


def zero_costs(stage: str, parameters: int, *, world_size: int, accumulation_steps: int, param_bytes: int = 4,
               optimizer_bytes: int = ADAMW_STATE_BYTES, bucket_elements: int = ZERO_BUCKET_ELEMENTS,
               param_groups: int = 1) -> PolicyCosts:
    """A DeepSpeed ZeRO stage's costs per window and per process, in :class:`PolicyCosts`' terms (fp32).

    With G = max(groups, ceil(P / bucket)) gradient buckets (each optimizer parameter group is
    reduced and gathered on its own: the train job's decay / no-decay groups make G = 2) and as
    many all-gathers:
    ZeRO-1 all-reduces the full gradient on the boundary only (G calls, P b_p bytes) and holds it
    unsharded in ``.grad`` through the window; ZeRO-2 all-reduces it after every micro-batch (K G
    calls, K P b_p bytes: DeepSpeed's partitioned reduction sends the whole bucket) and keeps only
    its partition (P b_p / W); both all-gather the updated parameter partitions after the step
    (A calls, P b_p bytes) and keep full parameters. ZeRO-3 reduce-scatters after every
    micro-batch (K G calls, K P b_p bytes) and holds P b_p / W; its parameter all-gathers depend
    on which parameters stay resident (``stage3_param_persistence_threshold``) and prefetching, so
    they are not predicted (0, said so in ``formulas``). Every stage adds one scalar all-reduce on
    the boundary (:data:`ZERO_SCALAR_BYTES`). Source: DeepSpeed 0.19.8's ``stage_1_and_2.py`` and
    ``stage3.py``, checked by counting ``torch.distributed`` calls (tests/test_deepspeed.py).

    Raises:
        UsageError: unknown stage, W or K below 1.
    """
    if stage not in ZERO_STAGES:
        raise UsageError("--zero_stage", f"unknown stage {stage!r}", f"use one of {list(ZERO_STAGES)}")
    if world_size < 1 or accumulation_steps < 1:
        raise UsageError("--num_processes" if world_size < 1 else "--gradient_accumulation_steps",
                         "must be at least 1", "pass a positive integer")
    P, W, K, b = parameters, world_size, accumulation_steps, param_bytes
    G = max(param_groups, -(-P // bucket_elements))
    scalar = ZERO_SCALAR_BYTES[stage]
    every = stage != "zero1"  # ZeRO-2 and 3 reduce on every micro-batch
    reduced_calls, reduced_bytes = (K * G, K * P * b) if every else (G, P * b)
    reduced_f = (f"K G = {K} x {G}; K P b_p = {K} x {P} x {b}" if every else f"G = {G}; P b_p = {P} x {b}")
    ar_calls, ar_bytes = (1, scalar) if stage == "zero3" else (reduced_calls + 1, reduced_bytes + scalar)
    ar_f = "1 scalar" if stage == "zero3" else f"{reduced_f}; + 1 scalar ({scalar} B)"
    rs_calls, rs_bytes = (reduced_calls, reduced_bytes) if stage == "zero3" else (0, 0)
    ag_calls, ag_bytes = (0, 0) if stage == "zero3" else (G, P * b)
    grads = 0.0 if K < 2 else (float(P * b) if stage == "zero1" else P * b / W)
    return PolicyCosts(
        policy=stage, world_size=W, accumulation_steps=K, reduce_scatter_calls=rs_calls, reduce_scatter_bytes=rs_bytes,
        all_gather_calls=ag_calls, all_gather_bytes=ag_bytes,
        parameter_shard_bytes=P * b / W if stage == "zero3" else float(P * b),
        optimizer_state_bytes=P * optimizer_bytes / W, gradient_bytes=grads, gathered_parameter_bytes=0.0,
        all_reduce_calls=ar_calls, all_reduce_bytes=ar_bytes,
        formulas={"all_reduce": ar_f, "reduce_scatter": reduced_f if stage == "zero3" else "0",
                  "all_gather": "not predicted (persistence threshold, prefetch)" if stage == "zero3"
                  else f"A = {G}; P b_p = {P} x {b}",
                  "gradients": "K = 1: nothing between micro-batches" if K < 2 else
                  (f"P b_p = {P} x {b} (full .grad until the boundary)" if stage == "zero1"
                   else f"P b_p / W = {P} x {b} / {W} (the reduced partition)"),
                  "parameters": f"P b_p{' / W' if stage == 'zero3' else ''} = {P} x {b}"})


def policy_costs(policy: str, model: ShardedModel, *, world_size: int, accumulation_steps: int, param_bytes: int = 4,
                 compute_bytes: int | None = None, reduce_bytes: int | None = None,
                 optimizer_bytes: int = ADAMW_STATE_BYTES, replicate_size: int = 1) -> PolicyCosts:
    """The costs of ``policy`` per window (communication) and per process (memory), see the module docstring.

    Args:
        policy: a name of :data:`accum_kit.engines.policies.POLICIES`, or a DeepSpeed stage of
            :data:`ZERO_STAGES` (then :func:`zero_costs` with the model's P; only
            ``param_bytes`` and ``optimizer_bytes`` apply).
        model: the units (:class:`ShardedModel`).
        world_size: W, processes sharding the model.
        accumulation_steps: K, micro-batches per window (per process).
        param_bytes: b_p, bytes per stored parameter (4: fp32).
        compute_bytes: b_c, bytes per gathered parameter (None: ``param_bytes``; 2 under bf16).
        reduce_bytes: b_r, bytes per reduced gradient element (None: ``compute_bytes``, FSDP2's default;
            accum-kit's bf16 policy reduces in fp32: 4).
        optimizer_bytes: b_o, optimizer state bytes per parameter (AdamW: 8).
        replicate_size: R, HSDP's replicas (1: plain FSDP2); the shard group is S = W / R.

    Raises:
        UsageError: unknown policy, W or K below 1, R not dividing W, or an HSDP-only policy with R = 1.
    """
    if policy in ZERO_STAGES:
        return zero_costs(policy, model.parameters, world_size=world_size, accumulation_steps=accumulation_steps,
                          param_bytes=param_bytes, optimizer_bytes=optimizer_bytes)
    if policy not in POLICIES:
        raise UsageError("--accumulation_policy", f"unknown policy {policy!r}", f"use one of {list(POLICIES)}")
    if world_size < 1 or accumulation_steps < 1:
        raise UsageError("--num_processes" if world_size < 1 else "--gradient_accumulation_steps",
                         "must be at least 1", "pass a positive integer")
    if replicate_size < 1 or world_size % replicate_size:
        raise UsageError("--parallelism_config_dp_replicate_size", f"{replicate_size} does not divide the "
                         f"{world_size} processes", "pass a divisor of --num_processes")
    if POLICIES[policy].hsdp_only and replicate_size < 2:
        raise UsageError("--accumulation_policy", f"{policy} needs a replicate group (HSDP)",
                         "pass --parallelism_config_dp_replicate_size 2 or more, or another policy")
    W, K, R = world_size, accumulation_steps, replicate_size
    S = W // R  # the shard group: what each parameter is split over
    b_p = param_bytes
    b_c = compute_bytes or b_p
    b_r = reduce_bytes or b_c
    P, Pf, P0 = model.parameters, model.layer_parameters, model.other_parameters
    Uf, U0, U = len(model.resharded), len(model.kept), model.units
    p = POLICIES[policy]
    if p.sync_each_batch or p.hsdp_only:
        rs_calls, rs_bytes, rs_f = K * U, K * P * b_r, f"K U = {K} x {U}; K P b_r = {K} x {P} x {b_r}"
    else:
        rs_calls, rs_bytes, rs_f = U, P * b_r, f"U = {U}; P b_r = {P} x {b_r}"
    if S == 1:  # replicated only (DDP): no reduce-scatter, no all-gather
        rs_calls, rs_bytes, rs_f = 0, 0, "0 (S = 1: nothing sharded)"
    if R < 2:
        ar_calls, ar_bytes, ar_f = 0, 0.0, "0 (no replicate group)"
    elif p.sync_each_batch:
        ar_calls, ar_bytes, ar_f = K * U, K * P * b_r / S, f"K U = {K} x {U}; K P b_r / S = {K} x {P} x {b_r} / {S}"
    else:
        ar_calls, ar_bytes, ar_f = U, P * b_r / S, f"U = {U}; P b_r / S = {P} x {b_r} / {S}"
    if p.name == "no_sync_no_reshard":
        ag_calls, ag_bytes = U, P * b_c
        ag_f = f"U_0 + U_f = {U0} + {Uf}; P b_c = {P} x {b_c}"
    elif p.name == "no_sync_no_reshard_after_backward":
        ag_calls, ag_bytes = U0 + (K + 1) * Uf, (P0 + (K + 1) * Pf) * b_c
        ag_f = f"U_0 + (K+1) U_f = {U0} + {K + 1} x {Uf}; (P_0 + (K+1) P_f) b_c = ({P0} + {K + 1} x {Pf}) x {b_c}"
    else:
        ag_calls, ag_bytes = K * (2 * Uf + U0), K * (2 * Pf + P0) * b_c
        ag_f = f"K (2 U_f + U_0) = {K} x (2 x {Uf} + {U0}); K (2 P_f + P_0) b_c = {K} x (2 x {Pf} + {P0}) x {b_c}"
    if S == 1:
        ag_calls, ag_bytes, ag_f = 0, 0, "0 (S = 1: nothing sharded)"
    between = K >= 2  # with K = 1 no micro-batch follows another inside a window
    if not between:
        grads, grads_f = 0.0, "K = 1: no micro-batch follows another in a window"
    elif p.sync_each_batch:
        grads, grads_f = P * b_p / S, f"P b_p / {'S' if R > 1 else 'W'} = {P} x {b_p} / {S} (sharded)"
    elif p.hsdp_only:
        grads, grads_f = P * b_r / S, f"P b_r / S = {P} x {b_r} / {S} (reduce-scattered, summed until the all-reduce)"
    else:
        grads, grads_f = float(P * b_r), f"P b_r = {P} x {b_r} (unsharded until the boundary)"
    shard = "S" if R > 1 else "W"
    kept = between and p.keep_params_after_backward
    gathered = float(P * b_c) if kept else 0.0
    gathered_f = f"P b_c = {P} x {b_c}" if kept else "0 (resharded after every backward)"
    return PolicyCosts(
        policy=policy, world_size=W, accumulation_steps=K,
        reduce_scatter_calls=rs_calls, reduce_scatter_bytes=rs_bytes,
        all_gather_calls=ag_calls, all_gather_bytes=ag_bytes,
        parameter_shard_bytes=P * b_p / S, optimizer_state_bytes=P * optimizer_bytes / S,
        gradient_bytes=grads, gathered_parameter_bytes=gathered,
        formulas={"reduce_scatter": rs_f, "all_gather": ag_f, **({"all_reduce": ar_f} if R > 1 else {}),
                  "parameter_shards": f"P b_p / {shard} = {P} x {b_p} / {S}",
                  "optimizer_state": f"P b_o / {shard} = {P} x {optimizer_bytes} / {S}", "gradients": grads_f,
                  "gathered_parameters": gathered_f},
        replicate_size=R, all_reduce_calls=ar_calls, all_reduce_bytes=ar_bytes,
    )


def collective_seconds(n_bytes: float, world_size: int, busbw_GBps: float) -> float:
    """Seconds of one ring all-gather or reduce-scatter of S = ``n_bytes``: ``S (W - 1) / W / busbw``.

    nccl-tests' bus bandwidth for both collectives is ``algbw (n - 1) / n``
    (doc/PERFORMANCE.md), so at a bus bandwidth of ``busbw_GBps`` GB/s (1e9
    bytes/s) the call takes ``S (n - 1) / n / busbw``. One process: 0.
    """
    return n_bytes * (world_size - 1) / world_size / (busbw_GBps * 1e9)


def all_reduce_seconds(n_bytes: float, group_size: int, busbw_GBps: float) -> float:
    """Seconds of a ring all-reduce of S = ``n_bytes`` over ``group_size`` processes: ``2 S (n - 1) / n / busbw``.

    nccl-tests' bus bandwidth for all-reduce is ``algbw 2 (n - 1) / n`` (doc/PERFORMANCE.md). One process: 0.
    """
    return 2 * n_bytes * (group_size - 1) / group_size / (busbw_GBps * 1e9)


def comm_seconds(costs: PolicyCosts, *, shard_GBps: float, all_gather_GBps: float | None = None,
                 replicate_GBps: float | None = None) -> dict:
    """Seconds per window of each group's collectives of ``costs``, every collective counted exposed.

    Args:
        costs: :func:`policy_costs` of one policy on one mesh (R x S).
        shard_GBps: bus bandwidth of the shard group's reduce-scatters (and all-gathers unless
            ``all_gather_GBps`` is given), GB/s.
        replicate_GBps: bus bandwidth of the all-reduces (across replicas under HSDP and DDP, over all W
            processes under ZeRO), GB/s; None: ``shard_GBps``.

    Returns:
        ``{"reduce_scatter": s, "all_gather": s, "all_reduce": s, "total": s}``.
    """
    S, n_ar = costs.shard_size, costs.all_reduce_group_size
    rs = collective_seconds(costs.reduce_scatter_bytes, S, shard_GBps)
    ag = collective_seconds(costs.all_gather_bytes, S, all_gather_GBps or shard_GBps)
    ar = all_reduce_seconds(costs.all_reduce_bytes, n_ar, replicate_GBps or shard_GBps) if costs.all_reduce_bytes else 0.0
    return {"reduce_scatter": rs, "all_gather": ag, "all_reduce": ar, "total": rs + ag + ar}


def dtype_bytes(mixed_precision: str) -> tuple[int, int, int]:
    """(b_p, b_c, b_r) for ``--mixed_precision`` ``no`` / ``bf16`` / ``fp16`` under accum-kit's FSDP2 plugin.

    accum-kit gives low precision ``MixedPrecisionPolicy(param_dtype=<low>,
    reduce_dtype=float32)`` (:func:`accum_kit.engines.fsdp2.fsdp_plugin_for`):
    fp32 master parameters, gathered in the low precision, gradients reduced
    and accumulated in fp32.
    """
    return (4, 4, 4) if mixed_precision in (None, "no") else (4, 2, 4)
