"""The accumulation loop in your own script (or notebook), without the train job.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/custom_loop.py

The same script runs unchanged under every engine: ``cpu_fsdp.yaml`` (FSDP2,
any ``--accumulation_policy``), ``cpu_hsdp.yaml`` (4 processes) and
``cpu_deepspeed.yaml`` (add ``--zero_stage 1|2|3`` to ``accelerate launch``);
exact accumulation makes the losses those of the DDP run, up to the order of
the reductions.

Builds every piece by hand, in the order of Accelerate's gradient accumulation
guide, then hands them to ``accum_kit.train_loop``: forward and backward of
every micro-batch inside ``accelerator.accumulate`` (no all-reduce until the
window's last micro-batch), the exact token-count rescale, then clipping,
optimizer and scheduler steps. The scripts in ``examples/by_feature/`` are
this one plus a short diff marked ``# New Code #``.
"""

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import get_scheduler

from accum_kit import build_accelerator, train_loop
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
    p.add_argument("--accumulation_policy", default=None,
                   help="what a window skips and keeps (accum_kit.engines.policies: no_sync, sync_each_batch; "
                        "under FSDP2 also no_sync_no_reshard_after_backward, no_sync_no_reshard; under HSDP also "
                        "reduce_scatter_each_batch); default no_sync (under DeepSpeed the ZeRO stage decides)")
    p.add_argument("--gradient_checkpointing", action="store_true",
                   help="recompute each transformer block's forward in backward (less activation memory; applied "
                        "in accelerator.prepare under every engine, docs/memory.md)")
    p.add_argument("--gradient_checkpointing_kwargs", default=None,
                   help='torch.utils.checkpoint arguments as JSON, e.g. \'{"use_reentrant": false}\' (the default)')
    p.add_argument("--block_size", type=int, default=128, help="tokens per example")
    p.add_argument("--max_train_steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="clip the global gradient norm (every engine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--use_peft", action="store_true",
                   help="train LoRA adapters (peft) on c_attn instead of every weight; the loop takes the PeftModel as is")
    p.add_argument("--lora_r", type=int, default=8, help="with --use_peft: the adapters' rank (alpha 2 r)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # the engine (DDP, FSDP2, HSDP, DeepSpeed ZeRO) comes from the accelerate config; nothing below depends on it
    accelerator = build_accelerator(args.gradient_accumulation_steps, accumulation_policy=args.accumulation_policy,
                                    gradient_checkpointing=args.gradient_checkpointing,
                                    gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    tokenizer = build_tokenizer()  # bytes: no files needed
    with accelerator.main_process_first():
        raw, _ = load_raw_datasets(train_file=args.train_file)
        data = tokenize_datasets(raw, tokenizer, block_size=args.block_size)
    collate = build_collator(tokenizer)
    train_dl = DataLoader(data["train"], batch_size=args.per_device_train_batch_size, shuffle=True, collate_fn=collate)
    eval_dl = DataLoader(data["validation"].select(range(min(64, len(data["validation"])))), batch_size=8,
                         collate_fn=collate)
    model = build_model(args.model_preset, len(tokenizer), n_positions=args.block_size, seed=args.seed)
    if args.use_peft:  # every weight frozen but the adapters': nothing else below changes
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                                                 target_modules=["c_attn"], task_type="CAUSAL_LM"))
    # the parameters that train (all of them without adapters): no optimizer state for frozen weights
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    # A prepared scheduler steps once per process per optimizer step: scale its lengths.
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0,
                              num_training_steps=args.max_train_steps * accelerator.num_processes)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)

    before, _ = evaluate_loss(accelerator, model, eval_dl)
    result = train_loop(accelerator, model, optimizer, train_dl, lr_scheduler=scheduler,
                        max_train_steps=args.max_train_steps, max_grad_norm=args.max_grad_norm)
    after, _ = evaluate_loss(accelerator, model, eval_dl)
    accelerator.print(f"eval loss {before:.3f} -> {after:.3f}; median {result.median_step_seconds:.3f} s/step, "
                      f"{result.tokens_per_second:.0f} tokens/s on {accelerator.num_processes} processes")
    return {"world_size": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
            "eval_loss_before": before, "eval_loss_after": after, "train_loss": result.train_loss,
            "final_learning_rate": scheduler.get_last_lr()[0],
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "gradient_checkpointing": accelerator.run_plan.gradient_checkpointing}


if __name__ == "__main__":
    main()
