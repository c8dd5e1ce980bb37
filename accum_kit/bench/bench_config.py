"""The flags of ``accum-kit bench`` (one dataclass, parsed with HfArgumentParser) and the names they choose from.

What a flag means under the launch's engine is its part's to say (:mod:`accum_kit.bench.parts`): the default
schedule, the default policies, and the flags refused because they mean nothing there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import checks
from ..engines.activation_checkpointing import (gradient_checkpointing_field, gradient_checkpointing_kwargs_field,
                                                parse_checkpointing_kwargs, resolve_checkpointing)
from ..engines.compiling import resolve_flags
from ..engines.ddp import check_ddp_flags, ddp_field
from ..engines.ddp import ddp_kwargs as _ddp_kwargs
from ..engines.policies import POLICIES
from ..errors import UsageError
from ..job.models import PRESETS
from ..outputs import check_output_dir
from .loss_axis import fused_name, logits_arm

#: The three loops the sweep compares by default, in their default order.
MODES = ("sync_each_batch", "no_sync", "raw_ddp")
#: Hand-written gradient averaging without DDP (:mod:`accum_kit.reference.manual_allreduce`), opt-in through ``--modes``.
MANUAL = ("manual_allreduce", "manual_allreduce_flat")
#: The peers, opt-in through ``--modes`` (see :mod:`accum_kit.bench.peers`): transformers' Trainer and the
#: loop of Accelerate's gradient accumulation guide. Kept out of the default: each Trainer run builds a new
#: Trainer, Accelerator and DDP wrapper, which adds seconds per run on 2 CPU cores.
PEERS = ("trainer", "accelerate_guide")
#: The DDP modes run with the loss from the logits, the formula of raw DDP and the peers; ``no_sync_fused``, opt-in,
#: is ``no_sync`` with train_loop's default fused loss (:mod:`accum_kit.bench.loss_axis`), compared with ``no_sync``.
FUSED_MODES = ("no_sync_fused",)
ALL_MODES = MODES + FUSED_MODES + MANUAL + PEERS
#: The arms of the one-process bench (one process: no DDP wrapper, so neither ``no_sync`` nor raw DDP means
#: anything): accum-kit's loop with the logits and with its default fused loss, a plain PyTorch loop and the peers
#: (:mod:`accum_kit.bench.part_single`).
ONE_PROCESS_ARMS = ("kit", "kit_fused", "plain") + PEERS
#: ``--mixed_precision`` values (Accelerate's), ``--optim`` values (transformers' ``TrainingArguments`` names).
MIXED_PRECISIONS = ("no", "bf16", "fp16")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
#: ``--comm_hook`` values: DDP's plain all-reduce, or its fp16 / bf16 compression hooks.
COMM_HOOKS = ("none", "fp16", "bf16")
DEFAULT_PRESETS = ("comm_heavy", "small")
DEFAULT_KS = (1, 2, 4, 8, 16)
#: Schedule of a run: (measured steps, warm-up steps, repeats). The default pairs single windows: every
#: repeat runs one window of each mode back to back, so each per-repeat ratio compares two windows a few
#: seconds apart and slow drift of the machine's load cancels; many repeats narrow the interval. The
#: figures that chose it are in benchmarks/README.md. ``--quick`` is the short run of earlier versions.
DEFAULT_SCHEDULE = (1, 0, 24)
QUICK_SCHEDULE = (2, 1, 3)
#: Under an FSDP2 or DeepSpeed launch a run's windows rotate through the arms (policies, stages), so ``steps``
#: counts cycles of one window per arm; one unmeasured window first keeps a run's start-up out of whichever
#: arm leads (the schedule of the FSDP2 figures in docs/fsdp_costs.md).
FSDP_SCHEDULE = (5, 1, 3)
#: ``--tune``: the K and preset it uses unless given, and the bucket sizes it tries (MB).
TUNE_K = 8
TUNE_PRESETS = ("comm_heavy",)
TUNE_BUCKET_CAP_MB = (5.0, 100.0)


@dataclass
class BenchConfig:
    """Settings of ``accum-kit bench`` (see ``--help``); checked on construction.

    Raises:
        UsageError: naming the flag of the first bad value (nothing is written then).
    """

    accumulation_steps: list[int] | None = field(default=None, metadata={
        "help": f"Gradient accumulation steps K to sweep (run in increasing order; default {list(DEFAULT_KS)}, "
                f"with --tune {TUNE_K})."})
    modes: list[str] | None = field(default=None, metadata={
        "help": f"Loops to run. Under DDP (2+ processes) any of {list(ALL_MODES)} (default: the first three, with the "
                "loss from the logits as raw_ddp; no_sync_fused, no_sync with train_loop's default fused loss, the "
                "manual all-reduce modes and the peers trainer and accelerate_guide are opt-in); on one process any "
                f"of {list(ONE_PROCESS_ARMS)} (default: all; kit with the logits' loss as plain, kit_fused with the "
                "default fused loss)."})
    accumulation_policies: list[str] | None = field(default=None, metadata={
        "help": f"Under an FSDP2 config (accelerate_configs/cpu_fsdp.yaml): the accumulation policies to sweep, any "
                f"of {list(POLICIES)} (default: the four that apply to FSDP2; under an HSDP config, "
                "accelerate_configs/cpu_hsdp.yaml, all five), each run with the loss from the logits; <policy>_fused "
                "(e.g. no_sync_fused, opt-in) runs that policy with train_loop's default fused loss, compared with "
                "<policy>. The DDP --modes do not apply there."})
    zero_stages: list[int] | None = field(default=None, metadata={
        "help": "Under a DeepSpeed config (accelerate_configs/cpu_deepspeed.yaml): the ZeRO stages to sweep, any of "
                "1 2 3 (default: all three), one engine per stage and K, windows rotated across them."})
    emulate_inter_node_GBps: float | None = field(default=None, metadata={
        "help": "EMULATION, HSDP only: add to every all-reduce across replicas the time a ring all-reduce would "
                "take at this bus bandwidth (GB/s), to stand in for a slow inter-node link on one machine. For "
                "checking the planner, not for claiming speed; reported as emulated. Default: off."})
    model_presets: list[str] | None = field(default=None, metadata={
        "help": f"Model presets, any of {sorted(PRESETS)} (default {list(DEFAULT_PRESETS)}, with --tune "
                f"{list(TUNE_PRESETS)})."})
    per_device_train_batch_size: int = field(default=1, metadata={"help": "Examples per micro-batch per process."})
    block_size: int = field(default=64, metadata={"help": "Tokens per example."})
    vocab_size: int = field(default=384, metadata={
        "help": "Vocabulary of the synthetic token ids (384: the train job's byte tokenizer)."})
    steps: int | None = field(default=None, metadata={
        "help": f"Measured optimizer steps per run (default {DEFAULT_SCHEDULE[0]}; --quick: {QUICK_SCHEDULE[0]}; under "
                f"FSDP2: cycles of one window per policy, default {FSDP_SCHEDULE[0]})."})
    warmup_steps: int | None = field(default=None, metadata={
        "help": f"Optimizer steps before measuring, per run (default {DEFAULT_SCHEDULE[1]}; --quick: "
                f"{QUICK_SCHEDULE[1]}; under FSDP2 {FSDP_SCHEDULE[1]})."})
    repeats: int | None = field(default=None, metadata={
        "help": f"Passes over every K and mode, interleaved; every ratio's 95%% interval is over them, so at least 2 "
                f"give one (default {DEFAULT_SCHEDULE[2]}; --quick: {QUICK_SCHEDULE[2]}; under FSDP2 {FSDP_SCHEDULE[2]})."})
    quick: bool = field(default=False, metadata={
        "help": f"The short run (--steps {QUICK_SCHEDULE[0]} --warmup_steps {QUICK_SCHEDULE[1]} --repeats "
                f"{QUICK_SCHEDULE[2]} unless given): a first look, its 95%% intervals are wide."})
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate."})
    seed: int = field(default=42, metadata={"help": "Seed of the model weights and the data."})
    variable_targets: bool = field(default=False, metadata={
        "help": "Give every row a random number of targets (labels -100 after a random length, at least 1 "
                "target; same shapes and compute), so micro-batches differ in target tokens and a mean of "
                "micro-batch means (accelerate_guide) differs from the token mean. Default: every position a target."})
    # DDP constructor settings (Trainer's flag names), the same for every mode (accum_kit.engines.ddp)
    ddp_bucket_cap_mb: float | None = ddp_field("ddp_bucket_cap_mb")
    gradient_as_bucket_view: bool = ddp_field("gradient_as_bucket_view")
    ddp_static_graph: bool = ddp_field("ddp_static_graph")
    ddp_find_unused_parameters: bool = ddp_field("ddp_find_unused_parameters")
    comm_hook: str = field(default="none", metadata={
        "help": f"DDP communication hook, one of {list(COMM_HOOKS)}: plain all-reduce, fp16 or bf16 compression."})
    tune: bool = field(default=False, metadata={
        "help": "Instead of the modes, sweep DDP's settings at one K (the no_sync loop, one model copy per "
                "setting): the settings above as the base, then each of bucket sizes --tune_bucket_cap_mb, "
                "gradient_as_bucket_view, static_graph, find_unused_parameters changed alone; reports exposed "
                "communication against its limit, s/step with intervals and peak memory, and recommends one."})
    tune_bucket_cap_mb: list[float] = field(default_factory=lambda: list(TUNE_BUCKET_CAP_MB), metadata={
        "help": "Bucket sizes (MB) that --tune tries besides the base's."})
    torch_compile: bool = field(default=False, metadata={
        "help": "Instead of the modes: the no_sync loop compiled (torch.compile of the DDP model, as Accelerate's "
                "dynamo plugin does) against eager, paired and interleaved per K, with compile seconds and the "
                "break-even step count (compile.json; docs/compile.md)."})
    torch_compile_backend: str | None = field(default=None, metadata={
        "help": "torch.compile backend for --torch_compile (implies it), e.g. inductor (default), aot_eager."})
    torch_compile_mode: str | None = field(default=None, metadata={
        "help": "inductor mode for --torch_compile (implies it), e.g. default, max-autotune-no-cudagraphs."})
    gradient_checkpointing: bool = gradient_checkpointing_field()
    gradient_checkpointing_kwargs: str | None = gradient_checkpointing_kwargs_field()
    gradient_checkpointing_ab: bool = field(default=False, metadata={
        "help": "Measure activation checkpointing's cost: every arm (DDP: sync_each_batch, no_sync, raw_ddp; FSDP2 / "
                "HSDP: each policy) also runs as a checkpointed twin (<arm>+gc, a second copy of the model, same "
                "weights and data) in adjacent runs, and the report gives per arm and K step time with / without "
                "checkpointing with its 95%% interval and the peak memory of each (docs/memory.md)."})
    mixed_precision: str | None = field(default=None, metadata={
        "help": f"One process only: the Accelerator's mixed precision, one of {list(MIXED_PRECISIONS)} (default: the "
                "launch's, e.g. accelerate launch --mixed_precision bf16, else no); the plain loop runs under "
                "torch.autocast in the same dtype (fp16: with a GradScaler), Trainer with bf16 / fp16."})
    max_grad_norm: float = field(default=0.0, metadata={
        "help": "One process only: clip the gradient norm to this in every arm; 0: no clipping (the default)."})
    optim: str = field(default="adamw_torch", metadata={
        "help": f"One process only: the optimizer of every arm, one of {list(OPTIMIZERS)} (torch.optim.AdamW, "
                "without or with fused=True)."})
    use_peft: bool = field(default=False, metadata={
        "help": "Train LoRA adapters (peft, the train job's --use_peft) on the frozen preset in every arm instead of "
                "every weight: peft's default targets (GPT-2: c_attn), --lora_r, alpha 2 r, no dropout. DDP and "
                "FSDP2 launches only."})
    lora_r: int | None = field(default=None, metadata={
        "help": "With --use_peft: the adapters' rank (default 16, TRL's)."})
    output_dir: str = field(default="runs/bench", metadata={"help": "Where bench.json, bench.csv and bench.png go."})

    def __post_init__(self):
        from .parts import engine_part

        part = engine_part()  # the launch's engine says what its flags mean there
        if resolve_checkpointing(self.gradient_checkpointing, self.gradient_checkpointing_kwargs)[0]:
            self.gradient_checkpointing_kwargs = parse_checkpointing_kwargs(self.gradient_checkpointing_kwargs)
        policies_given = self.accumulation_policies is not None
        if not policies_given:
            self.accumulation_policies = part.default_policies()
        steps, warmup, repeats = QUICK_SCHEDULE if self.quick else part.default_schedule
        self.steps = steps if self.steps is None else self.steps
        self.warmup_steps = warmup if self.warmup_steps is None else self.warmup_steps
        self.repeats = repeats if self.repeats is None else self.repeats
        if self.accumulation_steps is None:
            self.accumulation_steps = [TUNE_K] if self.tune else list(DEFAULT_KS)
        if self.model_presets is None:
            self.model_presets = list(TUNE_PRESETS if self.tune else DEFAULT_PRESETS)
        ks = self.accumulation_steps
        if not ks:
            raise UsageError("--accumulation_steps", "no value given", "pass one or more integers, e.g. 1 2 4 8 16")
        for k in ks:
            checks.at_least("--accumulation_steps", k, fix="pass positive integers, e.g. 1 2 4 8 16")
        if len(set(ks)) != len(ks):
            raise UsageError("--accumulation_steps", f"repeated value in {ks}", "give each K once")
        self.accumulation_steps = sorted(ks)
        if self.modes is None:
            self.modes = part.default_modes()
        checks.distinct_choices("--modes", self.modes, part.mode_choices())
        if "trainer" in self.modes and self.gradient_as_bucket_view:
            raise UsageError("--gradient_as_bucket_view", "transformers' Trainer has no such DDP setting, so the "
                             "trainer mode would run with other DDP settings", "drop it or remove trainer from --modes")
        if "trainer" in self.modes and self.ddp_static_graph and max(self.accumulation_steps) > 1:
            raise UsageError("--ddp_static_graph", "transformers' Trainer builds a new DDP model every run, and DDP's "
                             "static_graph fails when its first backward runs under no_sync, as Trainer's first window "
                             "does (pytorch/pytorch#143580)", "drop it or remove trainer from --modes")
        checks.distinct_choices("--model_presets", self.model_presets, sorted(PRESETS))
        checks.distinct_choices("--accumulation_policies", self.accumulation_policies,
                                [*POLICIES, *(fused_name(p) for p in POLICIES)])
        for flag in ("steps", "repeats", "per_device_train_batch_size"):
            checks.at_least(f"--{flag}", getattr(self, flag))
        checks.at_least("--warmup_steps", self.warmup_steps, minimum=0, fix="pass 0 or a positive integer")
        checks.at_least("--block_size", self.block_size, minimum=2, fix="pass at least 2 tokens (one target)")
        checks.at_least("--vocab_size", self.vocab_size, minimum=2, fix="pass a vocabulary size of at least 2")
        check_ddp_flags(self)
        checks.one_of("--comm_hook", self.comm_hook, COMM_HOOKS)
        checks.positive("--learning_rate", self.learning_rate, fix="pass a positive float")
        if self.mixed_precision is not None:
            checks.one_of("--mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        if not self.max_grad_norm >= 0:  # also refuses NaN
            raise UsageError("--max_grad_norm", f"must be >= 0 (got {self.max_grad_norm})",
                             "pass a positive norm, or 0 for no clipping")
        checks.one_of("--optim", self.optim, OPTIMIZERS)
        if self.tune:
            if len(self.accumulation_steps) != 1:
                raise UsageError("--accumulation_steps", f"--tune sweeps DDP settings at one K (got {self.accumulation_steps})",
                                 f"pass one value, e.g. --accumulation_steps {TUNE_K}")
            if not self.tune_bucket_cap_mb:
                raise UsageError("--tune_bucket_cap_mb", "no value given", "pass one or more sizes in MB, e.g. 5 100")
            for mb in self.tune_bucket_cap_mb:
                checks.positive("--tune_bucket_cap_mb", mb, fix="pass sizes in MB, e.g. 5 100")
        self._check_compile()
        part.check_flags(self, policies_given)
        part.check_loop_flags(self)
        self._check_checkpointing_ab(part)
        if self.emulate_inter_node_GBps is not None:
            checks.positive("--emulate_inter_node_GBps", self.emulate_inter_node_GBps,
                            fix="pass the emulated inter-node bus bandwidth in GB/s, e.g. 0.1")
        self._check_adapters(part)
        check_output_dir(self.output_dir)

    def _check_adapters(self, part) -> None:
        """``--use_peft`` / ``--lora_r``: a rank of 1 or more, only with ``--use_peft``, under DDP's modes or the
        FSDP2 policies (not ``--tune``, ``--torch_compile`` or ``--gradient_checkpointing_ab``).

        Raises:
            UsageError: naming the flag.
        """
        if not self.use_peft:
            if self.lora_r is not None:
                raise UsageError("--lora_r", "is a LoRA setting, but --use_peft is not given", "add --use_peft")
            return
        self.lora_r = 16 if self.lora_r is None else self.lora_r
        checks.at_least("--lora_r", self.lora_r, fix="pass a rank of 1 or more, e.g. --lora_r 8")
        for other, given in (("--tune", self.tune), ("--torch_compile", self.torch_compile),
                             ("--gradient_checkpointing_ab", self.gradient_checkpointing_ab)):
            if given:
                raise UsageError("--use_peft", f"adapters are measured in the DDP modes and FSDP2 policies, not with "
                                 f"{other}", f"drop {other} or --use_peft")
        if not part.measures_adapters:
            raise UsageError("--use_peft", f"adapters are measured under DDP and FSDP2, and this launch is {part.name}",
                             "launch with accelerate_configs/cpu_ddp.yaml or cpu_fsdp.yaml")

    def build_model(self, preset: str):
        """The preset's model (:func:`accum_kit.job.models.build_model`, the bench's vocabulary, block and seed), with
        LoRA adapters when ``--use_peft`` (:func:`accum_kit.job.adapters.apply_lora`: every weight frozen)."""
        from ..job.models import build_model

        model = build_model(preset, self.vocab_size, self.block_size, seed=self.seed)
        if not self.use_peft:
            return model
        from ..job.adapters import LoraSettings, apply_lora

        return apply_lora(model, LoraSettings(self.lora_r, 2 * self.lora_r, 0.0, None), source=f"preset {preset}")

    def adapter_info(self) -> dict | None:
        """What ``bench.json`` records of the adapters: ``{"r", "lora_alpha", "lora_dropout"}`` (None: full fine-tuning)."""
        return {"r": self.lora_r, "lora_alpha": 2 * self.lora_r, "lora_dropout": 0.0} if self.use_peft else None

    def check_hsdp_flags(self, hybrid: bool) -> None:
        """At run time, once the launch is known: the HSDP-only flag and policy need a replicate group.

        Args:
            hybrid: the launch has a replicate group (:meth:`accum_kit.bench.parts.BenchPart.hybrid`).

        Raises:
            UsageError: ``--emulate_inter_node_GBps`` or ``reduce_scatter_each_batch`` outside HSDP.
        """
        if hybrid:
            return
        if self.emulate_inter_node_GBps is not None:
            raise UsageError("--emulate_inter_node_GBps", "emulates the link HSDP all-reduces across replicas "
                             "over, and this launch is not HSDP", "launch with accelerate_configs/cpu_hsdp.yaml, "
                             "or drop the flag")
        needs_replicas = [p for p in self.accumulation_policies if POLICIES[logits_arm(p)].hsdp_only]
        if needs_replicas:
            raise UsageError("--accumulation_policies", f"{needs_replicas[0]} needs HSDP (a replicate group)",
                             "launch with accelerate_configs/cpu_hsdp.yaml, or leave it out")

    def _check_compile(self) -> None:
        """``--torch_compile*``: known backend and mode (either implies ``--torch_compile``), not with --tune
        (both replace the modes). Where the launch's engine cannot compare them, its part refuses it."""
        if resolve_flags(self.torch_compile, self.torch_compile_backend, self.torch_compile_mode) is None:
            return
        self.torch_compile = True
        if self.tune:
            raise UsageError("--torch_compile", "compares compiled with eager under DDP and cannot run with --tune",
                             "drop one of them")

    def _check_checkpointing_ab(self, part) -> None:
        """``--gradient_checkpointing_ab``: not with ``--gradient_checkpointing`` (every arm checkpointed: no arm
        left without), ``--tune`` or ``--torch_compile``, nor where no arm gets a twin (DeepSpeed; DDP
        ``--modes`` without the modes that get one; :meth:`accum_kit.bench.parts.BenchPart.twin_arms`).

        Raises:
            UsageError: naming the flag.
        """
        if not self.gradient_checkpointing_ab:
            return
        flag = "--gradient_checkpointing_ab"
        for other, given in (("--gradient_checkpointing", self.gradient_checkpointing), ("--tune", self.tune),
                             ("--torch_compile", self.torch_compile)):
            if given:
                raise UsageError(flag, f"runs every arm with and without checkpointing and cannot run with {other}",
                                 f"drop one of {flag} and {other}")
        if not part.twin_arms(self):
            raise UsageError(flag, f"gives a twin to DDP's modes {list(MODES)} and to the FSDP2 / HSDP policies, "
                             "and this run has none of them", "launch with accelerate_configs/cpu_ddp.yaml (with "
                             "no_sync in --modes) or accelerate_configs/cpu_fsdp.yaml")

    def checkpointing(self) -> dict:
        """``build_accelerator``'s activation-checkpointing arguments from ``--gradient_checkpointing*``."""
        return {"gradient_checkpointing": self.gradient_checkpointing,
                "gradient_checkpointing_kwargs": self.gradient_checkpointing_kwargs}

    def ddp_kwargs(self) -> dict:
        """The DDP constructor arguments (DDP's names) that differ from DDP's defaults (the same for every mode)."""
        return _ddp_kwargs(self)
