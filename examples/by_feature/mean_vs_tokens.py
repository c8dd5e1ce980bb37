"""examples/custom_loop.py + the mean-of-means bias, measured on variable-length data.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/by_feature/mean_vs_tokens.py

The loop's default normalisation (``tokens``) divides the window's summed token
loss by its target tokens over all micro-batches and processes. The textbook
alternative, averaging per-micro-batch token means (Accelerate's guide, and
transformers' Trainer before its October 2024 fix), weights a token of a short
micro-batch more than one of a long micro-batch. This script records every
micro-batch's summed loss S and target tokens n, and prints, per optimizer
step, the exact token mean sum(S) / sum(n) next to the mean of the S / n: the
gap is the bias. Lines marked ``# New Code #`` are the diff to custom_loop.py.
"""

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import get_scheduler

from accum_kit import LoopCallback, build_accelerator, train_loop
from accum_kit.job.data import build_collator, build_tokenizer, load_raw_datasets, tokenize_datasets
from accum_kit.job.evaluation import evaluate_loss
from accum_kit.core.loss import causal_lm_loss
from accum_kit.job.models import build_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--train_file", default=None, help="local .txt/.json/.csv file; default: the Python stdlib sources")
    p.add_argument("--model_preset", default="tiny", help="accum_kit.job.models.PRESETS key")
    p.add_argument("--per_device_train_batch_size", type=int, default=4, help="examples per micro-batch per process")
    p.add_argument("--gradient_accumulation_steps", type=int, default=4, help="micro-batches per optimizer step (K)")
    p.add_argument("--block_size", type=int, default=128, help="tokens per example")
    # New Code #
    p.add_argument("--max_train_steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# New Code #
class MicroBatchLosses(LoopCallback):
    """``loss_fn`` for train_loop that also records (optimizer step, summed loss S, target tokens n) per micro-batch."""

    def __init__(self):
        self.step, self.records = 0, []

    def on_micro_batch_begin(self, state):
        self.step = state.step

    def __call__(self, model, batch):
        summed, n = causal_lm_loss(model, batch)
        self.records.append((self.step, float(summed.detach()), int(n)))
        return summed, n


def main(argv=None) -> dict:
    args = parse_args(argv)
    accelerator = build_accelerator(args.gradient_accumulation_steps)  # cpu=True when needed, process-count check
    tokenizer = build_tokenizer()  # bytes: no files needed
    with accelerator.main_process_first():
        raw, _ = load_raw_datasets(train_file=args.train_file)
        # New Code #: one variable-length example per piece of text, padded per micro-batch
        data = tokenize_datasets(raw, tokenizer, block_size=args.block_size, packing=False)
    collate = build_collator(tokenizer, packing=False)  # New Code #
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
    recorder = MicroBatchLosses()  # New Code #
    result = train_loop(accelerator, model, optimizer, train_dl, lr_scheduler=scheduler,
                        max_train_steps=args.max_train_steps, max_grad_norm=1.0,
                        loss_fn=recorder, callbacks=[recorder])  # New Code #
    after, _ = evaluate_loss(accelerator, model, eval_dl)
    accelerator.print(f"eval loss {before:.3f} -> {after:.3f}; median {result.median_step_seconds:.3f} s/step, "
                      f"{result.tokens_per_second:.0f} tokens/s on {accelerator.num_processes} processes")

    # New Code #: every process's micro-batches, then both averages per optimizer step
    from accelerate.utils import gather_object

    records = gather_object([recorder.records])
    token_mean, mean_of_means = [], []
    for step in range(result.optimizer_steps):
        window = [(s, n) for per_rank in records for (k, s, n) in per_rank if k == step]
        token_mean.append(sum(s for s, _ in window) / sum(n for _, n in window))
        mean_of_means.append(sum(s / n for s, n in window) / len(window))
        accelerator.print(f"step {step + 1}: token mean {token_mean[-1]:.4f}  mean of means {mean_of_means[-1]:.4f}  "
                          f"bias {mean_of_means[-1] - token_mean[-1]:+.4f} nats  (loop logged {result.train_loss[step]:.4f})")
    return {"world_size": accelerator.num_processes, "eval_loss_before": before, "eval_loss_after": after,
            "train_loss": result.train_loss, "micro_batches": records,
            "token_mean": token_mean, "mean_of_means": mean_of_means}


if __name__ == "__main__":
    main()
