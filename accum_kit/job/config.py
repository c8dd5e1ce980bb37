"""The train job's settings: one dataclass, parsed with transformers' HfArgumentParser.

Flag names follow transformers' ``examples/pytorch/language-modeling/run_clm_no_trainer.py``
so that users of that script can switch without relearning them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import checks
from .adapters import resolve_lora_flags
from .clm_flags import resolve_run_clm_flags
from ..engines.compiling import MODES, resolve_flags
from .data import check_data_flags
from ..engines.ddp import check_ddp_flags, ddp_field
from ..engines.activation_checkpointing import (gradient_checkpointing_field, gradient_checkpointing_kwargs_field,
                                                parse_checkpointing_kwargs, resolve_checkpointing)
from ..errors import UsageError
from ..core.loss import FUSED_CHOICES, NORMALIZATIONS
from .models import LLAMA_PRESETS, MOE_PRESETS, PRESETS
from ..core.lr_scaling import LR_RULES
from ..core.accumulation_schedule import parse_accumulation_schedule
from ..engines.policies import POLICIES, resolve_policy
from .tracking import TRACKERS

SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")


@dataclass
class TrainConfig:
    """Settings of ``accum-kit train`` / ``examples/train.py`` (see ``--help``)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Local model directory (or hub name) to fine-tune; overrides --model_preset."})
    model_preset: str = field(default="mini", metadata={"help": f"Model built from a GPT2Config, one of {sorted(PRESETS)}, or from a LlamaConfig (tensor / context parallel need one), one of {sorted(LLAMA_PRESETS)}, or a mixture of experts from a MixtralConfig, one of {sorted(MOE_PRESETS)}."})
    # LoRA adapters through peft, with TRL's flag names and defaults (accum_kit.job.adapters; docs/adapters.md)
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters (peft) on a frozen model instead of every weight (TRL's flag); the adapter is saved as peft saves it (adapter_config.json, adapter_model.safetensors). Needs pip install 'accum-kit[peft]'."})
    lora_r: int | None = field(default=None, metadata={"help": "With --use_peft: the adapters' rank (TRL's default 16)."})
    lora_alpha: int | None = field(default=None, metadata={"help": "With --use_peft: LoRA's alpha; the update is scaled by alpha / r (TRL's default 32)."})
    lora_dropout: float | None = field(default=None, metadata={"help": "With --use_peft: dropout on the adapters' input (TRL's default 0.05; 0 for a run that verify's arithmetic can reproduce)."})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "With --use_peft: the modules that get adapters, by name (e.g. c_attn, or q_proj v_proj), or all-linear; default: peft's choice for the model type (GPT-2: c_attn; Llama: q_proj v_proj)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "Refused: quantised base weights (QLoRA) are not supported."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Refused: quantised base weights are not supported."})
    router_aux_loss_scope: str | None = field(default=None, metadata={"help": "Mixture-of-experts models: over which tokens the router's load-balancing loss is defined: 'window' (default: the whole accumulation window on all processes, as one big batch; reads each window ahead and routes it once more without gradients) or 'micro_batch' (each micro-batch's own, averaged over the window)."})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset name; default: the CPython standard library sources on this machine."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of --dataset_name."})
    train_file: str | None = field(default=None, metadata={"help": "Local .txt, .json/.jsonl or .csv file with a 'text' column."})
    # run_clm_no_trainer.py's other flags, same meaning (accum_kit.job.clm_flags; docs/run_clm.md)
    validation_file: str | None = field(default=None, metadata={"help": "Local .txt, .json/.jsonl or .csv file evaluated instead of a held-out part of train (train then keeps all its data)."})
    config_name: str | None = field(default=None, metadata={"help": "Model config (directory with config.json, or hub name); without --model_name_or_path: train from scratch with AutoModelForCausalLM.from_config."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer to load if not the one of --model_name_or_path; default without a model: bytes (ByT5Tokenizer)."})
    model_type: str | None = field(default=None, metadata={"help": "Train from scratch a model of this type with its default config (e.g. gpt2, llama) when neither --model_name_or_path nor --config_name is given."})
    use_slow_tokenizer: bool = field(default=False, metadata={"help": "Load the Python tokenizer instead of the tokenizers-library one (ignored by transformers 5)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run model, config and tokenizer code shipped with --model_name_or_path / --config_name / --tokenizer_name."})
    low_cpu_mem_usage: bool = field(default=False, metadata={"help": "Create the model empty and fill it from the weights (transformers 4; always so in transformers 5)."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenising and packing (datasets' map num_proc); None: this process."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the tokenised data instead of reusing datasets' cache."})
    no_keep_linebreaks: bool = field(default=False, metadata={"help": "Drop the line breaks (and blank lines) of .txt files before tokenising."})
    push_to_hub: bool = field(default=False, metadata={"help": "Refused: this job does not upload to the Hub."})
    hub_model_id: str | None = field(default=None, metadata={"help": "Refused: this job does not upload to the Hub."})
    hub_token: str | None = field(default=None, metadata={"help": "Refused: this job does not upload to the Hub."})
    validation_split_percentage: int = field(default=5, metadata={"help": "Percent of train held out for validation when the data has no validation split."})
    packing: bool = field(default=True, metadata={"help": "Pack text into blocks of --block_size tokens; --packing false: one variable-length example per paragraph, padded per batch."})
    block_size: int = field(default=128, metadata={"help": "Sequence length in tokens (packed block, or truncation length)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training examples (after tokenisation)."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on the first N validation examples (0 or less: all); None: all of --validation_file, else 256."})
    per_device_train_batch_size: int = field(default=4, metadata={"help": "Micro-batch size per process, examples."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Evaluation batch size per process, examples."})
    gradient_accumulation_steps: int | None = field(default=None, metadata={"help": "Micro-batches per optimizer step (K); None: $ACCELERATE_GRADIENT_ACCUMULATION_STEPS, else 4."})
    auto_find_batch_size: bool = field(default=False, metadata={"help": "On an allocation failure in training, shrink the micro-batch by its smallest prime factor p and multiply K (every K of --accumulation_schedule) by p, so the effective batch stays the same; resumes from the newest checkpoint. Several processes need accelerate launch --max_restarts N (docs/memory.md)."})
    accumulation_schedule: str | None = field(default=None, metadata={"help": "Batch-size warm-up: STEP:K pairs, e.g. 0:1,100:2,300:4 (K micro-batches per window from that many optimizer steps on; must start at 0). Conflicts with --gradient_accumulation_steps unless that equals the K at step 0."})
    lr_scaling: str = field(default="none", metadata={"help": f"With --accumulation_schedule: scale the learning rate with the effective batch relative to the K at step 0, one of {LR_RULES} (linear: Goyal et al. 2017; sqrt: Krizhevsky 2014)."})
    learning_rate: float = field(default=2e-3, metadata={"help": "Peak learning rate (AdamW)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (not applied to biases and LayerNorm weights)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": f"One of {SCHEDULERS}."})
    num_warmup_steps: int = field(default=10, metadata={"help": "Warm-up optimizer steps."})
    max_train_steps: int | None = field(default=None, metadata={"help": "Optimizer steps to run (overrides --num_train_epochs); 0 or less: use epochs; None: 100 unless --num_train_epochs is given."})
    num_train_epochs: int | None = field(default=None, metadata={"help": "Passes over the train split when --max_train_steps is not set; None: 1."})
    max_grad_norm: float | None = field(default=1.0, metadata={"help": "Clip the gradient norm to this; 0 or less: no clipping."})
    fused_linear_cross_entropy: str = field(default="auto", metadata={"help": "The causal-LM loss from the last hidden states in chunks of tokens, inside the output layer's forward, so no (batch, seq, vocab) float32 logits exist: 'auto' (where the model's output layer is a plain linear layer whose result the model returns unchanged, else the logits), 'chunked' or 'torch' (that implementation, or exit 2), 'off' (the logits, as transformers computes them). train_summary.json's 'loss' says which ran."})
    fused_linear_cross_entropy_chunk: int | None = field(default=None, metadata={"help": "Tokens per chunk of --fused_linear_cross_entropy; None: a chunk's float32 logits take at most 64 MiB."})
    loss_normalization: str = field(default="tokens", metadata={"help": f"One of {NORMALIZATIONS}: exact token-mean over the window, or Accelerate's per-micro-batch mean / K."})
    sync_each_batch: bool = field(default=False, metadata={"help": "All-reduce gradients on every micro-batch (slower; for A/B comparisons); the same as --accumulation_policy sync_each_batch."})
    accumulation_policy: str | None = field(default=None, metadata={"help": f"What a window skips and keeps, one of {list(POLICIES)}; the two no_sync_no_reshard ones need FSDP2 (accelerate_configs/cpu_fsdp.yaml) and keep parameters gathered (docs/fsdp.md); reduce_scatter_each_batch needs HSDP (accelerate_configs/cpu_hsdp.yaml) and defers only the all-reduce across replicas (docs/hsdp.md). Default: no_sync."})
    profile_comm: bool = field(default=False, metadata={"help": "Record every gradient all-reduce and phase times; adds a 'comm' block to train_summary.json."})
    profile_ab_steps: int = field(default=0, metadata={"help": "Measure the no_sync saving: alternate N windows with and N without no_sync (after 1 warm-up step); implies --profile_comm."})
    profile_overhead_steps: int = field(default=0, metadata={"help": "Measure the profiler's own cost: after the A/B windows, alternate N windows with it recording and N without; implies --profile_comm."})
    trace_dir: str | None = field(default=None, metadata={"help": "Write a torch.profiler Chrome trace per process here (Perfetto); implies --profile_comm."})
    with_tracking: bool = field(default=False, metadata={"help": "Log per-step figures to experiment trackers (Accelerate's log_with) under --output_dir."})
    report_to: str = field(default="all", metadata={"help": f"Tracker for --with_tracking: one of {list(TRACKERS)} ('all': every installed one; tensorboard is the tested one)."})
    logging_steps: int = field(default=10, metadata={"help": "Log loss, learning rate and tokens/s every N optimizer steps."})
    seed: int = field(default=42, metadata={"help": "Random seed (model init, shuffling)."})
    output_dir: str = field(default="runs/train", metadata={"help": "Where the model, train_summary.json and checkpoints are written."})
    checkpointing_steps: str | None = field(default=None, metadata={"help": "Save a checkpoint every N optimizer steps (step_<N>), or 'epoch' after each epoch (epoch_<E>); always at a window boundary."})
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "Continue from a checkpoint folder, or 'latest' (the newest complete one in --output_dir)."})
    checkpoints_total_limit: int | None = field(default=None, metadata={"help": "Keep at most N checkpoints; the oldest is deleted after the new one is complete."})
    torch_compile: bool = field(default=False, metadata={"help": "Compile the model with torch.compile through Accelerate's dynamo plugin: the whole model under DDP, each block under FSDP2 (docs/compile.md)."})
    torch_compile_backend: str | None = field(default=None, metadata={"help": "torch.compile backend (implies --torch_compile), e.g. inductor (the default), aot_eager, eager."})
    torch_compile_mode: str | None = field(default=None, metadata={"help": f"inductor mode (implies --torch_compile), one of {list(MODES)}."})
    gradient_checkpointing: bool = gradient_checkpointing_field()
    gradient_checkpointing_kwargs: str | None = gradient_checkpointing_kwargs_field()
    ddp_timeout: int = field(default=1800, metadata={"help": "Seconds a collective may wait for the other processes before the job fails (torch.distributed timeout)."})
    # DDP constructor settings (Trainer's flag names), passed as Accelerate's DistributedDataParallelKwargs
    ddp_bucket_cap_mb: float | None = ddp_field("ddp_bucket_cap_mb")
    gradient_as_bucket_view: bool = ddp_field("gradient_as_bucket_view")
    ddp_static_graph: bool = ddp_field("ddp_static_graph")
    ddp_find_unused_parameters: bool = ddp_field("ddp_find_unused_parameters")

    def __post_init__(self):
        """Normalise 'off' values and check ranges; raises UsageError naming the flag."""
        resolve_run_clm_flags(self)  # steps vs epochs, evaluation count, Hub flags refused
        self.lora = resolve_lora_flags(self)  # None without --use_peft
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            self.max_grad_norm = None
        if self.max_eval_samples is not None and self.max_eval_samples <= 0:
            self.max_eval_samples = None
        for flag in ("per_device_train_batch_size", "per_device_eval_batch_size", "block_size", "num_train_epochs",
                     "logging_steps", "gradient_accumulation_steps", "max_train_samples"):
            if getattr(self, flag) is not None:
                checks.at_least(f"--{flag}", getattr(self, flag))
        for flag in ("profile_ab_steps", "profile_overhead_steps", "num_warmup_steps"):
            checks.at_least(f"--{flag}", getattr(self, flag), minimum=0, fix="pass 0 (off) or a positive integer")
        if self.profile_ab_steps or self.profile_overhead_steps or self.trace_dir:
            self.profile_comm = True
        checks.positive("--learning_rate", self.learning_rate, fix="pass e.g. 2e-3")
        checks.one_of("--loss_normalization", self.loss_normalization, NORMALIZATIONS)
        checks.one_of("--fused_linear_cross_entropy", self.fused_linear_cross_entropy, FUSED_CHOICES)
        if self.fused_linear_cross_entropy_chunk is not None:
            checks.at_least("--fused_linear_cross_entropy_chunk", self.fused_linear_cross_entropy_chunk,
                            fix="pass a token count >= 1 or omit it")
        checks.one_of("--lr_scheduler_type", self.lr_scheduler_type, SCHEDULERS)
        checks.one_of("--report_to", self.report_to, TRACKERS)
        if self.model_name_or_path is None:
            checks.one_of("--model_preset", self.model_preset, sorted(PRESETS) + sorted(LLAMA_PRESETS) + sorted(MOE_PRESETS))
        if self.router_aux_loss_scope is not None:
            checks.one_of("--router_aux_loss_scope", self.router_aux_loss_scope, ["window", "micro_batch"])
        if self.train_file is not None and self.dataset_name is not None:
            raise UsageError("--train_file", "given together with --dataset_name", "pass only one data source")
        check_data_flags(self.train_file, self.validation_split_percentage, self.validation_file)
        if self.checkpointing_steps is not None and self.checkpointing_steps != "epoch":
            if not self.checkpointing_steps.isdigit() or int(self.checkpointing_steps) < 1:
                raise UsageError("--checkpointing_steps", f"must be a positive integer or 'epoch' (got {self.checkpointing_steps!r})",
                                 "pass e.g. 100 or epoch")
            self.checkpointing_steps = int(self.checkpointing_steps)
        self._check_schedule()
        self.accumulation_policy = resolve_policy(self.accumulation_policy, self.sync_each_batch).name
        for flag in ("checkpoints_total_limit", "ddp_timeout"):
            if getattr(self, flag) is not None:
                checks.at_least(f"--{flag}", getattr(self, flag))
        check_ddp_flags(self)
        if resolve_checkpointing(self.gradient_checkpointing, self.gradient_checkpointing_kwargs)[0]:
            self.gradient_checkpointing_kwargs = parse_checkpointing_kwargs(self.gradient_checkpointing_kwargs)
        if resolve_flags(self.torch_compile, self.torch_compile_backend, self.torch_compile_mode) is not None:
            self.torch_compile = True

    def _check_schedule(self) -> None:
        """Parse --accumulation_schedule into ``{step: K}``; it sets K unless --gradient_accumulation_steps agrees."""
        checks.one_of("--lr_scaling", self.lr_scaling, LR_RULES)
        if self.accumulation_schedule is None:
            if self.lr_scaling != "none":
                raise UsageError("--lr_scaling", "scales the learning rate when K changes, but no "
                                 "--accumulation_schedule was given", "add --accumulation_schedule or drop --lr_scaling")
            return
        if not isinstance(self.accumulation_schedule, dict):
            self.accumulation_schedule = parse_accumulation_schedule(self.accumulation_schedule)
        first = self.accumulation_schedule[0]
        if self.gradient_accumulation_steps is not None and self.gradient_accumulation_steps != first:
            raise UsageError("--gradient_accumulation_steps", f"{self.gradient_accumulation_steps} conflicts with "
                             f"--accumulation_schedule, whose K at step 0 is {first}",
                             "drop --gradient_accumulation_steps (the schedule sets K) or make them agree")
        self.gradient_accumulation_steps = first
