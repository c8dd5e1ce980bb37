"""Worker of tests/test_model_parallel.py and test_moe.py (not a test module): accumulation scenarios of a Llama on
a tp or cp mesh, or of a Mixtral (``"model_class": "mixtral"``) with the router's aux loss on any engine.

    accelerate launch --config_file accelerate_configs/cpu_tp.yaml tests/mesh_worker.py SPEC.json OUT_DIR

(or a script run of a command pool launched that way). For each scenario of the spec it builds the
Accelerator with accum_kit, a seeded Llama (or Mixtral) from the spec's config fields, SGD and a dataloader of
the spec's examples (one per micro-batch and data-parallel rank, right-padded), trains with
``accum_kit.train_loop`` and writes:

- ``OUT_DIR/<name>/init.pt`` and ``steps.pt`` (rank 0): the full parameters before training and after each
  optimizer step (tp shards gathered);
- ``OUT_DIR/<name>/rank<r>.json``: logged losses, window token counts, gradient norms, mesh coordinates,
  what the collectives counter saw.

A scenario with ``"wrong": "world"`` counts tokens over every process (tp ranks included) and one with
``"wrong": "cp_slice"`` counts only this rank's slice over the data-parallel ranks: the miscounts of
several public trainers, run for real so the test can show they are not what the loop does. A scenario with
``resume_from`` saves a checkpoint after every step and is run again from each of those steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import accum_kit
from accum_kit.core.callbacks import LoopCallback
from accum_kit.core.checkpoint import Checkpointer
from accum_kit.core.token_ranks import TokenRanks
from job_helpers import pad_collate  # the worker runs as a script from tests/


def full_parameters(model) -> dict:
    """Every parameter as a plain tensor (DTensor shards gathered: a collective), by its unwrapped name."""
    return {k.removeprefix("module."): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.named_parameters()}  # DDP's "module." prefix dropped


class StepRecorder(LoopCallback):
    def __init__(self, model, keep: bool):
        self.model, self.keep, self.steps, self.norms = model, keep, [], []

    def on_step_end(self, state):
        params = full_parameters(self.model)  # every rank joins the gathers
        if self.keep:
            self.steps.append(params)
        self.norms.append(None if state.grad_norm is None else float(state.grad_norm))


def wrong_ranks(accelerator, how: str) -> TokenRanks:
    mesh = accelerator.torch_device_mesh
    if how == "world":  # every process, tp duplicates included
        return TokenRanks(accelerator)
    engine_ranks = accelerator.run_plan.engine.token_ranks(accelerator)
    # this rank's slice only, summed over the data-parallel ranks (the cp peers' slices left out)
    return TokenRanks(accelerator, group=mesh["dp_shard"].get_group(), size=mesh["dp_shard"].size(),
                      split=engine_ranks.split)


def run_scenario(spec: dict, sc: dict, out_dir: Path, resume_from: int | None = None) -> None:
    if AcceleratorState._shared_state:  # a fresh Accelerator per scenario; the process group stays
        AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accum_kit.build_accelerator(sc["K"], accumulation_policy=sc["policy"],
                                              mixed_precision=sc.get("mixed_precision", "no"))
    torch.manual_seed(spec["seed"])
    if spec.get("model_class") == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**spec["model_config"]))
    else:
        model = LlamaForCausalLM(LlamaConfig(**spec["model_config"]))
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    loader = DataLoader(spec["examples"], batch_size=1, shuffle=False, collate_fn=pad_collate(spec["pad_id"]))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engine = accelerator.run_plan.engine
    if sc.get("wrong"):
        wrong = wrong_ranks(accelerator, sc["wrong"])
        engine.token_ranks = lambda acc: wrong  # this run only: the engine is rebuilt per scenario
    rec = StepRecorder(model, keep=accelerator.is_main_process)
    loss_fn, callbacks = None, [rec]
    if sc.get("router_aux_loss_scope"):
        from accum_kit.core.router_loss import RouterAuxLoss, RouterWindowRecords

        loss_fn = RouterAuxLoss(accelerator, model, scope=sc["router_aux_loss_scope"])
        callbacks.append(RouterWindowRecords(loss_fn))
    name_dir = out_dir / sc["name"]
    checkpointer = None
    if sc.get("resume_from") and resume_from is None:
        checkpointer = Checkpointer(accelerator, name_dir / "ckpts", checkpointing_steps=1, signals=())
    result = accum_kit.train_loop(
        accelerator, model, optimizer, loader, num_train_epochs=sc.get("epochs", 1),
        max_grad_norm=sc.get("max_grad_norm"), callbacks=callbacks, loss_fn=loss_fn, progress=False,
        checkpointer=checkpointer,
        resume_from=name_dir / "ckpts" / f"step_{resume_from}" if resume_from is not None else None)
    d = name_dir / (f"resumed_{resume_from}" if resume_from is not None else "")
    d.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        torch.save(init, d / "init.pt")
        torch.save(rec.steps, d / "steps.pt")
    mesh = accelerator.torch_device_mesh
    info = {"rank": accelerator.process_index, "num_processes": accelerator.num_processes,
            "mesh": {n: mesh.get_local_rank(n) for n in mesh.mesh_dim_names} if mesh is not None else None,
            "router_windows": loss_fn.windows if loss_fn is not None else None,
            "loss": (loss_fn.lm_loss if loss_fn is not None else accum_kit.causal_lm_loss).used,
            "label": engine.label, "train_loss": result.train_loss, "step_tokens": result.step_tokens,
            "grad_norms": rec.norms, "len_dataloader": len(loader), "resumed_from_step": result.resumed_from_step,
            "dtensor_parameters": sum(isinstance(p, DTensor) for p in model.parameters()),
            "parameters": sum(1 for _ in model.parameters())}
    (d / f"rank{accelerator.process_index}.json").write_text(json.dumps(info, indent=1))
    accelerator.wait_for_everyone()
    accelerator.free_memory()


def main(argv) -> int:
    spec_path, out_dir = Path(argv[1]), Path(argv[2])
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    for sc in spec["scenarios"]:
        run_scenario(spec, sc, out_dir)
        for step in sc.get("resume_from", []):
            run_scenario(spec, sc, out_dir, resume_from=step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
