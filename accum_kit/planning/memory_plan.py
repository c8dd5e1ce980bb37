"""``accum-kit plan --memory_per_process``: the (micro-batch, K, checkpointing, policy) rows that fit, and the fastest.

Given the memory per process, a target effective batch E (examples per optimizer step over all W
processes), the model (a train-job preset, ``--block_size`` s tokens) and W, every row has
``b x K x W = E``: b runs over the divisors of E / W, checkpointing off and on, and every engine's
policies on W processes of one machine (:func:`accum_kit.engines.engine_layouts.engine_layouts`: DDP's, and with
two processes or more FSDP2's four and DeepSpeed's ZeRO stages). For each row:

- peak memory per process: :func:`accum_kit.engines.activation_memory.peak_parts` of the cost table's row
  (:func:`accum_kit.engines.costs.policy_costs`: parameters, gradients, optimizer state, gathered
  parameters), the engine's communication buffers (DDP's buckets, a copy of the gradient; FSDP2's units in
  flight) and one micro-batch's activations (:func:`accum_kit.engines.activation_memory.activation_bytes`),
  plus ``--baseline_memory`` (what the process holds besides: on CPU Python and the libraries, about
  0.5 GB; on a GPU the CUDA context is outside ``max_memory_allocated``);
- step time: the one step-time model (:func:`accum_kit.planning.step_time.step_time`) with the row's
  costs (checkpointing sets the table's ``recompute_forward_fraction``: one more forward of the blocks),
  c from the compute per token: ``--from_profile``'s measured compute per micro-batch over its tokens,
  else the model's FLOPs per token at ``--compute_TFLOPS`` (Narayanan et al. 2021, "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", eq. 3 without recomputation:
  ``72 s L h^2 (1 + s / (6 h) + V / (12 L h))`` per example), and communication at ``--busbw_GBps`` /
  ``--interconnect`` (unpriced when neither is given: said in the notes).

With ``--lora_r`` (and ``--lora_target_modules``, ``--lora_dropout``: the train job's flags) the rows price a
LoRA run: every weight frozen and held (or its shards), adapters on the blocks' layers the only trainable
parameters, so gradients, optimizer state, DDP's buckets and every reduction count the adapters only
(:class:`accum_kit.engines.model_units.ShardedModel`'s ``trainable``), FSDP2 still gathers every weight, and
the activations are the adapted model's (:meth:`accum_kit.engines.activation_memory.TransformerShape.with_lora`).

The recommendation is the fastest row that fits (ties: the smaller peak; a row whose step time is only a
lower bound, ZeRO-3's, only when no other fits). None fits: UsageError naming
``--memory_per_process`` and the memory the smallest row needs.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

from ..engines.activation_memory import TransformerShape, activation_bytes, peak_parts, sharded_buffer_bytes
from ..engines.costs import ZERO_STAGES, policy_costs
from ..engines.engine_layouts import engine_layouts
from ..engines.model_units import PRESETS, dtype_bytes, gpt2_units, with_lora
from ..engines.policies import POLICIES
from ..errors import UsageError
from .step_time import BusBandwidths, MeasuredCommunication, step_time

UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9}
SIZE_FIX = "pass a size such as 8GB, 8GiB, 512MB or a number of bytes"
#: Default FLOP rate when neither a profile nor --compute_TFLOPS is given (the ranking holds; the seconds scale).
DEFAULT_TFLOPS = 1.0


def parse_size(flag: str, text, *, allow_zero: bool = False) -> int:
    """Bytes of ``8GB`` (1e9), ``8GiB`` (2^30), ``512MB``, ``1.5G`` or a plain number of bytes.

    Raises:
        UsageError: not a size, negative, or 0 (unless ``allow_zero``), naming ``flag``.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise UsageError(flag, f"cannot read {text!r} as a size", SIZE_FIX)
    value = float(m.group(1)) * UNITS[m.group(2).lower()]
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(flag, f"must be more than 0 bytes (got {text!r})", SIZE_FIX)
    return int(value)


def flops_per_example(shape: TransformerShape, seq: int) -> float:
    """Forward + backward FLOPs of one example of ``seq`` tokens (Narayanan et al. 2021, eq. 3, no recompute)."""
    L, h, V = shape.layers, shape.hidden, shape.vocab
    return 72 * seq * L * h * h * (1 + seq / (6 * h) + V / (12 * L * h))


@dataclass(frozen=True)
class MemoryRow:
    """One feasible-or-not configuration: engine, policy, b, K, checkpointing; peak by part (bytes); seconds."""

    engine: str
    policy: str
    micro_batch: int
    accumulation_steps: int
    checkpointing: bool
    peak_bytes: float
    parts: dict
    step_seconds: float
    compute_seconds: float
    exposed_comm_seconds: float
    fits: bool
    step_is_floor: bool = False  # some collectives not predicted (ZeRO-3's parameter all-gathers)


@dataclass(frozen=True)
class MemoryPlan:
    """The rows (sorted fitting first, fastest first), the recommended one, the inputs, and notes."""

    memory_per_process: int
    target_effective_batch: int
    num_processes: int
    model: str
    block_size: int
    rows: list
    recommended: MemoryRow
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _buffers(units, policy: str, shard_size: int, world: int, b_c: int, b_r: int) -> float:
    """The engine's communication buffers at the peak: a replicated-only mesh (DDP, R = W > 1) keeps its
    reducer's buckets, a copy of the gradient; FSDP2's units in flight (:func:`sharded_buffer_bytes`); ZeRO's
    buckets are not counted."""
    if shard_size == 1:  # DDP's buckets hold the gradients: the trainable parameters'
        return float(units.trainable_parameters * b_r) if world > 1 else 0.0
    if policy not in POLICIES:
        return 0.0
    p = POLICIES[policy]
    return sharded_buffer_bytes(max((*units.resharded, *units.kept)), b_c, b_r,
                                keeps_gathered=p.reshard_after_forward is False,
                                reduces_each_micro_batch=p.sync_each_batch or p.hsdp_only,
                                largest_trainable_unit=units.largest_trainable_unit)


def plan_by_memory(memory_per_process, target_effective_batch: int, *, model_preset: str, block_size: int,
                   num_processes: int = 1, vocab_size: int = 384, baseline_memory=0, mixed_precision: str = "no",
                   compute_TFLOPS: float | None = None, profile=None, busbw_GBps: float | None = None,
                   fused_linear_cross_entropy: str = "auto", lora_r: int | None = None, lora_target_modules=None,
                   lora_dropout: float = 0.0) -> MemoryPlan:
    """The plan of the module docstring.

    Args:
        memory_per_process: bytes, or a size string (:func:`parse_size`; ``--memory_per_process``).
        target_effective_batch: E, examples per optimizer step over all processes.
        model_preset: a GPT-2 preset of the train job; block_size: s, tokens per example; vocab_size: V.
        num_processes: W.
        baseline_memory: bytes (or a size string) each process holds besides the model and training.
        mixed_precision: ``no``, ``bf16`` or ``fp16`` (16-bit activations and gathered parameters).
        compute_TFLOPS: achieved FLOP rate for c when no profile is given (default :data:`DEFAULT_TFLOPS`).
        profile: a :class:`accum_kit.planning.measured_profile.MeasuredProfile` (DDP) for c per token.
        busbw_GBps: bus bandwidth of the collectives, GB/s (None: communication unpriced).
        fused_linear_cross_entropy: the train job's flag: anything but ``off`` prices the head as the loss computed
            in the output layer in chunks (the presets' output layer allows it), ``off`` as the full logits.
        lora_r: price a LoRA run with adapters of this rank (None: full fine-tuning); lora_target_modules: the
            GPT-2 block layers adapted (None: ``c_attn``, peft's default; ``all-linear``); lora_dropout: on the
            adapters' input.

    Raises:
        UsageError: a bad size, E not divisible by W, E or W or s below 1, a rank below 1 or a target that is
            no block layer, or no row fits.
    """
    memory = parse_size("--memory_per_process", memory_per_process) if isinstance(memory_per_process, str) \
        else memory_per_process
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory <= 0:
        raise UsageError("--memory_per_process", f"must be more than 0 bytes (got {memory_per_process!r})", SIZE_FIX)
    baseline = parse_size("--baseline_memory", baseline_memory, allow_zero=True) if isinstance(baseline_memory, str) \
        else baseline_memory
    for flag, v in (("--target_effective_batch", target_effective_batch), ("--num_processes", num_processes),
                    ("--block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(flag, f"must be a positive integer (got {v!r})", "pass a positive integer")
    if target_effective_batch % num_processes:
        raise UsageError("--target_effective_batch", f"{target_effective_batch} examples do not split over "
                         f"{num_processes} processes", f"pass a multiple of {num_processes}")
    b_p, b_c, b_r = dtype_bytes(mixed_precision)
    shape = TransformerShape.from_preset(model_preset, vocab_size, element_bytes=b_c).with_loss(
        "logits" if fused_linear_cross_entropy == "off" else "fused")
    units = gpt2_units(model_preset, vocab_size, block_size)
    W, E, s = num_processes, target_effective_batch, block_size
    lora_note = []
    if lora_r is not None:
        if isinstance(lora_r, bool) or not isinstance(lora_r, int) or lora_r < 1:
            raise UsageError("--lora_r", f"must be a rank of 1 or more (got {lora_r!r})", "pass e.g. --lora_r 8")
        cfg = PRESETS[model_preset]
        units = with_lora(units, cfg["n_layer"], cfg["n_embd"], lora_r, lora_target_modules)
        shape = shape.with_lora(lora_r, lora_target_modules, lora_dropout)
        lora_note = [f"LoRA: {units.trainable_parameters} trainable of {units.parameters} parameters "
                     f"({units.source.split('; ')[-1]}); gradients, optimizer state and reductions count the "
                     "adapters, parameters and FSDP2's gathers every weight"]
    notes = lora_note + [f"loss: {'the full logits (--fused_linear_cross_entropy off)' if shape.loss == 'logits' else 'computed in the output layer in chunks of tokens (--fused_linear_cross_entropy; off: the full logits)'}"]
    if profile is not None:
        per_token = profile.compute_seconds / ((profile.per_device_train_batch_size or 1) * (profile.block_size or s))
        notes.append(f"c: {profile.path}'s compute per micro-batch over its tokens, {per_token * 1e3:.4g} ms per token")
    else:
        rate = (compute_TFLOPS or DEFAULT_TFLOPS) * 1e12
        per_token = flops_per_example(shape, s) / s / rate
        notes.append(f"c: {flops_per_example(shape, s):.3g} FLOPs per example (Narayanan et al. 2021) at "
                     f"{rate / 1e12:g} TFLOP/s" + ("" if compute_TFLOPS else " (default; pass --compute_TFLOPS)"))
    pricing = BusBandwidths(busbw_GBps, None, busbw_GBps) if busbw_GBps else MeasuredCommunication(0.0)
    if W > 1 and not busbw_GBps:
        notes.append("communication not priced: pass --busbw_GBps or --interconnect")
    rows = []
    per_process = E // W
    layouts = [lay for lay in engine_layouts(W, 1) if W > 1 or lay.engine == "DDP"]  # one process: no sharding
    for b in [d for d in range(1, per_process + 1) if per_process % d == 0]:
        K = per_process // b
        for layout in layouts:
            for policy in layout.policies:
                buffers = _buffers(units, policy, layout.shard_size, W, b_c, b_r)
                kw = dict(world_size=W, param_bytes=b_p, compute_bytes=b_c, reduce_bytes=b_r,
                          replicate_size=layout.replicate_size)
                costs = policy_costs(policy, units, accumulation_steps=K, **kw)
                # a window of one still holds its gradients during the backward
                row_mem = policy_costs(policy, units, accumulation_steps=max(K, 2), **kw)
                for ckpt in (False, True):
                    acts = activation_bytes(shape, b, s, checkpointing=ckpt)
                    parts = peak_parts(row_mem.to_dict(), acts, baseline + row_mem.parameter_shard_bytes, buffers)
                    row_costs = replace(costs, activation_bytes=acts.total, recompute_forward_fraction=(
                        units.recompute_forward_fraction if ckpt else 0.0))
                    t = step_time(row_costs, per_token * b * s, pricing)
                    rows.append(MemoryRow(layout.engine, policy, b, K, ckpt, parts["total"], parts, t.seconds,
                                          t.compute_seconds, t.exposed_seconds, parts["total"] <= memory,
                                          costs.comm_is_floor))
    fitting = [r for r in rows if r.fits]
    if not fitting:
        least = min(rows, key=lambda r: r.peak_bytes)
        raise UsageError("--memory_per_process", f"no (micro-batch, K, checkpointing, policy) fits in "
                         f"{memory / 1e9:.3g} GB per process: the smallest row ({least.engine} {least.policy}, "
                         f"micro-batch {least.micro_batch}, K {least.accumulation_steps}, checkpointing "
                         f"{'on' if least.checkpointing else 'off'}) needs {least.peak_bytes / 1e9:.3g} GB",
                         f"pass --memory_per_process {least.peak_bytes / 1e9:.3g}GB or more, more --num_processes, "
                         "or a smaller --block_size or model")
    key = lambda r: (not r.fits, r.step_is_floor, r.step_seconds, r.peak_bytes)  # noqa: E731
    rows.sort(key=key)
    return MemoryPlan(memory, E, W, model_preset, s, rows, rows[0], notes)


def format_memory_plan(plan: MemoryPlan, limit: int = 40) -> str:
    """The text table: fitting rows first, fastest first (at most ``limit`` rows), then the recommendation."""
    GBf = lambda x: f"{x / 1e9:.3f}"  # noqa: E731
    lines = [f"Plan by memory: {plan.model}, block {plan.block_size}, {plan.num_processes} processes, target "
             f"{plan.target_effective_batch} examples per step, {GBf(plan.memory_per_process)} GB per process",
             f"{'engine':9} {'policy':34} {'b':>4} {'K':>4} {'ckpt':4} {'peak GB':>8} {'activ. GB':>9} "
             f"{'step s':>9} {'fits':4}"]
    for r in plan.rows[:limit]:
        lines.append(f"{r.engine:9} {r.policy:34} {r.micro_batch:4d} {r.accumulation_steps:4d} "
                     f"{'on' if r.checkpointing else 'off':4} {GBf(r.peak_bytes):>8} "
                     f"{GBf(r.parts['activations'] + r.parts['logits']):>9} {r.step_seconds:9.4g}"
                     f"{'+' if r.step_is_floor else ' '}{'yes' if r.fits else 'no':4}")
    if len(plan.rows) > limit:
        lines.append(f"... {len(plan.rows) - limit} more rows (--json lists all)")
    r = plan.recommended
    how = (f"ZeRO stage {r.policy[-1]} (zero_stage in the accelerate config)" if r.policy in ZERO_STAGES
           else f"--accumulation_policy {r.policy}")
    lines.append(f"recommended: {r.engine} {how} --per_device_train_batch_size "
                 f"{r.micro_batch} --gradient_accumulation_steps {r.accumulation_steps}"
                 f"{' --gradient_checkpointing' if r.checkpointing else ''} (peak {GBf(r.peak_bytes)} GB, "
                 f"step {r.step_seconds:.4g} s)")
    lines += [f"  note: {n}" for n in plan.notes]
    if any(r.step_is_floor for r in plan.rows):
        lines.append("  note: +: a lower bound (ZeRO-3's parameter all-gathers are not predicted); such rows are "
                     "recommended only when no other fits")
    return "\n".join(lines)


MEMORY_ONLY = ("target_effective_batch", "baseline_memory", "compute_TFLOPS", "fused_linear_cross_entropy", "lora_r",
               "lora_target_modules", "lora_dropout")


def check_memory_flags(args) -> bool:
    """``plan``'s flag check for the memory plan: True when ``--memory_per_process`` asks for it (its flags checked
    here), False otherwise (then none of its own flags may be given).

    Raises:
        UsageError: a memory-plan flag without ``--memory_per_process``; a bad size; a missing
            ``--target_effective_batch`` or ``--model_preset``; a value out of range.
    """
    if args.memory_per_process is None:
        for name in MEMORY_ONLY:
            if getattr(args, name) is not None:
                raise UsageError(f"--{name}", "only used when planning by memory", "pass --memory_per_process too")
        return False
    parse_size("--memory_per_process", args.memory_per_process)
    if args.baseline_memory is not None:
        parse_size("--baseline_memory", args.baseline_memory, allow_zero=True)
    for flag in ("target_effective_batch", "model_preset"):
        if getattr(args, flag) is None:
            raise UsageError(f"--{flag}", "the plan by memory needs it", f"pass --{flag}")
    if args.fused_linear_cross_entropy is not None:
        from .. import checks

        checks.one_of("--fused_linear_cross_entropy", args.fused_linear_cross_entropy, ("auto", "chunked", "torch", "off"))
    if args.compute_TFLOPS is not None and not args.compute_TFLOPS > 0:
        raise UsageError("--compute_TFLOPS", f"must be more than 0 (got {args.compute_TFLOPS})", "pass e.g. 100")
    plan_by_memory(args.memory_per_process, args.target_effective_batch, model_preset=args.model_preset,
                   block_size=args.block_size or 128, num_processes=args.num_processes or 1, vocab_size=args.vocab_size,
                   baseline_memory=args.baseline_memory or 0, mixed_precision=args.mixed_precision,
                   compute_TFLOPS=args.compute_TFLOPS,
                   fused_linear_cross_entropy=args.fused_linear_cross_entropy or "auto",
                   **_lora_kwargs(args))  # every other check, none fits
    return True


def memory_plan_of(args) -> MemoryPlan:
    """:func:`plan_by_memory` from ``plan``'s flags (``--from_profile``: a DDP profile for c; ``--busbw_GBps`` or
    ``--interconnect``'s nominal bus bandwidth for the collectives)."""
    from .interconnects import INTERCONNECTS
    from .measured_profile import load_profile

    profile = load_profile(args.from_profile, "all_reduce") if args.from_profile else None
    busbw = args.busbw_GBps or (INTERCONNECTS[args.interconnect][0] if args.interconnect else None)
    if busbw is None and profile is not None:
        busbw = profile.busbw_GBps
    return plan_by_memory(args.memory_per_process, args.target_effective_batch, model_preset=args.model_preset,
                          block_size=args.block_size or 128, num_processes=args.num_processes or 1,
                          vocab_size=args.vocab_size, baseline_memory=args.baseline_memory or 0,
                          mixed_precision=args.mixed_precision, compute_TFLOPS=args.compute_TFLOPS, profile=profile,
                          busbw_GBps=busbw, fused_linear_cross_entropy=args.fused_linear_cross_entropy or "auto",
                          **_lora_kwargs(args))


def _lora_kwargs(args) -> dict:
    """:func:`plan_by_memory`'s LoRA arguments from ``plan``'s flags.

    Raises:
        UsageError: ``--lora_target_modules`` or ``--lora_dropout`` without ``--lora_r``; a dropout outside [0, 1).
    """
    for name in ("lora_target_modules", "lora_dropout"):
        if getattr(args, name) is not None and args.lora_r is None:
            raise UsageError(f"--{name}", "prices LoRA adapters, but --lora_r is not given", "pass --lora_r too")
    dropout = args.lora_dropout or 0.0
    if not 0 <= dropout < 1:
        raise UsageError("--lora_dropout", f"must be in [0, 1) (got {dropout})", "pass e.g. 0 or 0.05")
    return {"lora_r": args.lora_r, "lora_target_modules": args.lora_target_modules, "lora_dropout": dropout}
