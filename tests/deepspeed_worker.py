"""Worker script for tests/test_deepspeed.py (not a test module: pytest does not collect it).

One launch runs every scenario (each with its own ZeRO stage), so the import cost is paid once::

    accelerate launch --config_file accelerate_configs/cpu_deepspeed.yaml \
        tests/deepspeed_worker.py SPEC.json OUT_DIR

SPEC.json: as tests/dist_worker.py's, each scenario with ``"zero_stage": 1|2|3`` (and ``K``, ``B``,
``mode``, ``max_grad_norm``, ``resume_from``, ``lora``, ``momentum``). The worker wraps ``torch.distributed``'s collectives
(before DeepSpeed binds any of them) and counts, per micro-batch, the calls and bytes of each kind
that run while the micro-batch's forward and backward run (on the boundary that includes the
engine's step). It also runs accum_kit's CommProfiler and HeldMemory, whose records go into
``rank<r>.json`` beside the count, and counts the host reads per micro-batch (``host_reads``,
tests/host_reads.py). Files per scenario, as dist_worker's: ``init.pt``,
``steps.pt`` (full parameters after each step, gathered under ZeRO-3), ``rank<r>.json``.
SPEC's ``verify`` entries (``name``, ``zero_stage``, ``mixed_precision``, ``K``, ``B``, ``seed``) each run
``accum_kit.verify_accumulation`` in the same processes; the report goes to ``verify/<name>.json``.

SPEC's optional ``example_scripts`` (tests/examples_worker.py's format) run users' scripts unchanged after
the scenarios, each with its ``env`` (``ACCELERATE_DEEPSPEED_ZERO_STAGE``: what ``--zero_stage`` sets).

The worker only runs accum_kit; all expected values are computed by the test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

import accum_kit
import accum_kit.profiler.held_memory
import accum_kit.profiler
from host_reads import HostReads
from job_helpers import pad_collate  # the worker runs as a script from tests/
from accum_kit.core.checkpoint import Checkpointer

# torch.distributed function -> (kind, how to find the tensor whose size is counted: position, keyword)
WRAPPED = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "reduce_scatter": ("reduce_scatter", 1, "input_list"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),
    "broadcast": ("broadcast", 0, "tensor"),
    "reduce": ("reduce", 0, "tensor"),
    "all_to_all_single": ("all_to_all", 0, "output"),
}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if hasattr(t, "numel") else 0


class Counter:
    """Counts torch.distributed calls per micro-batch (loop callback; wraps at construction)."""

    def __init__(self):
        self.current, self.micro, self.outside = None, [], {}
        for name, (kind, pos, key) in WRAPPED.items():
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name), kind, pos, key))

    def _wrap(self, fn, kind, pos, key):
        def call(*args, **kwargs):
            t = kwargs[key] if key in kwargs else (args[pos] if len(args) > pos else None)
            if self.current is not None:
                m = self.micro[self.current]
                m[f"{kind}_calls"] = m.get(f"{kind}_calls", 0) + 1
                m[f"{kind}_bytes"] = m.get(f"{kind}_bytes", 0) + _nbytes(t)
            else:
                self.outside[kind] = self.outside.get(kind, 0) + 1
            return fn(*args, **kwargs)
        return call

    def start(self):
        self.current, self.micro, self.outside, self.offset = None, [], {}, None

    def on_micro_batch_begin(self, state):
        if self.offset is None:
            self.offset = state.micro_step
        self.current = state.micro_step - self.offset
        self.micro.append({"boundary": bool(state.boundary), "sync": bool(state.sync), "epoch": state.epoch})

    def on_backward_end(self, state):
        self.current = None

    def count_block_forward(self, module, args, output):
        """Forward hook on each block's attention: once per forward, once more when backward recomputes it."""
        if self.current is not None:
            m = self.micro[self.current]
            m["block_forwards"] = m.get("block_forwards", 0) + 1


def full_parameters(model) -> dict:
    """The model's state_dict as plain tensors; ZeRO-3's partitioned parameters gathered first (collective)."""
    import deepspeed

    module = getattr(model, "module", model)
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


class StepSaver:
    def __init__(self, model, keep: bool):
        self.model, self.keep, self.steps = model, keep, []

    def on_step_end(self, state):
        full = full_parameters(self.model)
        if self.keep:
            self.steps.append(full)


def _master_partition_bytes(zero_optimizer) -> int:
    """Bytes of the float32 partitions this process's optimizer updates that are storage of their own (not the
    parameters' partition itself): ZeRO-1/2's ``single_partition_of_fp32_groups``, ZeRO-3's
    ``fp32_partitioned_groups_flat`` where it is not ``fp16_partitioned_groups_flat``."""
    if hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):
        pairs = zip(zero_optimizer.fp32_partitioned_groups_flat, zero_optimizer.fp16_partitioned_groups_flat)
        return sum(f.numel() * f.element_size() for f, h in pairs if f.data_ptr() != h.data_ptr())
    return sum(f.numel() * f.element_size() for f in zero_optimizer.single_partition_of_fp32_groups)


def run_scenario(spec, sc, out_dir: Path, counter: Counter, resume_from=None) -> None:
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    started = time.perf_counter()
    # a new DeepSpeed plugin needs a fresh state (Accelerate refuses a second one); the process group stays
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accum_kit.build_accelerator(sc["K"], deepspeed_plugin=DeepSpeedPlugin(zero_stage=sc["zero_stage"]),
                                              max_grad_norm=sc.get("max_grad_norm"),
                                              gradient_checkpointing=sc.get("gradient_checkpointing", False))
    rank = accelerator.process_index
    torch.manual_seed(spec["seed"])
    model = GPT2LMHeadModel(GPT2Config(**spec["model_config"]))
    if sc.get("lora"):  # a peft PeftModel: every weight frozen but the adapters'
        from job_helpers import lora_model

        model = lora_model(model, sc["lora"])
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for block in model.transformer.h:
        block.attn.register_forward_hook(counter.count_block_forward)
    # every parameter handed over, frozen ones included: DeepSpeed must partition and step the trainable ones only
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=sc.get("momentum", 0.0))
    loader = DataLoader(spec["examples"], batch_size=sc["B"], shuffle=False, collate_fn=pad_collate(spec["pad_id"]))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    counter.start()
    saver = StepSaver(model, keep=accelerator.is_main_process)
    profiler = accum_kit.profiler.CommProfiler(accelerator, model) if spec.get("profile") else None
    held = accum_kit.profiler.held_memory.HeldMemory(accelerator, model) if spec.get("profile") else None
    d = out_dir / sc["name"] / (f"resumed_{resume_from}" if resume_from is not None else "")
    ckpts = out_dir / sc["name"] / "ckpts"
    checkpointer = None
    if sc.get("resume_from") and resume_from is None:  # the uninterrupted run saves after every step
        checkpointer = Checkpointer(accelerator, ckpts, checkpointing_steps=1, signals=())
    reads = HostReads()
    with reads:
        result = accum_kit.train_loop(
            accelerator, model, optimizer, loader, num_train_epochs=sc.get("epochs", 1),
            max_grad_norm=sc.get("max_grad_norm"), loss_normalization=sc["mode"], progress=False,
            callbacks=[c for c in (counter, reads, held, saver) if c is not None], profiler=profiler,
            checkpointer=checkpointer, resume_from=ckpts / f"step_{resume_from}" if resume_from is not None else None)
    d.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        torch.save(init, d / "init.pt")
        torch.save(saver.steps, d / "steps.pt")
    from accum_kit.profiler.held_memory import predicted_memory

    info = {
        "rank": rank, "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type), "model_class": type(model).__name__,
        "zero_stage": accelerator.deepspeed_plugin.zero_stage, "n_layer": model.module.config.n_layer,
        "gradient_checkpointing": accelerator.run_plan.gradient_checkpointing,
        "gradient_checkpointing_kwargs": accelerator.run_plan.gradient_checkpointing_kwargs,
        "engine_gradient_accumulation_steps": model.gradient_accumulation_steps(),
        "engine_gradient_clipping": model.gradient_clipping(),
        "train_loss": result.train_loss, "step_tokens": result.step_tokens,
        "optimizer_steps": result.optimizer_steps, "micro_batches": result.micro_batches,
        "resumed_from_step": result.resumed_from_step, "loss": accum_kit.causal_lm_loss.used,
        "micro": counter.micro, "outside_micro_batches": counter.outside, "host_reads": reads.summary(),
        "parameters": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.module.parameters()),
        # the elements of this rank's optimizer partitions (ZeRO's flat fp32 groups, which the optimizer steps)
        "optimizer_elements": sum(p.numel() for g in model.optimizer.optimizer.param_groups for p in g["params"]),
        "momentum_elements": sum(s["momentum_buffer"].numel() for s in model.optimizer.optimizer.state.values()
                                 if s.get("momentum_buffer") is not None),
    }
    if profiler is not None:
        info.update(profiler_calls=[{"kind": c.kind, "micro_batch": c.micro_batch - counter.offset, "bytes": c.bytes,
                                     "seconds": c.seconds} for c in profiler.collective_calls],
                    profiler_summary=profiler.local_summary(), memory=held.local(),
                    predicted_memory=predicted_memory(accelerator, model, sc["K"]),
                    master_partition_bytes=_master_partition_bytes(model.optimizer))
    info["scenario_seconds"] = time.perf_counter() - started  # build to end of training (what a scenario adds)
    (d / f"rank{rank}.json").write_text(json.dumps(info, indent=1, default=str))
    accelerator.wait_for_everyone()
    accelerator.free_memory()


def run_verify(spec, out_dir: Path) -> None:
    """``accum_kit.verify_accumulation`` in this launch, once per ``spec["verify"]`` entry (its own stage and
    precision); the main process writes the report to ``verify/<name>.json``."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    from accum_kit.verify import verify_accumulation

    for v in spec.get("verify", []):
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = accum_kit.build_accelerator(v["K"], deepspeed_plugin=DeepSpeedPlugin(zero_stage=v["zero_stage"]),
                                                  mixed_precision=v["mixed_precision"])
        report = verify_accumulation(accelerator, per_device_train_batch_size=v["B"], seed=v["seed"])
        if accelerator.is_main_process:
            (out_dir / "verify").mkdir(parents=True, exist_ok=True)
            (out_dir / "verify" / f"{v['name']}.json").write_text(json.dumps(report.to_dict(), default=str))
            print(report.format(), flush=True)
        accelerator.wait_for_everyone()
        accelerator.free_memory()


def _train_job(argv: list, env: dict | None = None) -> tuple[int, str]:
    """``accum-kit train`` in this launch's processes (``cli.run``): ``(exit code, stderr)``; ``env``: launcher
    variables to change for this run only (None removes one). Accelerate's state is reset before and after."""
    import contextlib
    import io
    import os

    from unittest import mock

    from accelerate.state import AcceleratorState, PartialState

    from accum_kit.cli import run

    # The job ends with end_training, which destroys the default process group; a new one on the launcher's
    # store would meet the first one's keys (rank 1 would join a group rank 0 is still creating): keep it.
    keep_group = mock.patch.object(PartialState, "destroy_process_group", lambda self, group=None: None)
    keep_group_too = mock.patch.object(AcceleratorState, "destroy_process_group", lambda self, group=None: None)
    saved = {k: os.environ.get(k) for k in (env or {})}
    for k, v in (env or {}).items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    AcceleratorState._reset_state(reset_partial_state=True)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), keep_group, keep_group_too:
            code = run("train", [str(a) for a in argv])
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        AcceleratorState._reset_state(reset_partial_state=True)
    return code, err.getvalue()


def _tree(root: Path) -> list:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def run_train_jobs(spec, out_dir: Path) -> None:
    """``spec["train_job"]``: the train job uninterrupted under this launch's DeepSpeed config (the reference
    of the SIGTERM test) and under each stage of ``reference_stages`` (``train_ref_zero<s>``: the references of
    the fault launches), a one-step DDP job (a checkpoint of another engine), then each bad resume of
    ``bad_resumes`` (``{name: {"argv": extra flags, "env": launcher variables}}``, ``{ref}`` / ``{ddp}`` in a
    flag: those runs' output folders, ``{bad}``: copies made here, see below); ``train_jobs.json`` gets each
    bad run's exit code, error lines and whether its checkpoint folder and output folder were left unchanged."""
    import os
    import shutil

    job = spec.get("train_job")
    if job is None:
        return
    rank = int(os.environ["RANK"])  # the process group may not exist yet (train.run builds it)
    ref, ddp, bad = out_dir / "train_ref", out_dir / "train_ddp", out_dir / "train_bad"
    results = {}
    ddp_env = {"ACCELERATE_USE_DEEPSPEED": None, "ACCELERATE_DEEPSPEED_ZERO_STAGE": None}
    runs = [("reference", ["--output_dir", ref], None),
            ("ddp", ["--output_dir", ddp, "--max_train_steps", 1, "--checkpointing_steps", 1], ddp_env)]
    runs += [(f"reference_zero{s}", ["--output_dir", out_dir / f"train_ref_zero{s}"],  # the fault launches' references
              {"ACCELERATE_DEEPSPEED_ZERO_STAGE": str(s)}) for s in job.get("reference_stages", [])]
    for name, argv, env in runs:
        results[name], err = _train_job([*job["argv"], *argv], env)
        (out_dir / f"train_{name}_rank{rank}.stderr").write_text(err)
    if rank == 0:  # a checkpoint saved by 4 processes (its loop state says so), one with a truncated ZeRO file,
        # one saved under ZeRO-1 (ZeRO-1 and 2 write the same files: only the loop state tells), and one in the
        # layout of earlier versions (the scheduler registered as a custom object: custom_checkpoint_0.pkl, which
        # holds what scheduler.bin holds, torch.save of its state_dict)
        step = ref / job["bad_from"]
        for name in ("world4", "corrupt", "zero1", "old_layout"):
            shutil.copytree(step, bad / name / job["bad_from"])
        state = json.loads((bad / "world4" / job["bad_from"] / "loop_state.json").read_text())
        (bad / "world4" / job["bad_from"] / "loop_state.json").write_text(json.dumps({**state, "world_size": 4}))
        (bad / "zero1" / job["bad_from"] / "loop_state.json").write_text(json.dumps({**state, "engine": "deepspeed_zero1"}))
        old = bad / "old_layout" / job["bad_from"]
        (old / "scheduler.bin").rename(old / "custom_checkpoint_0.pkl")
        victim = next((bad / "corrupt" / job["bad_from"]).glob("*/zero_pp_rank_1_*optim_states.pt"))
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    dist.barrier()
    for name, case in job["bad_resumes"].items():
        argv = [str(a).format(ref=ref, ddp=ddp, bad=bad) for a in case["argv"]]
        out = bad / f"out_{name}"
        before = {d: _tree(d) for d in (ref, ddp, bad)}
        code, err = _train_job([*job["argv"], "--output_dir", out, *argv], case.get("env"))
        dist.barrier()
        results[name] = {"code": code, "errors": [line for line in err.splitlines() if line.startswith("error: ")],
                         "unchanged": all(_tree(d) == t for d, t in before.items()), "output_dir_exists": out.exists(),
                         "traceback": "Traceback" in err}
    if rank == 0:
        (out_dir / "train_jobs.json").write_text(json.dumps(results, indent=1))


# --------------------------------------------------------------------------- the bench, in this launch


class _NoBar:
    """What the bench's sweep calls on its progress bar."""

    def set_postfix_str(self, *_):
        pass

    def update(self, *_):
        pass


def run_bench(spec, out_dir: Path) -> None:
    """``accum-kit bench``'s DeepSpeed sweep in-process (tiny preset; ``spec["bench"]``: K, repeats, steps):
    ``bench/rank<r>.json`` holds the preset's info, its rows and every run record of this process."""
    from accelerate.state import AcceleratorState

    from accum_kit.bench.bench_config import BenchConfig
    from accum_kit.bench.part_zero import ZeroBench
    from accum_kit.bench.sweep import sweep_preset

    AcceleratorState._reset_state(reset_partial_state=True)
    t0 = time.perf_counter()
    b = spec["bench"]
    cfg = BenchConfig(model_presets=["tiny"], accumulation_steps=b["K"], repeats=b["repeats"], steps=b["steps"],
                      warmup_steps=0, output_dir=str(out_dir / "bench"))
    accelerator = accum_kit.build_accelerator(max(cfg.accumulation_steps))
    part = ZeroBench()
    info, runs = sweep_preset(part, cfg, "tiny", accelerator, _NoBar())
    info.update(part.summarize("tiny", info, runs, cfg, accelerator.num_processes))
    d = out_dir / "bench"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{accelerator.process_index}.json").write_text(json.dumps(
        {"info": info, "runs": runs, "seconds": time.perf_counter() - t0}, default=str))
    accelerator.wait_for_everyone()


def main(argv) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    out_dir = Path(argv[2])
    torch.set_num_threads(1)
    counter = Counter()  # before DeepSpeed's communication backend binds torch.distributed's functions
    for sc in spec["scenarios"]:
        run_scenario(spec, sc, out_dir, counter)
        for step in sc.get("resume_from", []):
            run_scenario(spec, sc, out_dir, counter, resume_from=step)
    if spec.get("example_scripts"):  # users' scripts, unchanged (tests/examples_worker.py's format, per-script env)
        import examples_worker

        scripts = out_dir / f"example_scripts.rank{os.environ.get('RANK', '0')}.json"
        scripts.write_text(json.dumps({"examples": spec["example_scripts"]}))
        if examples_worker.main(str(scripts), str(out_dir)) != 0:
            raise RuntimeError(f"an example script failed: see {out_dir}/*.error")
    run_verify(spec, out_dir)
    run_train_jobs(spec, out_dir)
    if spec.get("bench"):
        run_bench(spec, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
