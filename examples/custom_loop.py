"""The accumulation loop in your own script (or notebook), without the train job.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/custom_loop.py

Builds every piece by hand, in the order of Accelerate's gradient accumulation
guide, then hands them to accum_kit.train_loop.
"""

import torch
from torch.utils.data import DataLoader
from transformers import get_scheduler

from accum_kit import build_accelerator, train_loop
from accum_kit.data import build_collator, build_tokenizer, load_raw_datasets, tokenize_datasets
from accum_kit.evaluation import evaluate_loss
from accum_kit.models import build_model

STEPS, K = 30, 4

accelerator = build_accelerator(gradient_accumulation_steps=K)  # cpu=True when needed, process-count check
tokenizer = build_tokenizer()  # bytes: no files needed
with accelerator.main_process_first():
    data = tokenize_datasets(load_raw_datasets()[0], tokenizer, block_size=128)
collate = build_collator(tokenizer)
train_dl = DataLoader(data["train"], batch_size=4, shuffle=True, collate_fn=collate)
eval_dl = DataLoader(data["validation"].select(range(64)), batch_size=8, collate_fn=collate)
model = build_model("tiny", len(tokenizer), n_positions=128, seed=0)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
# A prepared scheduler steps once per process per optimizer step: scale its lengths.
scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=STEPS * accelerator.num_processes)
model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)

before, _ = evaluate_loss(accelerator, model, eval_dl)
result = train_loop(accelerator, model, optimizer, train_dl, lr_scheduler=scheduler, max_train_steps=STEPS, max_grad_norm=1.0)
after, _ = evaluate_loss(accelerator, model, eval_dl)
accelerator.print(f"eval loss {before:.3f} -> {after:.3f}; median {result.median_step_seconds:.3f} s/step, "
                  f"{result.tokens_per_second:.0f} tokens/s on {accelerator.num_processes} processes")
