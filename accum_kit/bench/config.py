"""The flags of ``accum-kit bench`` (one dataclass, parsed with HfArgumentParser) and the names they choose from."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import checks
from ..errors import UsageError
from ..models import PRESETS
from ..outputs import check_output_dir
from ..policies import POLICIES

#: The three loops the sweep compares by default, in their default order.
MODES = ("sync_each_batch", "no_sync", "raw_ddp")
#: The peers, opt-in through ``--modes`` (see :mod:`accum_kit.bench.peers`): transformers' Trainer and the
#: loop of Accelerate's gradient accumulation guide. Kept out of the default: each Trainer run builds a new
#: Trainer, Accelerator and DDP wrapper, which adds seconds per run on 2 CPU cores.
PEERS = ("trainer", "accelerate_guide")
ALL_MODES = MODES + PEERS
#: ``--comm_hook`` values: DDP's plain all-reduce, or its fp16 / bf16 compression hooks.
COMM_HOOKS = ("none", "fp16", "bf16")
DEFAULT_PRESETS = ("comm_heavy", "small")
DEFAULT_KS = (1, 2, 4, 8, 16)


@dataclass
class BenchConfig:
    """Settings of ``accum-kit bench`` (see ``--help``); checked on construction.

    Raises:
        UsageError: naming the flag of the first bad value (nothing is written then).
    """

    accumulation_steps: list[int] = field(default_factory=lambda: list(DEFAULT_KS), metadata={
        "help": "Gradient accumulation steps K to sweep (run in increasing order)."})
    modes: list[str] = field(default_factory=lambda: list(MODES), metadata={
        "help": f"Loops to run, any of {list(ALL_MODES)} (default: the first three; the peers trainer and "
                "accelerate_guide are opt-in)."})
    accumulation_policies: list[str] = field(default_factory=lambda: list(POLICIES), metadata={
        "help": f"Under an FSDP2 config (accelerate_configs/cpu_fsdp.yaml): the accumulation policies to sweep, any "
                f"of {list(POLICIES)} (the DDP --modes do not apply there)."})
    model_presets: list[str] = field(default_factory=lambda: list(DEFAULT_PRESETS), metadata={
        "help": f"Model presets, any of {sorted(PRESETS)}."})
    per_device_train_batch_size: int = field(default=1, metadata={"help": "Examples per micro-batch per process."})
    block_size: int = field(default=64, metadata={"help": "Tokens per example."})
    vocab_size: int = field(default=384, metadata={
        "help": "Vocabulary of the synthetic token ids (384: the train job's byte tokenizer)."})
    steps: int = field(default=2, metadata={"help": "Measured optimizer steps per run (under FSDP2: cycles of one "
                                                     "window per policy)."})
    warmup_steps: int = field(default=1, metadata={"help": "Optimizer steps before measuring, per run."})
    repeats: int = field(default=3, metadata={"help": "Passes over every K and mode, interleaved."})
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate."})
    seed: int = field(default=42, metadata={"help": "Seed of the model weights and the data."})
    variable_targets: bool = field(default=False, metadata={
        "help": "Give every row a random number of targets (labels -100 after a random length, at least 1 "
                "target; same shapes and compute), so micro-batches differ in target tokens and a mean of "
                "micro-batch means (accelerate_guide) differs from the token mean. Default: every position a target."})
    bucket_cap_mb: float | None = field(default=None, metadata={"help": "DDP gradient bucket size, MB (None: DDP's 25)."})
    gradient_as_bucket_view: bool = field(default=False, metadata={"help": "DDP gradient_as_bucket_view=True."})
    static_graph: bool = field(default=False, metadata={"help": "DDP static_graph=True."})
    comm_hook: str = field(default="none", metadata={
        "help": f"DDP communication hook, one of {list(COMM_HOOKS)}: plain all-reduce, fp16 or bf16 compression."})
    output_dir: str = field(default="runs/bench", metadata={"help": "Where bench.json, bench.csv and bench.png go."})

    def __post_init__(self):
        ks = self.accumulation_steps
        if not ks:
            raise UsageError("--accumulation_steps", "no value given", "pass one or more integers, e.g. 1 2 4 8 16")
        for k in ks:
            checks.at_least("--accumulation_steps", k, fix="pass positive integers, e.g. 1 2 4 8 16")
        if len(set(ks)) != len(ks):
            raise UsageError("--accumulation_steps", f"repeated value in {ks}", "give each K once")
        self.accumulation_steps = sorted(ks)
        checks.distinct_choices("--modes", self.modes, ALL_MODES)
        if "trainer" in self.modes and self.gradient_as_bucket_view:
            raise UsageError("--gradient_as_bucket_view", "transformers' Trainer has no such DDP setting, so the "
                             "trainer mode would run with other DDP settings", "drop it or remove trainer from --modes")
        checks.distinct_choices("--model_presets", self.model_presets, sorted(PRESETS))
        checks.distinct_choices("--accumulation_policies", self.accumulation_policies, list(POLICIES))
        for flag in ("steps", "repeats", "per_device_train_batch_size"):
            checks.at_least(f"--{flag}", getattr(self, flag))
        checks.at_least("--warmup_steps", self.warmup_steps, minimum=0, fix="pass 0 or a positive integer")
        checks.at_least("--block_size", self.block_size, minimum=2, fix="pass at least 2 tokens (one target)")
        checks.at_least("--vocab_size", self.vocab_size, minimum=2, fix="pass a vocabulary size of at least 2")
        if self.bucket_cap_mb is not None:
            checks.positive("--bucket_cap_mb", self.bucket_cap_mb, fix="pass a size in MB, e.g. 25 (DDP's default)")
        checks.one_of("--comm_hook", self.comm_hook, COMM_HOOKS)
        checks.positive("--learning_rate", self.learning_rate, fix="pass a positive float")
        check_output_dir(self.output_dir)

    def ddp_kwargs(self) -> dict:
        """The DDP constructor arguments that differ from DDP's defaults (the same for every mode)."""
        out = {}
        if self.bucket_cap_mb is not None:
            out["bucket_cap_mb"] = self.bucket_cap_mb
        if self.gradient_as_bucket_view:
            out["gradient_as_bucket_view"] = True
        if self.static_graph:
            out["static_graph"] = True
        return out
