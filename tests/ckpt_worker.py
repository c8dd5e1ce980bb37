"""Worker for tests/test_checkpoint_loop.py (not a test module): loop-level checkpoint/resume scenarios.

    python tests/ckpt_worker.py SPEC.json OUT_DIR                              # one process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml \
        tests/ckpt_worker.py SPEC.json OUT_DIR                                 # two processes

SPEC.json: ``{"pad_id": int, "scenarios": [{"name", "model_config": {...GPT2Config kwargs}, "examples": [...],
"K", "B", "epochs", "max_train_steps", "optimizer": "adamw"|"sgd", "lr", "scheduler": "cosine"|"constant",
"max_grad_norm", "shuffle", "generator": bool, "resume_from": [step, ...],
optional "schedule": [[step, K], ...] and "lr_scaling"}]}`` (a schedule's first K is ``K``).

Per scenario, an uninterrupted ``train_loop`` with a ``Checkpointer`` saving every
step, then, for every step in ``resume_from``, a fresh Accelerator, model,
optimizer, scheduler and dataloader built the same way and ``train_loop(...,
resume_from=<checkpoint>)``. Written (rank 0): ``<name>/full.pt`` and
``<name>/resumed_<step>.pt``, each ``{"train_loss", "steps": [state_dict after
every step run in this process], "final", "resumed_from_step", "micro_batches", "epochs",
"resumed_at": [epoch, micro-batches done in it] of the checkpoint}``,
plus ``<name>/init.pt``. The test compares them; nothing is checked here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

import accum_kit
import job_helpers as jh  # the worker runs as a script from tests/
from accum_kit.core.checkpoint import Checkpointer
from accum_kit.core.accumulation_schedule import scheduled_steps


class Steps(accum_kit.LoopCallback):
    def __init__(self, raw, optimizer):
        self.raw, self.optimizer, self.steps, self.lrs = raw, optimizer, [], []

    def on_step_begin(self, state):
        self.lrs.append(self.optimizer.param_groups[0]["lr"])  # the rate this step uses

    def on_step_end(self, state):
        self.steps.append({k: v.detach().clone() for k, v in self.raw.state_dict().items()})


def run(spec, sc, ckpt_dir: Path, resume_from=None) -> dict:
    jh.reset_accelerate_state()
    acc = accum_kit.build_accelerator(sc["K"])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**sc["model_config"]))
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if sc["optimizer"] == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=sc["lr"])
    else:
        opt = torch.optim.SGD(model.parameters(), lr=sc["lr"])
    gen = torch.Generator().manual_seed(7) if sc["generator"] else None
    dl = DataLoader(sc["examples"], batch_size=sc["B"], shuffle=sc["shuffle"], generator=gen,
                    collate_fn=jh.pad_collate(spec["pad_id"]))
    model, opt, dl = acc.prepare(model, opt, dl)
    schedule = {s: k for s, k in sc["schedule"]} if sc.get("schedule") else None
    steps = sc["max_train_steps"] or scheduled_steps(len(dl), schedule or {0: sc["K"]}, sc["epochs"])
    sched = acc.prepare(get_scheduler(sc["scheduler"], opt, num_warmup_steps=2 * acc.num_processes,
                                      num_training_steps=steps * acc.num_processes))
    rec = Steps(acc.unwrap_model(model), opt)
    ckpt = Checkpointer(acc, ckpt_dir, checkpointing_steps=1, signals=()) if resume_from is None else None
    result = accum_kit.train_loop(acc, model, opt, dl, lr_scheduler=sched, num_train_epochs=sc["epochs"],
                                  max_train_steps=sc["max_train_steps"], max_grad_norm=sc["max_grad_norm"], callbacks=[rec],
                                  checkpointer=ckpt, resume_from=resume_from, progress=False,
                                  accumulation_schedule=schedule, lr_scaling=sc.get("lr_scaling", "none"))
    acc.wait_for_everyone()
    return {"train_loss": result.train_loss, "steps": rec.steps, "final": rec.steps[-1] if rec.steps else None,
            "resumed_from_step": result.resumed_from_step, "micro_batches": result.micro_batches,
            "epochs": result.epochs, "resumed_at": _data_position(resume_from),
            "step_tokens": result.step_tokens, "init": init, "rank": acc.process_index,
            "step_accumulation_steps": result.step_accumulation_steps,
            "lrs": rec.lrs, "base_lrs": list(sched.scheduler.base_lrs)}


def _data_position(checkpoint) -> list | None:
    """``[epoch, micro-batches done in it]`` that a checkpoint resumes at (from its loop_state.json)."""
    if checkpoint is None:
        return None
    saved = json.loads((Path(checkpoint) / "loop_state.json").read_text())
    return [saved["epoch"], saved["batches_done_in_epoch"]]


def main(argv) -> int:
    spec, out = json.loads(Path(argv[1]).read_text()), Path(argv[2])
    torch.set_num_threads(1)
    for sc in spec["scenarios"]:
        d = out / sc["name"]
        d.mkdir(parents=True, exist_ok=True)
        runs = {"full": run(spec, sc, d / "ckpts")}
        for step in sc["resume_from"]:
            runs[f"resumed_{step}"] = run(spec, sc, d / "ckpts", resume_from=d / "ckpts" / f"step_{step}")
        for name, r in runs.items():
            if r["rank"] == 0:
                torch.save(r, d / f"{name}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
