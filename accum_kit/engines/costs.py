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

Frozen weights (a LoRA run, ``peft``): P counts every parameter, P_t the trainable ones and U_t the units
holding one (:class:`ShardedModel`'s ``trainable``). Parameters are gathered, kept gathered and held as
shards for all P; gradients, their reduce-scatters and all-reduces, and optimizer state count P_t, and a
unit without a trainable parameter reduces nothing (FSDP2 reduce-scatters only the parameters that
received a gradient). Below, P in a reduction, gradient or optimizer-state column and U in a
reduce-scatter or all-reduce column read P_t and U_t for such a model.

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

Under DDP (``R = W`` replicas of ``S = 1`` process: nothing sharded) no
reduce-scatter or all-gather runs and every synchronised backward
all-reduces the whole gradient over the W processes; DDP's reducer splits
it into buckets (``bucket_cap_mb``), not into the wrap units above, so the
table counts DDP's all-reduces per synchronised backward (:func:`ddp_costs`).
DeepSpeed's ZeRO stages are rows of the same table (:func:`zero_costs`).

Besides calls and bytes, each row says what the step-time model
(:mod:`accum_kit.planning.step_time`) needs to know of the policy:
``syncs``, the micro-batches per window whose gradient is reduced across all
W processes (K when every micro-batch synchronises, 1 otherwise), and
``held_gradient_adds``, the micro-batches per window that add their
backward's gradient into a whole (unsharded) gradient held since the
window's first micro-batch: K - 1 when the window holds it (every DDP
policy, the three ``no_sync`` policies, ZeRO-1), 0 when every micro-batch
reduces it to a shard (sharded ``sync_each_batch``, ``reduce_scatter_each_batch``,
ZeRO-2 and 3).

Seconds come from bus bandwidth (:func:`busbw_factor`, nccl-tests'
definitions, one function for every collective kind and group size).

Measured against these (tests/test_fsdp.py and docs/fsdp_costs.md): the
calls exactly, on a 2-layer GPT-2 (U_f = 2, U_0 = 2); the gradient bytes held
to the byte when every parameter's first dimension divides by W (FSDP2 pads
each parameter's first dimension to a multiple of W, which the formulas leave
out).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import UsageError
from .bandwidth import collective_seconds
from .model_units import ADAMW_STATE_BYTES, ShardedModel
from .policies import POLICIES

@dataclass(frozen=True)
class PolicyCosts:
    """One policy's communication per window and memory per process (bytes; calls).

    ``*_bytes`` of a collective is nccl-tests' S (the whole buffer); each
    process sends and receives ``(W - 1) / W`` of it. ``formulas`` gives each
    figure's formula with the numbers put in.

    ``syncs``: micro-batches per window whose gradient is reduced across all W processes;
    ``held_gradient_adds``: micro-batches per window that add into a whole gradient held since
    the window's first one (see the module docstring); ``comm_is_floor``: some collectives are
    not predicted (ZeRO-3's parameter all-gathers), so its communication is a lower bound.
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
    syncs: int = 1
    held_gradient_adds: int = 0
    comm_is_floor: bool = False
    recompute_forward_fraction: float = 0.0  # share of one forward run again in backward (activation checkpointing)
    activation_bytes: float = 0.0  # a micro-batch's at their peak, 0 unless set (engines/activation_memory.py)
    frozen_parameter_bytes: float = 0.0  # the frozen weights' share of parameter_shard_bytes (LoRA: the base model)

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
        """Shards + optimizer state + gradients + gathered parameters + activations (0 unless set)."""
        return self.parameter_shard_bytes + self.optimizer_state_bytes + self.accumulation_bytes + self.activation_bytes

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
               param_groups: int = 1, frozen_parameters: int = 0) -> PolicyCosts:
    """A DeepSpeed ZeRO stage's costs per window and per process, in :class:`PolicyCosts`' terms (fp32).

    With G = max(groups, ceil(P / bucket)) gradient buckets (each optimizer parameter group is
    reduced and gathered on its own: the train job's decay / no-decay groups make G = 2) and as
    many all-gathers:
    ZeRO-1 all-reduces the full gradient on the boundary only (G calls, P b_p bytes) and holds it
    unsharded in ``.grad`` through the window; ZeRO-2 all-reduces it after every micro-batch (K G
    calls, K P b_p bytes: DeepSpeed's partitioned reduction sends the whole bucket) and keeps only
    its partition (P b_p / W); both all-gather the updated parameter partitions after the step
    (A calls, P b_p bytes) and keep full parameters. The optimizer state is partitioned, ``P (b_o + m) / W`` with
    ``m`` = 4 bytes of float32 master weights, the partition the optimizer updates, a copy of the parameters'
    partition whatever their dtype (ZeRO-1/2's ``single_partition_of_fp32_groups`` in ``stage_1_and_2.py``, a
    clone; ZeRO-3's ``fp32_partitioned_groups_flat`` in ``stage3.py``, whose source reuses the parameters' own
    partition when it is already float32 on the optimizer's device, yet which held a copy in every float32 run
    measured here on CPU: tests/test_deepspeed.py reads it). ZeRO-3 reduce-scatters after every
    micro-batch (K G calls, K P b_p bytes) and holds P b_p / W; its parameter all-gathers depend
    on which parameters stay resident (``stage3_param_persistence_threshold``) and prefetching, so
    they are not predicted (0, said so in ``formulas``; ``comm_is_floor``). Every stage adds one scalar all-reduce on
    the boundary (:data:`ZERO_SCALAR_BYTES`). Source: DeepSpeed 0.19.8's ``stage_1_and_2.py`` and
    ``stage3.py``, checked by counting ``torch.distributed`` calls (tests/test_deepspeed.py).

    ``parameters`` is P_t, the trainable elements (DeepSpeed's optimizer gets those only); ``frozen_parameters``
    the others (a LoRA run's base weights), held whole under ZeRO-1 and 2 and partitioned under ZeRO-3 like
    every module parameter, never reduced and without optimizer state.

    Raises:
        UsageError: unknown stage, W or K below 1.
    """
    if stage not in ZERO_STAGES:
        raise UsageError("--zero_stage", f"unknown stage {stage!r}", f"use one of {list(ZERO_STAGES)}")
    if world_size < 1 or accumulation_steps < 1:
        raise UsageError("--num_processes" if world_size < 1 else "--gradient_accumulation_steps",
                         "must be at least 1", "pass a positive integer")
    P, W, K, b, F = parameters, world_size, accumulation_steps, param_bytes, frozen_parameters
    G = max(param_groups, -(-P // bucket_elements))
    scalar = ZERO_SCALAR_BYTES[stage]
    every = stage != "zero1"  # ZeRO-2 and 3 reduce on every micro-batch
    master = 4  # the float32 partition the optimizer updates (a copy in every stage and dtype measured)
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
        parameter_shard_bytes=(P + F) * b / W if stage == "zero3" else float((P + F) * b),
        frozen_parameter_bytes=F * b / W if stage == "zero3" else float(F * b),
        optimizer_state_bytes=P * (optimizer_bytes + master) / W, gradient_bytes=grads,
        gathered_parameter_bytes=0.0,
        all_reduce_calls=ar_calls, all_reduce_bytes=ar_bytes,
        # ZeRO-1 sums every micro-batch into the full .grad (as no_sync); ZeRO-2 and 3 reduce each one to a partition
        syncs=K if every else 1, held_gradient_adds=0 if every else K - 1, comm_is_floor=stage == "zero3",
        formulas={"all_reduce": ar_f, "reduce_scatter": reduced_f if stage == "zero3" else "0",
                  "all_gather": "not predicted (persistence threshold, prefetch)" if stage == "zero3"
                  else f"A = {G}; P b_p = {P} x {b}",
                  "gradients": "K = 1: nothing between micro-batches" if K < 2 else
                  (f"P b_p = {P} x {b} (full .grad until the boundary)" if stage == "zero1"
                   else f"P b_p / W = {P} x {b} / {W} (the reduced partition)"),
                  "parameters": (f"(P_t + frozen) b_p{' / W' if stage == 'zero3' else ''} = ({P} + {F}) x {b}" if F
                                 else f"P b_p{' / W' if stage == 'zero3' else ''} = {P} x {b}"),
                  "optimizer_state": f"P (b_o + m) / W = {P} x ({optimizer_bytes} + {master}) / {W} (m: float32 "
                                     "master partition)"})


def policy_costs(policy: str, model: ShardedModel, *, world_size: int, accumulation_steps: int, param_bytes: int = 4,
                 compute_bytes: int | None = None, reduce_bytes: int | None = None,
                 optimizer_bytes: int = ADAMW_STATE_BYTES, replicate_size: int = 1,
                 activation_checkpointing: bool = False) -> PolicyCosts:
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
        activation_checkpointing: the blocks recompute in backward: no count changes (the recompute runs inside
            a unit's backward, gathered already; docs/memory.md); ``recompute_forward_fraction`` = P_f / P.

    Raises:
        UsageError: unknown policy, W or K below 1, R not dividing W, or an HSDP-only policy with R = 1.
    """
    if policy in ZERO_STAGES:
        return zero_costs(policy, model.trainable_parameters, world_size=world_size,
                          accumulation_steps=accumulation_steps, param_bytes=param_bytes,
                          optimizer_bytes=optimizer_bytes, frozen_parameters=model.frozen_parameters)
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
    Uf, U0 = len(model.resharded), len(model.kept)
    # reductions, gradients and optimizer state: the trainable parameters and the units holding one (all, unless
    # some are frozen: then the symbols read P_t and U_t)
    T, U = model.trainable_parameters, model.trainable_units
    tP, tU = ("P", "U") if model.trainable is None else ("P_t", "U_t")
    p = POLICIES[policy]
    if p.sync_each_batch or p.hsdp_only:
        rs_calls, rs_bytes, rs_f = K * U, K * T * b_r, f"K {tU} = {K} x {U}; K {tP} b_r = {K} x {T} x {b_r}"
    else:
        rs_calls, rs_bytes, rs_f = U, T * b_r, f"{tU} = {U}; {tP} b_r = {T} x {b_r}"
    if S == 1:  # replicated only (DDP): no reduce-scatter, no all-gather
        rs_calls, rs_bytes, rs_f = 0, 0, "0 (S = 1: nothing sharded)"
    syncs = K if p.sync_each_batch else 1  # micro-batches whose gradient is reduced across all W
    if R < 2:
        ar_calls, ar_bytes, ar_f = 0, 0.0, "0 (no replicate group)"
    elif S == 1:  # DDP: the whole gradient once per synchronised backward, in buckets that are not the units
        ar_calls, ar_bytes = syncs, syncs * T * b_r
        ar_f = (f"K = {K}; K {tP} b_r = {K} x {T} x {b_r}" if p.sync_each_batch else
                f"1; {tP} b_r = {T} x {b_r}") + " (DDP: once per synchronised backward)"
    elif p.sync_each_batch:
        ar_calls, ar_bytes = K * U, K * T * b_r / S
        ar_f = f"K {tU} = {K} x {U}; K {tP} b_r / S = {K} x {T} x {b_r} / {S}"
    else:
        ar_calls, ar_bytes, ar_f = U, T * b_r / S, f"{tU} = {U}; {tP} b_r / S = {T} x {b_r} / {S}"
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
        grads, grads_f = T * b_p / S, f"{tP} b_p / {'S' if R > 1 else 'W'} = {T} x {b_p} / {S} (sharded)"
    elif p.hsdp_only:
        grads = T * b_r / S
        grads_f = f"{tP} b_r / S = {T} x {b_r} / {S} (reduce-scattered, summed until the all-reduce)"
    else:
        grads, grads_f = float(T * b_r), f"{tP} b_r = {T} x {b_r} (unsharded until the boundary)"
    shard = "S" if R > 1 else "W"
    # the window holds the whole gradient (DDP always; the no_sync policies): every micro-batch after the first adds
    holds_whole = S == 1 or not (p.sync_each_batch or p.hsdp_only)
    kept = between and p.keep_params_after_backward
    gathered = float(P * b_c) if kept else 0.0
    gathered_f = f"P b_c = {P} x {b_c}" if kept else "0 (resharded after every backward)"
    return PolicyCosts(
        policy=policy, world_size=W, accumulation_steps=K,
        reduce_scatter_calls=rs_calls, reduce_scatter_bytes=rs_bytes,
        all_gather_calls=ag_calls, all_gather_bytes=ag_bytes,
        parameter_shard_bytes=P * b_p / S, optimizer_state_bytes=T * optimizer_bytes / S,
        frozen_parameter_bytes=(P - T) * b_p / S,
        gradient_bytes=grads, gathered_parameter_bytes=gathered,
        formulas={"reduce_scatter": rs_f, "all_gather": ag_f, **({"all_reduce": ar_f} if R > 1 else {}),
                  "parameter_shards": f"P b_p / {shard} = {P} x {b_p} / {S}" + (
                      f" (frozen: {P - T} of them)" if T != P else ""),
                  "optimizer_state": f"{tP} b_o / {shard} = {T} x {optimizer_bytes} / {S}", "gradients": grads_f,
                  "gathered_parameters": gathered_f},
        replicate_size=R, all_reduce_calls=ar_calls, all_reduce_bytes=ar_bytes,
        syncs=syncs, held_gradient_adds=K - 1 if holds_whole else 0,
        recompute_forward_fraction=model.recompute_forward_fraction if activation_checkpointing else 0.0,
    )


def comm_seconds(costs: PolicyCosts, *, shard_GBps: float | None = None, all_gather_GBps: float | None = None,
                 replicate_GBps: float | None = None) -> dict:
    """Seconds per window of each group's collectives of ``costs`` (on the wire; how much of it is exposed is
    the step-time model's overlap, :mod:`accum_kit.planning.step_time`).

    Each collective: :func:`collective_seconds` of its bytes over its group (reduce-scatters and all-gathers:
    the shard group S; all-reduces: :attr:`PolicyCosts.all_reduce_group_size`).

    Args:
        costs: :func:`policy_costs` of one policy on one mesh (R x S).
        shard_GBps: bus bandwidth of the shard group's reduce-scatters (and all-gathers unless
            ``all_gather_GBps`` is given), GB/s.
        replicate_GBps: bus bandwidth of the all-reduces (across replicas under HSDP and DDP, over all W
            processes under ZeRO), GB/s; None: ``shard_GBps``.

    Returns:
        ``{"reduce_scatter": s, "all_gather": s, "all_reduce": s, "total": s}``.

    Raises:
        ValueError: bytes of a collective to price and no bus bandwidth for it.
    """
    def priced(n_bytes: float, group: int, GBps: float | None, kind: str) -> float:
        if not n_bytes:
            return 0.0
        if GBps is None:
            raise ValueError(f"{n_bytes} bytes of {kind} per window and no bus bandwidth to price them")
        return collective_seconds(n_bytes, group, GBps, kind)

    S, n_ar = costs.shard_size, costs.all_reduce_group_size
    rs = priced(costs.reduce_scatter_bytes, S, shard_GBps, "reduce_scatter")
    ag = priced(costs.all_gather_bytes, S, all_gather_GBps or shard_GBps, "all_gather")
    ar = priced(costs.all_reduce_bytes, n_ar, replicate_GBps or shard_GBps, "all_reduce")
    return {"reduce_scatter": rs, "all_gather": ag, "all_reduce": ar, "total": rs + ag + ar}


#: The accumulation policies that exist under DDP (the FSDP2 ones keep or free gathered parameters, which DDP never
#: has, or defer an all-reduce across replicas, which DDP has not got).
DDP_POLICIES = tuple(name for name, p in POLICIES.items() if not p.fsdp_only)


def ddp_costs(policy: str, *, world_size: int, accumulation_steps: int, gradient_bytes: float,
              reduce_bytes: int = 4, frozen_parameters: int = 0) -> PolicyCosts:
    """The table's row of ``policy`` under DDP, R = W replicas of S = 1 process, from the gradient's bytes alone.

    DDP needs no unit structure: the whole gradient (one unit here) is all-reduced once per synchronised
    backward, so ``all_reduce_calls`` are syncs per window (K with ``sync_each_batch``, 1 with ``no_sync``)
    and ``all_reduce_bytes`` the bytes they carry; the what-if planner (``plan --from_profile``), the bench's
    ideal and the DDP rows of ``plan --fsdp``'s engine comparison all read DDP from here.

    Args:
        policy: ``sync_each_batch`` or ``no_sync`` (:data:`DDP_POLICIES`).
        world_size: W, processes (at least 1; with 1 nothing is all-reduced).
        accumulation_steps: K, micro-batches per window.
        gradient_bytes: bytes all-reduced per synchronised backward (the whole gradient, all buckets together).
        reduce_bytes: bytes per gradient element (4: fp32).
        frozen_parameters: elements that get no gradient (a LoRA run's base weights): held as parameters by every
            process, never all-reduced, no optimizer state (0: full fine-tuning).

    Raises:
        UsageError: a policy DDP does not have, or W / K below 1.
    """
    if policy not in DDP_POLICIES:
        raise UsageError("--accumulation_policy", f"{policy!r} is not a DDP policy", f"use one of {list(DDP_POLICIES)}")
    trained = gradient_bytes / reduce_bytes
    model = ShardedModel((), (trained + frozen_parameters,), "DDP: the whole gradient, all-reduced per sync",
                         (trained,) if frozen_parameters else None)
    return policy_costs(policy, model, world_size=world_size, accumulation_steps=accumulation_steps,
                        param_bytes=reduce_bytes, replicate_size=world_size)


def syncs_per_window(policy: str, accumulation_steps: int) -> int:
    """Synchronised backwards per window of K micro-batches under DDP: the table's ``syncs`` (K or 1)."""
    return ddp_costs(policy, world_size=2, accumulation_steps=accumulation_steps, gradient_bytes=4).syncs


# Names this module held before bandwidth and units got modules of their own; kept for their importers.
from .bandwidth import (GB, BUSBW_FACTORS, algorithm_bandwidth, all_reduce_seconds, bus_bandwidth,  # noqa: E402,F401
                        busbw_factor)
from .model_units import DTYPE_BYTES, dtype_bytes, gpt2_units, gpt2_units_for  # noqa: E402,F401
