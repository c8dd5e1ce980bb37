"""``accum-kit plan --tp_size T --cp_size C``: data parallel only next to dp x tp and dp x cp, from the cost table.

On ``--num_processes`` W processes (``--parallelism_config_dp_replicate_size`` R replicas) the plan
sets side by side the layouts :func:`accum_kit.engines.mesh_costs.layout_meshes` gives (data parallel
only ``R x W/R``; dp x tp ``R x W/(R T) x 1 x T``; dp x cp ``R x W/(R C) x C x 1``; with both, dp x cp
x tp), each priced by :func:`accum_kit.engines.mesh_costs.mesh_costs` for one accumulation policy:
memory per process (parameters, gradients, optimizer state, gathered parameters, one micro-batch's
activations) and collectives per window in each group (calls and bytes). Every layout runs the same
micro-batch (``--per_device_train_batch_size`` examples of ``--block_size`` tokens) per
data-parallel rank and the same K, so examples per optimizer step fall as tp and cp take processes
from data parallelism: the plan prints them. Seconds are not priced. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tabulate import tabulate

from .. import checks
from ..core.settings import resolve_accumulation_steps
from ..engines.mesh_costs import MESH_PRESETS, MeshCosts, dense_transformer, layout_meshes, mesh_costs
from ..engines.model_units import dtype_bytes
from ..engines.policies import DEFAULT_POLICY, POLICIES
from ..errors import UsageError

#: The flags only the mesh plan reads -> the problem when one comes without ``--tp_size`` / ``--cp_size``.
MESH_FLAGS = {
    "--config_name": "only used when planning a tp / cp mesh",
    "--accumulation_policy": "only used when planning a tp / cp mesh",
}
#: Flags of other plans that the mesh plan does not read (refused with it rather than silently ignored).
NOT_WITH_MESH = ("memory_per_process", "from_profile", "compare_bench", "target_batch_size", "accumulation_schedule",
                 "num_parameters", "num_layers", "gpu_memory_GB", "free_memory_GB", "base_learning_rate",
                 "num_examples")
MESH_FIX = "drop it, or plan the mesh in a separate `accum-kit plan --tp_size ...` call"


@dataclass(frozen=True)
class MeshPlan:
    """The comparison: the model, the inputs, one :class:`MeshCosts` per layout (by name), and notes."""

    model: dict
    num_processes: int
    policy: str
    accumulation_steps: int
    micro_batch: int
    block_size: int
    mixed_precision: str
    layouts: dict
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"model": self.model, "num_processes": self.num_processes, "policy": self.policy,
                "accumulation_steps": self.accumulation_steps, "micro_batch": self.micro_batch,
                "block_size": self.block_size, "mixed_precision": self.mixed_precision,
                "layouts": {k: v.to_dict() for k, v in self.layouts.items()}, "notes": list(self.notes)}


def plan_mesh(*, num_processes: int, tp_size: int = 1, cp_size: int = 1, replicate_size: int = 1,
              model_preset: str | None = None, config_name: str | None = None, vocab_size: int = 384,
              per_device_train_batch_size: int = 1, block_size: int | None = None,
              gradient_accumulation_steps: int | None = None, mixed_precision: str = "no",
              accumulation_policy: str | None = None) -> MeshPlan:
    """The comparison of the module docstring, from keywords named like the flags.

    Args:
        num_processes: W. tp_size, cp_size: T, C. replicate_size: R (HSDP's replicas; 1: plain FSDP2).
        model_preset / config_name: the model (:func:`accum_kit.engines.mesh_costs.dense_transformer`).
        per_device_train_batch_size: b, examples per micro-batch per data-parallel rank.
        block_size: s, tokens per example (required). gradient_accumulation_steps: K (None: the train job's rule).
        mixed_precision: ``no`` or ``bf16`` / ``fp16`` (16-bit activations, gathers and tp / cp collectives).
        accumulation_policy: a policy of :data:`accum_kit.engines.policies.POLICIES` (None: ``no_sync``).

    Raises:
        UsageError: naming the flag: sizes below 1, T C R not dividing W, T not dividing the heads, C not
            dividing the heads per tp rank or s, no model or an unknown one, no ``--block_size``, a policy
            that needs replicas without them.
    """
    for flag, v in (("--num_processes", num_processes), ("--tp_size", tp_size), ("--cp_size", cp_size),
                    ("--parallelism_config_dp_replicate_size", replicate_size),
                    ("--per_device_train_batch_size", per_device_train_batch_size)):
        checks.at_least(flag, v)
    if block_size is None:
        raise UsageError("--block_size", "the mesh plan needs the sequence length (cp splits it; activations and "
                         "tp / cp collectives scale with it)", "pass --block_size, e.g. 4096")
    checks.at_least("--block_size", block_size)
    policy = accumulation_policy or DEFAULT_POLICY
    if policy not in POLICIES:
        raise UsageError("--accumulation_policy", f"unknown policy {policy!r}", f"use one of {list(POLICIES)}")
    model = dense_transformer(model_preset, config_name, vocab_size)
    K = resolve_accumulation_steps(gradient_accumulation_steps)
    b_p, b_c, b_r = dtype_bytes(mixed_precision)
    layouts = {name: mesh_costs(model, mesh, policy=policy, accumulation_steps=K,
                                micro_batch=per_device_train_batch_size, seq=block_size, param_bytes=b_p,
                                compute_bytes=b_c, reduce_bytes=b_r, fused=True)
               for name, mesh in layout_meshes(num_processes, replicate_size, tp_size, cp_size).items()}
    notes = [f"every layout: {per_device_train_batch_size} x {block_size} tokens per micro-batch per data-parallel "
             f"rank, K = {K}; tp and cp ranks share their data-parallel rank's micro-batch"]
    notes.append("loss: without tp computed in the output layer in chunks (the train job's default); under tp from "
                 "the gathered float32 logits (a vocabulary-split output layer cannot compute it)")
    if num_processes < 2:
        notes.append("1 process: nothing to shard or communicate")
    notes += sorted({e for c in layouts.values() for e in c.estimates})
    return MeshPlan(model={"layers": model.layers, "hidden": model.hidden, "heads": model.heads,
                           "kv_heads": model.kv_heads, "ffn": model.ffn, "vocab": model.vocab, "tied": model.tied,
                           "parameters": model.parameters, "source": model.source},
                    num_processes=num_processes, policy=policy, accumulation_steps=K,
                    micro_batch=per_device_train_batch_size, block_size=block_size,
                    mixed_precision=mixed_precision, layouts=layouts, notes=notes)


#: The collectives' rows: (label, group prefix, kind, which of the kind in that group: 0 first, 1 second).
_ROWS = (("all-gather (FSDP)", "fsdp", "all_gather", 0),
         ("reduce-scatter (FSDP)", "fsdp", "reduce_scatter", 0),
         ("all-reduce (across replicas)", "dp_replicate", "all_reduce", 0),
         ("tp all-reduce, forward", "tp", "all_reduce", 0),
         ("tp all-gather, forward (logits)", "tp", "all_gather", 0),
         ("tp all-reduce, backward", "tp", "all_reduce", 1),
         ("cp all-to-all, fwd + bwd", "cp", "all_to_all", 0))


def _cell(costs: MeshCosts, group: str, kind: str, nth: int) -> str:
    found = [c for c in costs.collectives if c.group.startswith(group) and c.kind == kind]
    if len(found) <= nth:
        return "-"
    c = found[nth]
    return f"{c.calls} / {c.bytes / 1e9:.4g} GB (of {c.group_size})"


def format_mesh_plan(plan: MeshPlan) -> str:
    """The side-by-side text table: memory per process (GB), then collectives per window (calls / GB of
    nccl-tests' S, group size), then what ``no_sync`` saves and the notes."""
    m, names = plan.model, list(plan.layouts)
    GB = lambda x: f"{x / 1e9:.4g}"  # noqa: E731
    cols = list(plan.layouts.values())
    rows = [["mesh R x S x cp x tp"] + ["{dp_replicate_size} x {dp_shard_size} x {cp_size} x {tp_size}".format(**c.mesh)
                                         for c in cols],
            ["examples per optimizer step"] + [str(c.micro_batch * c.accumulation_steps * c.mesh["dp_replicate_size"]
                                                   * c.mesh["dp_shard_size"]) for c in cols],
            ["tokens per process per micro-batch"] + [str(c.tokens_per_process) for c in cols],
            ["memory per process, GB", *([""] * len(cols))]]
    for part in ("parameters", "gradients", "optimizer_state", "gathered_parameters", "activations", "total"):
        rows.append([f"- {part.replace('_', ' ')}"] + [GB(c.memory[part]) for c in cols])
    rows.append(["collectives per window, calls / bytes", *([""] * len(cols))])
    for label, group, kind, nth in _ROWS:
        cells = [_cell(c, group, kind, nth) for c in cols]
        if any(x != "-" for x in cells):
            rows.append([f"- {label}"] + cells)
    lines = [f"Mesh plan: {m['source']} (L {m['layers']}, h {m['hidden']}, heads {m['heads']}, kv heads "
             f"{m['kv_heads']}, ffn {m['ffn']}, V {m['vocab']}; {m['parameters'] / 1e9:.4g} B parameters), "
             f"{plan.num_processes} processes, policy {plan.policy}, K {plan.accumulation_steps}, micro-batch "
             f"{plan.micro_batch} x {plan.block_size} tokens, mixed precision {plan.mixed_precision}",
             tabulate(rows, headers=["", *names], tablefmt="simple", disable_numparse=True)]
    for name, c in plan.layouts.items():
        if c.no_sync_saves:
            dp = {g: v for g, v in c.no_sync_saves.items() if g.startswith(("fsdp", "dp_replicate"))}
            stay = sum(x.bytes for x in c.collectives if x.per_micro_batch)
            lines.append(f"no_sync vs sync_each_batch, {name}: saves the data-parallel part only, "
                         + ", ".join(f"{GB(v)} GB in {g}" for g, v in dp.items())
                         + (f"; tp / cp's {GB(stay)} GB per window run on every micro-batch and stay" if stay else ""))
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def check_mesh_flags(args) -> bool:
    """``plan``'s flag check for the mesh plan: True when ``--tp_size`` or ``--cp_size`` asks for it (its flags
    checked here, and the plan built once so that every bad value exits 2 before anything prints), False
    otherwise (then none of its own flags may be given).

    Raises:
        UsageError: a mesh-plan flag without ``--tp_size`` / ``--cp_size``; another plan's flag with them;
            any of :func:`plan_mesh`'s.
    """
    if args.tp_size is None and args.cp_size is None:
        for flag, problem in MESH_FLAGS.items():
            if getattr(args, flag.removeprefix("--")) is not None:
                raise UsageError(flag, problem, "pass --tp_size and / or --cp_size too")
        return False
    for name in NOT_WITH_MESH:
        if getattr(args, name) is not None:
            raise UsageError(f"--{name}", "is not read by the tp / cp mesh plan", MESH_FIX)
    mesh_plan_of(args)
    return True


def mesh_plan_of(args) -> MeshPlan:
    """:func:`plan_mesh` from ``plan``'s flags."""
    if args.model_preset is None and args.config_name is None:
        raise UsageError("--model_preset", "the mesh plan needs a Llama-style model",
                         f"pass --model_preset (one of {sorted(MESH_PRESETS)}) or --config_name <config.json>")
    return plan_mesh(num_processes=args.num_processes or 1, tp_size=1 if args.tp_size is None else args.tp_size,
                     cp_size=1 if args.cp_size is None else args.cp_size,
                     replicate_size=args.parallelism_config_dp_replicate_size or 1, model_preset=args.model_preset,
                     config_name=args.config_name, vocab_size=args.vocab_size,
                     per_device_train_batch_size=args.per_device_train_batch_size or 1, block_size=args.block_size,
                     gradient_accumulation_steps=args.gradient_accumulation_steps,
                     mixed_precision=args.mixed_precision, accumulation_policy=args.accumulation_policy)
