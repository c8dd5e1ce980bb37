"""``accum-kit verify`` on the command line: its flags, help text and run function (see :mod:`accum_kit.cli`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from accelerate import PartialState

from ..engines.activation_checkpointing import (gradient_checkpointing_field, gradient_checkpointing_kwargs_field,
                                                resolve_checkpointing)
from ..engines.compiling import MODES, resolve_flags
from ..errors import UsageError
from ..outputs import atomic_write_json, check_output_dir
from ..engines.policies import resolve_policy
from .check import verify_accumulation
from .settings import DEFAULT_BATCH_SIZE, MODEL_PRESETS, validate
from .compare import DEFAULT_ATOL, DEFAULT_RTOL, MIXED_PRECISIONS
from .report import SELECTABLE

DESCRIPTION = (
    "Check that the accumulated gradient (K micro-batches per process, all processes, a full and a partial "
    "window) equals the gradient of one big batch on one process; report mean-of-means, the DDP "
    "semantics of a sum loss and (informational) transformers' Trainer on the same windows. Run under accelerate launch on any number of processes. Exit 0 when the row "
    "selected by --loss_normalization passes, 1 when it fails, 2 on bad input.")


@dataclass
class VerifyArguments:
    """Flags of ``accum-kit verify`` (parsed by transformers' HfArgumentParser; ``--help`` shows defaults)."""

    gradient_accumulation_steps: int | None = field(default=None, metadata={"help": "Micro-batches per window (K); None: $ACCELERATE_GRADIENT_ACCUMULATION_STEPS, else 4."})
    per_device_train_batch_size: int = field(default=DEFAULT_BATCH_SIZE, metadata={"help": "Examples per micro-batch per process."})
    seed: int = field(default=0, metadata={"help": "Seed of the examples and of the preset model."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "Local causal LM (save_pretrained directory) instead of a preset."})
    model_preset: str = field(default="tiny", metadata={"help": f"Randomly initialised model, one of {list(MODEL_PRESETS)}: GPT-2 style (tiny), LlamaForCausalLM (llama_tiny, llama_small) or a Mixtral mixture of experts (moe_tiny: the report adds the router aux loss finding)."})
    loss_normalization: str = field(default="tokens", metadata={"help": f"The row that decides the exit code, one of {list(SELECTABLE)}: tokens, or mean (mean-of-means)."})
    trainer_row: bool = field(default=True, metadata={"help": "Also run transformers' Trainer (average_tokens_across_devices, unclipped) on the same windows and compare its update's size and direction with the oracle (informational: never changes the exit code); --no_trainer_row: skip it."})
    partial_window: bool = field(default=True, metadata={"help": "Also verify a partial last window of ceil(K/2) micro-batches per process; --no_partial_window: one full window only."})
    rtol: float | None = field(default=None, metadata={"help": f"Relative tolerance. Default: float32 {DEFAULT_RTOL:g}, pass iff |g - g_oracle| <= atol + rtol |g_oracle| elementwise; bf16/fp16: sqrt(64) x unit roundoff (bf16 2^-5), pass iff ||g - g_oracle|| / ||g_oracle|| <= rtol per window."})
    atol: float | None = field(default=None, metadata={"help": f"Absolute tolerance of the elementwise float32 criterion ({DEFAULT_ATOL:g}), gradient units of the token-mean gradient (x N target tokens for the sum rows); unused under bf16/fp16."})
    mixed_precision: str = field(default="no", metadata={"help": f"Build the Accelerator with this mixed_precision, one of {list(MIXED_PRECISIONS)}; the tolerance switches to the precision's (see --rtol)."})
    accumulation_policy: str | None = field(default=None, metadata={"help": "Build the Accelerator with this accumulation policy (accum_kit.engines.policies; the FSDP2-only ones need an FSDP2 launch config); default no_sync."})
    torch_compile: bool = field(default=False, metadata={"help": "Compile the rows' model with torch.compile through Accelerate's dynamo plugin (whole model under DDP, each block under FSDP2; the oracle stays eager; docs/compile.md)."})
    torch_compile_backend: str | None = field(default=None, metadata={"help": "torch.compile backend (implies --torch_compile), e.g. inductor (the default), aot_eager, eager."})
    torch_compile_mode: str | None = field(default=None, metadata={"help": f"inductor mode (implies --torch_compile), one of {list(MODES)}."})
    gradient_checkpointing: bool = gradient_checkpointing_field()
    gradient_checkpointing_kwargs: str | None = gradient_checkpointing_kwargs_field()
    json: str | None = field(default=None, metadata={"help": "Also write the report as JSON to this file (main process, atomically)."})

    def __post_init__(self):
        """Check ranges, choices and the --json path before any work; raises UsageError naming the flag."""
        validate(self.gradient_accumulation_steps, self.per_device_train_batch_size, self.rtol, self.atol,
                 self.loss_normalization, self.mixed_precision, self.model_preset, self.model_name_or_path)
        if self.json is not None:
            if os.path.isdir(self.json):
                raise UsageError("--json", f"{self.json} is a directory", "pass a file path, e.g. verify.json")
            check_output_dir(os.path.dirname(os.path.abspath(self.json)), flag="--json")
        resolve_policy(self.accumulation_policy)  # an unknown name exits 2 before any work
        resolve_checkpointing(self.gradient_checkpointing, self.gradient_checkpointing_kwargs)  # bad JSON: exit 2
        if resolve_flags(self.torch_compile, self.torch_compile_backend, self.torch_compile_mode) is not None:
            self.torch_compile = True  # a backend or a mode implies it (transformers' rule)


ARGUMENTS = VerifyArguments


def run_command(args: VerifyArguments) -> int:
    """``accum-kit verify``: 0 when the selected row passes, 1 when it fails (bad input raises UsageError)."""
    report = verify_accumulation(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        seed=args.seed,
        model_name_or_path=args.model_name_or_path,
        model_preset=args.model_preset,
        partial_window=args.partial_window,
        trainer_row=args.trainer_row,
        loss_normalization=args.loss_normalization,
        rtol=args.rtol,
        atol=args.atol,
        mixed_precision=args.mixed_precision,
        accumulation_policy=args.accumulation_policy,
        torch_compile=args.torch_compile,
        torch_compile_backend=args.torch_compile_backend,
        torch_compile_mode=args.torch_compile_mode,
        gradient_checkpointing=args.gradient_checkpointing,
        gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
    )
    state = PartialState()
    if state.is_main_process:
        print(report.format(), flush=True)
        if args.json is not None:
            atomic_write_json(args.json, report.to_dict())
    state.wait_for_everyone()
    return report.exit_code
