"""examples/custom_loop.py plus exact checkpoint/resume and preemption (diff marked ``# New Code #``).

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/by_feature/checkpointing.py \
        --checkpointing_steps 10 --output_dir runs/ckpt
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/by_feature/checkpointing.py \
        --checkpointing_steps 10 --output_dir runs/ckpt --resume_from_checkpoint latest

A ``Checkpointer`` saves ``<output_dir>/step_<N>`` after every N-th optimizer
step, i.e. at a window boundary, where the gradients are empty: Accelerate's
``save_state`` does not save ``.grad``. ``train_loop(..., resume_from=...)``
loads it and continues at the same micro-batch of the same shuffled epoch, so
the resumed run's losses and parameters equal those of an uninterrupted run.
SIGTERM or SIGUSR1 makes every process finish its window, save, and raise
``Preempted``; this script then exits with code 75.
"""

import argparse
import hashlib
import sys

import torch
from torch.utils.data import DataLoader
from transformers import get_scheduler

from accum_kit import build_accelerator, train_loop
# New Code #
from accum_kit.core.checkpoint import PREEMPTED_EXIT_CODE, Checkpointer, Preempted, resolve_checkpoint
from accum_kit.job.data import build_collator, build_tokenizer, load_raw_datasets, tokenize_datasets
from accum_kit.job.evaluation import evaluate_loss
from accum_kit.job.models import build_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--train_file", default=None, help="local .txt/.json/.csv file; default: the Python stdlib sources")
    p.add_argument("--model_preset", default="tiny", help="accum_kit.job.models.PRESETS key")
    p.add_argument("--per_device_train_batch_size", type=int, default=4, help="examples per micro-batch per process")
    p.add_argument("--gradient_accumulation_steps", type=int, default=4, help="micro-batches per optimizer step (K)")
    p.add_argument("--block_size", type=int, default=128, help="tokens per example")
    p.add_argument("--max_train_steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    # New Code #
    p.add_argument("--output_dir", default="runs/checkpointing", help="where step_<N> checkpoints go")
    p.add_argument("--checkpointing_steps", type=int, default=10, help="save every N optimizer steps")
    p.add_argument("--resume_from_checkpoint", default=None, help="a step_<N> folder, or 'latest' in --output_dir")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    accelerator = build_accelerator(args.gradient_accumulation_steps)  # cpu=True when needed, process-count check
    tokenizer = build_tokenizer()  # bytes: no files needed
    with accelerator.main_process_first():
        raw, _ = load_raw_datasets(train_file=args.train_file)
        data = tokenize_datasets(raw, tokenizer, block_size=args.block_size)
    collate = build_collator(tokenizer)
    train_dl = DataLoader(data["train"], batch_size=args.per_device_train_batch_size, shuffle=True, collate_fn=collate)
    eval_dl = DataLoader(data["validation"].select(range(min(64, len(data["validation"])))), batch_size=8,
                         collate_fn=collate)
    model = build_model(args.model_preset, len(tokenizer), n_positions=args.block_size, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    # A prepared scheduler steps once per process per optimizer step: scale its lengths.
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0,
                              num_training_steps=args.max_train_steps * accelerator.num_processes)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)

    before, _ = evaluate_loss(accelerator, model, eval_dl)
    # New Code #
    # Resume needs the same objects prepared in the same order, and the same K, processes and batch size.
    resume = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir) if args.resume_from_checkpoint else None
    checkpointer = Checkpointer(accelerator, args.output_dir, checkpointing_steps=args.checkpointing_steps)
    try:
        result = train_loop(accelerator, model, optimizer, train_dl, lr_scheduler=scheduler,
                            max_train_steps=args.max_train_steps, max_grad_norm=1.0,
                            checkpointer=checkpointer, resume_from=resume)
    except Preempted as stop:  # saved at a window boundary on every process
        accelerator.print(f"{stop}; continue with --resume_from_checkpoint latest")
        sys.exit(PREEMPTED_EXIT_CODE)
    after, _ = evaluate_loss(accelerator, model, eval_dl)
    accelerator.print(f"eval loss {before:.3f} -> {after:.3f}; median {result.median_step_seconds:.3f} s/step, "
                      f"{result.tokens_per_second:.0f} tokens/s on {accelerator.num_processes} processes")
    # New Code #
    return {"world_size": accelerator.num_processes, "eval_loss_before": before, "eval_loss_after": after,
            "train_loss": result.train_loss, "resumed_from_step": result.resumed_from_step,
            "checkpoints": [str(p) for p in checkpointer.saved],
            "final_parameters_sha256": hashlib.sha256(b"".join(
                p.detach().cpu().numpy().tobytes() for p in accelerator.unwrap_model(model).parameters())).hexdigest()}


if __name__ == "__main__":
    main()
