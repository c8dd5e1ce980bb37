"""Worker of tests/test_moe.py (not a test module): the mixture-of-experts matrix of one launch, every cell in turn.

Run as an example script (tests/examples_worker.py's ``main(argv) -> dict`` format) by a command pool
(conftest.py's ``ddp_pool`` / ``fsdp_pool``) or inside the HSDP and DeepSpeed tests' own launches;
``argv = [SPEC.json, OUT_DIR]``. SPEC: ``{"cells": [...], "B", "windows", "tail", "lr", "weight_decay", "seed"}``,
each cell ``{"name", "K", "policy", "precision" ("no" | "bf16"), "top_k", and optionally "patterns" (a list of
tests/moe_model.py's PATTERNS; default all, one expert each), "user_loop" (bool), "ddp_kwargs" (DDP's names),
"zero_stage" (DeepSpeed: then "policy" is not passed), "model" (a key of tests/moe_model.py's ``MODELS``; default
"moe"), "expect_usage_error" (bool: the run must raise ``accum_kit.UsageError``, which is then recorded)}``.

Each cell builds the Accelerator with accum_kit (the launch's engine, the cell's policy and precision), a seeded
:class:`moe_model.TinyMoE`, SGD with weight decay and the pattern's examples, then trains one epoch: with
``accum_kit.train_loop`` or, with ``user_loop``, the loop of Accelerate's guide (``accelerator.accumulate``,
the micro-batch's mean loss, ``accelerator.backward``). Rank 0 writes ``OUT_DIR/<name>.pt``: the full
parameters before training and after each optimizer step, and (``expect_usage_error``) the error's flag, problem
and fix, or None when none was raised. The worker only trains; the test computes what is
expected. A cell that raises ends the whole run (its peers may be left inside a collective).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
import moe_model  # noqa: E402  (the worker runs from tests/)


def collate(examples):
    ids = torch.tensor([e["input_ids"] for e in examples])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([e["labels"] for e in examples])}


def full_parameters(model) -> dict:
    """Every parameter as a plain float32 tensor by its name in :class:`moe_model.TinyMoE` (shards gathered)."""
    from torch.distributed.tensor import DTensor

    module = getattr(model, "module", model)
    gather = torch.no_grad()
    if any(hasattr(p, "ds_id") for p in module.parameters()):  # DeepSpeed ZeRO-3 partitions
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(module.parameters()))
    with gather:
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
                for n, p in module.named_parameters()}


def build(spec: dict, cell: dict):
    import accum_kit
    from accum_kit.compat import reset_accelerate_state

    reset_accelerate_state()
    kwargs = {"mixed_precision": cell["precision"]}
    if cell.get("zero_stage"):
        from accelerate.utils import DeepSpeedPlugin

        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=cell["zero_stage"])
    else:
        kwargs["accumulation_policy"] = cell["policy"]
    if cell.get("ddp_kwargs"):
        kwargs["ddp_kwargs"] = cell["ddp_kwargs"]
    accelerator = accum_kit.build_accelerator(cell["K"], **kwargs)
    torch.manual_seed(spec["seed"])
    model = moe_model.MODELS[cell.get("model", "moe")](cell["top_k"])
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    W = accelerator.run_plan.engine.data_parallel_size(accelerator)
    examples = moe_model.pattern_examples(cell.get("patterns", list(moe_model.PATTERNS)), K=cell["K"], W=W, B=spec["B"], windows=spec["windows"],
                                          tail=spec["tail"], seed=spec["seed"])
    loader = DataLoader(examples, batch_size=spec["B"], shuffle=False, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader, init


def users_loop(accelerator, model, optimizer, loader, steps: list) -> None:
    """Accelerate's guide: the micro-batch's mean loss, ``accumulate``, ``backward``, step, zero_grad."""
    from accum_kit.core.loss import causal_lm_loss

    for batch in loader:
        with accelerator.accumulate(model):
            summed, n = causal_lm_loss(model, batch)
            accelerator.backward(summed / n)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            steps.append(full_parameters(model))


def run_cell(spec: dict, cell: dict, out_dir: Path) -> dict:
    import accum_kit
    from accum_kit.core.callbacks import LoopCallback

    t0 = time.perf_counter()
    accelerator, model, optimizer, loader, init = build(spec, cell)
    steps, error = [], None
    try:
        if cell.get("user_loop"):
            users_loop(accelerator, model, optimizer, loader, steps)
        else:
            class Saver(LoopCallback):
                def on_step_end(self, state):
                    steps.append(full_parameters(model))  # every rank joins the gathers

            accum_kit.train_loop(accelerator, model, optimizer, loader, callbacks=[Saver()], progress=False)
    except accum_kit.UsageError as err:  # raised on every rank alike (a parameter unused everywhere)
        if not cell.get("expect_usage_error"):
            raise
        error = {"flag": err.flag, "problem": err.problem, "fix": err.fix}
    if accelerator.is_main_process:
        torch.save({"init": init, "steps": steps, "error": error}, out_dir / f"{cell['name']}.pt")
    label = accelerator.run_plan.engine.label
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    return {"label": label, "steps": len(steps), "seconds": time.perf_counter() - t0}


def main(argv) -> dict:
    spec = json.loads(Path(argv[0]).read_text())
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    return {cell["name"]: run_cell(spec, cell, out_dir) for cell in spec["cells"]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
