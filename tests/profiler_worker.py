"""Worker script for tests/test_profiler.py (not a test module: pytest does not collect it).

Runs every profiler scenario of a spec file in one launch, so the import and
process-group cost is paid once::

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml \
        tests/profiler_worker.py SPEC.json OUT_DIR

SPEC.json (written by the test)::

    {"model_config": {...GPT2Config kwargs...}, "seed": int, "lr": float, "pad_id": int,
     "bucket_cap_mb": float,
     "examples": [{"input_ids": [...], "labels": [...]}, ...],
     "scenarios": [{"name": str, "kind": "train" | "double_hook", "K": int, "B": int,
                    "sync_each_batch": bool, "hook": null | "fp16", "ab_steps": int,
                    "warmup_sync": bool}, ...],
     "train_job": null | {"argv": [...]}}   # accum_kit.cli.main(argv), run last

Per ``train`` scenario it writes OUT_DIR/<name>/:

- ``final.pt`` (rank 0): the model's state_dict after training.
- ``rank<r>.json`` (every rank): the profiler's raw records (``calls``,
  ``micro_batches``, ``step_records``), its ``summary()`` (from its running
  aggregates) and ``summary_from_records`` (the same from every record), the A/B switch's
  times and summary, DDP's own ``_get_ddp_logging_data()`` after training, the
  loop's per-micro-batch ``boundary`` / ``sync`` flags, and the gradient size
  in bytes computed here from the model's parameters (not from the profiler).

``warmup_sync``: one synchronised forward/backward on the DDP model before the
profiler is created (gradients zeroed afterwards, no optimizer step, so the
parameters do not change). DDP rebuilds its gradient buckets after the first
synchronised backward; the warm-up makes every profiled sync use the same bucket
layout.

``double_hook`` scenarios register a comm hook first, then attach a
CommProfiler, and record the error it raises.

The worker only runs accum_kit; all expected values are computed by the test.
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate.utils import DistributedDataParallelKwargs
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

import accum_kit
from job_helpers import pad_collate  # the worker runs as a script from tests/
from accum_kit.compat import sync_each_batch
from accum_kit.profiler import ABSwitch, CommProfiler


class FlagRecorder(accum_kit.LoopCallback):
    """Loop callback: the loop's own boundary / sync flags per micro-batch."""

    def __init__(self):
        self.micro = []

    def on_micro_batch_begin(self, state):
        self.micro.append({"micro": state.micro_step, "step": state.step,
                           "boundary": bool(state.boundary), "sync": bool(state.sync)})


def _setup(spec: dict, sc: dict):
    accelerator = accum_kit.build_accelerator(
        sc["K"],
        sync_each_batch=sc.get("sync_each_batch", False),
        kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=spec["bucket_cap_mb"])],
    )
    torch.manual_seed(spec["seed"])
    raw_model = GPT2LMHeadModel(GPT2Config(**spec["model_config"]))
    # The oracle for bytes per sync: every trainable parameter's gradient, numel x element size
    # (parameters() yields a tied weight once, as DDP sees it).
    grad_bytes = sum(p.numel() * p.element_size() for p in raw_model.parameters() if p.requires_grad)
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=spec["lr"])
    collate = pad_collate(spec["pad_id"])
    loader = DataLoader(spec["examples"], batch_size=sc["B"], shuffle=False, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(raw_model, optimizer, loader)
    return accelerator, raw_model, model, optimizer, loader, collate, grad_bytes


def run_double_hook(spec: dict, sc: dict, out_dir: Path) -> None:
    accelerator, _raw, model, *_ = _setup(spec, sc)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    info = {"rank": accelerator.process_index, "is_ddp": isinstance(model, DistributedDataParallel)}
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        CommProfiler(accelerator, model).attach()
    except Exception as exc:  # noqa: BLE001 - the test checks the type and message
        info["error_type"] = type(exc).__name__
        info["error"] = str(exc)
    else:
        info["error_type"] = None
    d = out_dir / sc["name"]
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{accelerator.process_index}.json").write_text(json.dumps(info, indent=1))
    accelerator.wait_for_everyone()
    accelerator.free_memory()


def run_train(spec: dict, sc: dict, out_dir: Path) -> None:
    accelerator, raw_model, model, optimizer, loader, collate, grad_bytes = _setup(spec, sc)
    rank = accelerator.process_index
    if sc.get("warmup_sync"):
        # One synchronised backward outside accumulate(): DDP rebuilds its buckets after it.
        batch = collate(spec["examples"][: sc["B"]])
        model(**{k: v.to(accelerator.device) for k, v in batch.items()}).loss.backward()
        model.zero_grad(set_to_none=True)

    hook = None
    if sc.get("hook") == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook as hook
    prof = CommProfiler(accelerator, model, hook=hook, hook_state=None)
    ab = ABSwitch(accelerator, sc["ab_steps"], prof) if sc.get("ab_steps") else None
    flags = FlagRecorder()
    result = accum_kit.train_loop(
        accelerator, model, optimizer, loader, num_train_epochs=1, loss_normalization="tokens",
        callbacks=[flags, ab], profiler=prof, progress=False,
    )
    summary = prof.summary()  # collective
    ddp_log = model._get_ddp_logging_data() if isinstance(model, DistributedDataParallel) else None

    d = out_dir / sc["name"]
    d.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in raw_model.state_dict().items()}, d / "final.pt")
    info = {
        "rank": rank,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "is_ddp": isinstance(model, DistributedDataParallel),
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        "len_dataloader": len(loader),
        "micro_batches": result.micro_batches,
        "optimizer_steps": result.optimizer_steps,
        "train_loss": result.train_loss,
        "grad_bytes": grad_bytes,
        "loop_flags": flags.micro,
        "calls": [asdict(c) for c in prof.calls],
        "prof_micro_batches": [asdict(m) for m in prof.micro_batches],
        "step_records": [asdict(s) for s in prof.step_records],
        "summary": summary,
        "summary_from_records": prof.local_summary(from_records=True),  # every record kept: a short run
        "ab_times": ab.times if ab is not None else None,
        "ab_summary": ab.summary() if ab is not None else None,
        "sync_each_batch_after": sync_each_batch(accelerator),
        "ddp_logging": ddp_log,
    }
    (d / f"rank{rank}.json").write_text(json.dumps(info, indent=1, default=str))
    accelerator.wait_for_everyone()
    accelerator.free_memory()


def main(argv) -> int:
    spec_path, out_dir = Path(argv[1]), Path(argv[2])
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    for sc in spec["scenarios"]:
        {"train": run_train, "double_hook": run_double_hook}[sc["kind"]](spec, sc, out_dir)
    job = spec.get("train_job")
    if job:
        # Last: the job ends with accelerator.end_training(), which destroys the process group.
        import os

        from accum_kit.cli import main as cli_main

        rank = os.environ.get("RANK", "0")
        try:
            rc = cli_main(job["argv"])
        except BaseException:  # noqa: BLE001 - reported to the test, then re-raised
            (out_dir / f"train_job_rank{rank}.rc").write_text("exception\n" + traceback.format_exc())
            raise
        (out_dir / f"train_job_rank{rank}.rc").write_text(str(rc))
        return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
