"""The ``accum-kit plan`` command: its flags, help text and body (see :mod:`accum_kit.cli`).

Nothing here (nor anything it imports) imports torch, so the command starts
without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import checks
from ..core.accumulation_schedule import parse_accumulation_schedule
from ..core.lr_scaling import LEARNING_RATE_FIX, LR_RULES
from .fsdp_plan import MIXED_PRECISION
from .interconnects import INTERCONNECTS
from .memory_plan import check_memory_flags, format_memory_plan, memory_plan_of
from .mesh_plan import check_mesh_flags, format_mesh_plan, mesh_plan_of
from .plan_report import (SECTIONS, check_batch_size_given, check_learning_rate_flags, check_schedule_flags,
                          check_section_flags, check_target_flags, format_plan, make_plan)
from .whatif import DEFAULT_ACCUMULATION_STEPS, DEFAULT_MAX_COMM_SHARE, check_whatif_flags

DESCRIPTION = (
    "Effective batch size, optimizer steps per epoch, padded/dropped examples, learning-rate scaling, "
    "and the gradient accumulation steps that reach a target batch size. With --from_profile: predicted "
    "step time, speedup of no_sync and communication share per K on a target cluster. With --fsdp: memory, "
    "communication and fit of every FSDP2 accumulation policy, and the fastest one that fits. With --tp_size / "
    "--cp_size: data parallel only next to dp x tp and dp x cp, memory per process and collectives per window."
)


@dataclass
class PlanArguments:
    """Flags of ``accum-kit plan`` (Hugging Face flag names), parsed by ``HfArgumentParser``."""

    per_device_train_batch_size: int | None = field(default=None, metadata={
        "help": "Examples per micro-batch per process (with --target_batch_size: the largest that fits). "
                "Required unless --from_profile gives it (this flag then overrides the profile's)."})
    gradient_accumulation_steps: int | None = field(default=None, metadata={
        "help": "Micro-batches per optimizer step (K); None: the --from_profile run's K, else "
                "$ACCELERATE_GRADIENT_ACCUMULATION_STEPS, else 4 (the same rule as train). Solved for with "
                "--target_batch_size."})
    num_processes: int | None = field(default=None, metadata={
        "help": "Processes over all machines; None: 1, or with --from_profile the profile's world size."})
    num_examples: int | None = field(default=None, metadata={"help": "Training examples per epoch."})
    drop_last: bool = field(default=False, metadata={"help": "The DataLoader drops the last incomplete batch."})
    target_batch_size: int | None = field(default=None, metadata={
        "help": "Examples per optimizer step wanted: solve for --gradient_accumulation_steps."})
    base_learning_rate: float | None = field(default=None, metadata={
        "help": "Learning rate tuned at --base_batch_size."})
    base_batch_size: int | None = field(default=None, metadata={
        "help": "Examples per optimizer step the base learning rate was tuned at."})
    lr_scaling: str | None = field(default=None, metadata={
        "choices": LR_RULES, "help": "Learning-rate scaling rule; None: report all three."})
    from_profile: str | None = field(default=None, metadata={
        "help": "What-if: the train_summary.json of an `accum-kit train --profile_comm` run (2+ processes, "
                "K >= 2); predicts step times per K from its compute, gradient bytes, all-reduce and overlap."})
    num_machines: int | None = field(default=None, metadata={
        "help": "What-if: machines the --num_processes processes are spread over; None: 1."})
    interconnect: str | None = field(default=None, metadata={
        "choices": tuple(INTERCONNECTS), "help": "What-if: the link whose nominal peak bus bandwidth is assumed: "
        "nvlink 450 GB/s (H100 NVLink 4, 900 GB/s both ways), infiniband 50 GB/s (NDR 400 Gb/s), ethernet "
        "12.5 GB/s (100 GbE), measured (the profile's busbw); None: measured."})
    busbw_GBps: float | None = field(default=None, metadata={
        "help": "What-if: bus bandwidth per link in GB/s (overrides --interconnect's figure)."})
    accumulation_steps: list[int] = field(default_factory=lambda: list(DEFAULT_ACCUMULATION_STEPS), metadata={
        "help": "What-if: the K values to predict."})
    max_comm_share: float = field(default=DEFAULT_MAX_COMM_SHARE, metadata={
        "help": "What-if: solve for the smallest K whose no_sync step spends at most this share in exposed "
                "communication; in (0, 1)."})
    compare_bench: str | None = field(default=None, metadata={
        "help": "What-if: a bench.json of `accum-kit bench` on the profiled machine: print predicted vs "
                "measured step times per K."})
    accumulation_schedule: str | None = field(default=None, metadata={
        "help": "Batch-size warm-up, STEP:K pairs from step 0, e.g. 0:1,100:2,300:4 (as train takes it): print "
                "each phase's K, examples, tokens and steps; K is its K at step 0."})
    block_size: int | None = field(default=None, metadata={
        "help": "Tokens per example, for tokens per optimizer step in the schedule table."})
    num_train_epochs: int = field(default=1, metadata={
        "help": "With --accumulation_schedule and --num_examples: epochs of the run whose steps are counted."})
    fsdp: bool = field(default=False, metadata={
        "help": "Plan the FSDP2 accumulation policies: memory per process, communication per step, fit, and the "
                "fastest that fits (docs/fsdp_costs.md). Uses --num_processes, --num_machines, "
                "--gradient_accumulation_steps, --interconnect / --busbw_GBps and, optionally, --from_profile (an "
                "FSDP2 profile) and --compare_bench (an FSDP2 bench.json)."})
    model_preset: str | None = field(default=None, metadata={
        "help": "With --fsdp: a GPT-2 preset of the train job (tiny, mini, small, comm_heavy), its units counted from "
                "its config with --vocab_size and --block_size positions."})
    vocab_size: int = field(default=384, metadata={
        "help": "With --fsdp --model_preset: vocabulary (384: the train job's byte tokenizer)."})
    num_parameters: int | None = field(default=None, metadata={
        "help": "With --fsdp: the model's parameters (elements), instead of --model_preset; needs --num_layers."})
    num_layers: int | None = field(default=None, metadata={
        "help": "With --fsdp --num_parameters: layers (FSDP2 units resharded after forward) sharing the parameters."})
    mixed_precision: str = field(default="no", metadata={
        "choices": MIXED_PRECISION, "help": "With --fsdp: no (fp32) or bf16/fp16 (fp32 master weights, gathered in "
                                            "16 bits, gradients reduced and held in fp32)."})
    gpu_memory_GB: float | None = field(default=None, metadata={
        "help": "With --fsdp: memory per GPU in GB (1e9 bytes); the plan subtracts parameter shards and AdamW state."})
    free_memory_GB: float | None = field(default=None, metadata={
        "help": "With --fsdp: memory per GPU left for accumulation (gradients, gathered parameters) after model, "
                "optimizer and activations, GB; overrides --gpu_memory_GB."})
    parallelism_config_dp_replicate_size: int | None = field(default=None, metadata={
        "help": "With --fsdp: HSDP's replicas R (Accelerate's flag; the shard group is --num_processes / R, e.g. "
                "the machines); adds reduce_scatter_each_batch and the all-reduces across replicas. Default: the "
                "profile's mesh, else 1 (plain FSDP2)."})
    inter_node_busbw_GBps: float | None = field(default=None, metadata={
        "help": "With --fsdp and R > 1: bus bandwidth of the all-reduce across replicas in GB/s (the inter-node "
                "link). Default: the profile's measured one, else InfiniBand's nominal peak."})
    memory_per_process: str | None = field(default=None, metadata={
        "help": "Plan by memory: the memory each process may use (8GB = 8e9 bytes, 8GiB, 512MB, bytes); lists "
                "the (micro-batch, K, checkpointing, policy) rows for --target_effective_batch with their "
                "predicted peak and step time, and the fastest that fits (docs/memory.md). Uses --model_preset, "
                "--block_size, --num_processes, --vocab_size, --mixed_precision, --from_profile, --busbw_GBps."})
    target_effective_batch: int | None = field(default=None, metadata={
        "help": "With --memory_per_process: examples per optimizer step over all processes (a multiple of "
                "--num_processes)."})
    baseline_memory: str | None = field(default=None, metadata={
        "help": "With --memory_per_process: what each process holds besides the model and training (Python, "
                "libraries, data; about 0.6GB on CPU, the train job's resident set before its model); default 0."})
    fused_linear_cross_entropy: str | None = field(default=None, metadata={
        "help": "With --memory_per_process: the train job's --fused_linear_cross_entropy (default auto: the loss "
                "computed in the output layer in chunks, no full-vocabulary logits; off: the logits priced)."})
    lora_r: int | None = field(default=None, metadata={
        "help": "With --memory_per_process: price a LoRA run (the train job's --use_peft) with adapters of this "
                "rank: frozen weights held as parameters, gradients, optimizer state and reductions of the "
                "adapters only (docs/adapters.md)."})
    lora_target_modules: list[str] | None = field(default=None, metadata={
        "help": "With --lora_r: the GPT-2 block layers adapted (c_attn, c_proj, c_fc, or all-linear); default "
                "c_attn, peft's choice for GPT-2."})
    lora_dropout: float | None = field(default=None, metadata={
        "help": "With --lora_r: dropout on the adapters' input (each adapted layer then keeps its input's "
                "dropped copy); default 0."})
    compute_TFLOPS: float | None = field(default=None, metadata={
        "help": "With --memory_per_process and no --from_profile: achieved FLOP rate per process, for the step "
                "time (default 1; the ranking does not depend on it)."})
    tp_size: int | None = field(default=None, metadata={
        "help": "Plan a mesh: tensor-parallel processes (Accelerate's ParallelismConfig tp_size); prints data "
                "parallel only next to dp x tp: memory per process and collectives per window per group "
                "(docs/tensor_parallel.md). Uses --model_preset (llama_tiny, llama_small, llama3_8b) or --config_name, "
                "--num_processes, --parallelism_config_dp_replicate_size, --per_device_train_batch_size, "
                "--block_size, --gradient_accumulation_steps, --mixed_precision, --accumulation_policy."})
    cp_size: int | None = field(default=None, metadata={
        "help": "Plan a mesh: context-parallel processes (Accelerate's cp_size; Ulysses all-to-all), each holding "
                "--block_size / cp tokens of every sequence; adds dp x cp (and with --tp_size, dp x cp x tp)."})
    config_name: str | None = field(default=None, metadata={
        "help": "With --tp_size / --cp_size: a Llama-style config.json (or its folder) instead of --model_preset."})
    accumulation_policy: str | None = field(default=None, metadata={
        "help": "With --tp_size / --cp_size: the accumulation policy priced (default no_sync); the plan also says "
                "what no_sync saves against sync_each_batch."})
    json: bool = field(default=False, metadata={"help": "Print JSON instead of the text table."})

    def __post_init__(self):
        """Check ranges and flag combinations; raises UsageError naming the flag."""
        if check_mesh_flags(self):  # a tp / cp mesh: its own flags, checked there
            return
        if check_memory_flags(self):  # plan by memory: its own flags, checked there
            return
        if self.per_device_train_batch_size is not None:
            checks.at_least("--per_device_train_batch_size", self.per_device_train_batch_size)
        elif self.from_profile is None:
            check_batch_size_given(None)
        for flag in ("gradient_accumulation_steps", "num_processes", "num_examples", "target_batch_size"):
            if getattr(self, flag) is not None:
                checks.at_least(f"--{flag}", getattr(self, flag))
        check_target_flags(self.target_batch_size, self.gradient_accumulation_steps)
        for flag in ("block_size", "num_train_epochs"):
            if getattr(self, flag) is not None:
                checks.at_least(f"--{flag}", getattr(self, flag))
        if self.accumulation_schedule is not None and not isinstance(self.accumulation_schedule, dict):
            self.accumulation_schedule = parse_accumulation_schedule(self.accumulation_schedule)
        check_schedule_flags(self.accumulation_schedule, self.gradient_accumulation_steps, self.target_batch_size)
        if self.base_learning_rate is not None:
            checks.positive("--base_learning_rate", self.base_learning_rate, fix=LEARNING_RATE_FIX)
        if self.base_batch_size is not None:
            checks.at_least("--base_batch_size", self.base_batch_size)
        if self.lr_scaling is not None:
            checks.one_of("--lr_scaling", self.lr_scaling, LR_RULES)
        check_learning_rate_flags(self.base_learning_rate, self.base_batch_size, self.lr_scaling)
        section = SECTIONS[self.fsdp]
        check_whatif_flags(self.from_profile, self.num_machines, self.num_processes, self.interconnect,
                           self.busbw_GBps, self.accumulation_steps, self.max_comm_share, self.compare_bench,
                           needs_profile=section.needs_profile,
                           replicate_size=self.parallelism_config_dp_replicate_size)
        check_section_flags(section, self)  # another section's flags refused, this one's checked
        if self.parallelism_config_dp_replicate_size is not None:
            checks.at_least("--parallelism_config_dp_replicate_size", self.parallelism_config_dp_replicate_size)


ARGUMENTS = PlanArguments


def run_command(args: PlanArguments) -> int:
    """Print the plan (text table, or JSON with ``--json``); returns 0.

    Raises:
        UsageError: values that only fail together (e.g. ``--drop_last`` with
            fewer examples than one global micro-batch); :func:`accum_kit.cli.run`
            prints it and exits 2, with nothing on stdout.
    """
    if args.tp_size is not None or args.cp_size is not None:
        plan = mesh_plan_of(args)
        print(json.dumps(plan.to_dict(), indent=2) if args.json else format_mesh_plan(plan))
        return 0
    if args.memory_per_process is not None:
        plan = memory_plan_of(args)
        print(json.dumps(plan.to_dict(), indent=2) if args.json else format_memory_plan(plan))
        return 0
    report = make_plan(
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        args.num_processes,
        args.num_examples,
        drop_last=args.drop_last,
        target_batch_size=args.target_batch_size,
        base_learning_rate=args.base_learning_rate,
        base_batch_size=args.base_batch_size,
        lr_scaling=args.lr_scaling,
        from_profile=args.from_profile,
        num_machines=args.num_machines,
        interconnect=args.interconnect,
        busbw_GBps=args.busbw_GBps,
        accumulation_steps=args.accumulation_steps,
        max_comm_share=args.max_comm_share,
        compare_bench=args.compare_bench,
        accumulation_schedule=args.accumulation_schedule,
        block_size=args.block_size,
        num_train_epochs=args.num_train_epochs,
        fsdp=args.fsdp,
        model_preset=args.model_preset,
        vocab_size=args.vocab_size,
        num_parameters=args.num_parameters,
        num_layers=args.num_layers,
        mixed_precision=args.mixed_precision,
        gpu_memory_GB=args.gpu_memory_GB,
        free_memory_GB=args.free_memory_GB,
        parallelism_config_dp_replicate_size=args.parallelism_config_dp_replicate_size,
        inter_node_busbw_GBps=args.inter_node_busbw_GBps,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_plan(report))
    return 0
