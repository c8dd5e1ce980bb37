"""The custom loop plus a communication profile: what DDP's all-reduce costs and what no_sync saves.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/by_feature/profile_comm.py

``examples/custom_loop.py`` plus the blocks marked ``# New Code #``: a
``CommProfiler`` (a DDP comm hook that records every gradient-bucket
all-reduce: calls, bytes, seconds, and the phase times of each micro-batch)
handed to ``train_loop(..., profiler=prof)``, and an ``ABSwitch`` that makes
``--ab_steps`` windows sync on every micro-batch (Accelerate's
``sync_each_batch``), alternating with no_sync windows, to measure the saving.
The update is the same either way; only when the all-reduce happens changes.
The table's counts cover the no_sync windows; the A/B windows are counted apart.
"""

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import get_scheduler

from accum_kit import build_accelerator, train_loop
from accum_kit.job.data import build_collator, build_tokenizer, load_raw_datasets, tokenize_datasets
from accum_kit.job.evaluation import evaluate_loss
from accum_kit.job.models import build_model

# New Code #
from accum_kit.profiler import ABSwitch, CommProfiler, format_table


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
    p.add_argument("--ab_steps", type=int, default=2,
                   help="windows run with sync_each_batch (each followed by a no_sync one) to measure the saving")
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
    # The profiler wraps DDP's all-reduce in a comm hook; the switch alternates windows after one warm-up step.
    prof = CommProfiler(accelerator, model)
    ab = ABSwitch(accelerator, args.ab_steps, profiler=prof, warmup_steps=1)
    result = train_loop(accelerator, model, optimizer, train_dl, lr_scheduler=scheduler,
                        max_train_steps=args.max_train_steps, max_grad_norm=1.0, profiler=prof, callbacks=[ab])
    comm = {**prof.summary(), **ab.summary()}  # summary() is collective: every process calls it
    prof.mode = "sync_each_batch"  # the A/B windows that synced on every micro-batch, counted apart
    ab_comm = prof.summary()
    prof.mode = "no_sync"
    accelerator.print(format_table(comm))
    after, _ = evaluate_loss(accelerator, model, eval_dl)
    accelerator.print(f"eval loss {before:.3f} -> {after:.3f}; median {result.median_step_seconds:.3f} s/step, "
                      f"{result.tokens_per_second:.0f} tokens/s on {accelerator.num_processes} processes")
    # New Code #
    figures = ("allreduce_calls", "syncs", "skipped_syncs", "allreduce_bytes", "micro_batches", "allreduce_calls_per_sync")
    return {"world_size": accelerator.num_processes, "eval_loss_before": before, "eval_loss_after": after,
            "train_loss": result.train_loss,
            "K": accelerator.gradient_accumulation_steps, "steps": result.optimizer_steps,
            **{k: comm[k] for k in figures}, "ab_steps_each": comm["ab_steps_each"],
            "ab_sync_each_batch": {k: ab_comm[k] for k in figures}, "comm": comm}


if __name__ == "__main__":
    main()
