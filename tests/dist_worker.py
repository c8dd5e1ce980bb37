"""Worker script for tests/test_exactness.py (not a test module: pytest does not collect it).

Runs every scenario of a spec file in one launch, so the import cost is paid once::

    python tests/dist_worker.py SPEC.json OUT_DIR                      # one process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml \
        tests/dist_worker.py SPEC.json OUT_DIR                         # two processes

SPEC.json (written by the test)::

    {"model_config": {...GPT2Config kwargs...}, "seed": int, "lr": float, "pad_id": int,
     "examples": [{"input_ids": [...], "labels": [...]}, ...],
     "scenarios": [{"name": str, "K": int, "B": int, "mode": "tokens"|"mean",
                    "sync_each_batch": bool, "epochs": int, "max_train_steps": int|null,
                    "max_grad_norm": float|null, "mixed_precision": "no"|"bf16",
                    "schedule": [[step, K], ...]|null, "policy": str|null,
                    "resume_from": [step, ...], "torch_compile_backend": str|null,
                    "torch_compile_dynamic": bool|null, "bucket_cap_mb": float,
                    "gradient_checkpointing": bool, "gradient_checkpointing_kwargs": {...}|null,
                    "lora": {"r", "alpha", "target_modules"}|null, "momentum": float}, ...],
     "pad_to": int|null, "cli_runs": [{"name": str, "command": str, "argv": [...], "collect": str|null}, ...]}

(``epochs``, ``max_train_steps``, ``max_grad_norm`` and ``schedule`` are passed to train_loop as
``num_train_epochs``, ``max_train_steps``, ``max_grad_norm`` and ``accumulation_schedule``;
missing keys mean 1, None, None, None. With a schedule, ``K`` is the Accelerator's K at build time.
``mixed_precision`` goes to the Accelerator, missing means "no"; ``policy`` is
``build_accelerator(accumulation_policy=...)``; ``torch_compile_backend`` compiles the model through
``build_accelerator(torch_compile_backend=...)`` (``bucket_cap_mb``, default 0.01, must then be
at least 1: see :func:`accum_kit.engines.compiling.check_ddp_buckets`), with ``torch_compile_dynamic`` as
``torch.compile``'s ``dynamic`` (missing: True), and ``rank<r>.json`` then holds the
:class:`accum_kit.engines.compiling.CompileWatch` summary as ``compile``. ``pad_to`` pads every
micro-batch to at least that many tokens, so that all have one shape. ``gradient_checkpointing`` and its
kwargs go to ``build_accelerator``; ``lora`` makes the model a peft ``PeftModel`` with those adapters
(tests/job_helpers.py's ``lora_model``) before anything else sees it, ``momentum`` is SGD's (default 0), and
``rank<r>.json`` then names the parameters holding optimizer state (``optimizer_state_names``); per micro-batch ``block_forwards`` counts the forwards of the blocks' attention
(forward hooks, not with compilation): n_layer per micro-batch, twice that when backward recomputes them.)

Launched with accelerate_configs/cpu_fsdp.yaml the model is sharded with FSDP2:
the worker then counts, per micro-batch, the calls and bytes of ``torch.distributed``'s
reduce-scatter and all-gather (the collectives FSDP2 issues, wrapped here, not
in accum_kit), runs accum_kit's CommProfiler and HeldMemory beside that count
(their records go into ``rank<r>.json`` as ``profiler_calls``, ``profiler_post_backwards``, ``profiler_summary``,
``memory`` and ``predicted_memory``), saves full (gathered) parameters after each step, and for each
step ``s`` in ``resume_from`` (the run saves a checkpoint after every step)
trains again in a fresh Accelerator from ``step_<s>`` into ``resumed_<s>/``.
An optional ``"example_scripts"`` list runs example scripts afterwards, in the same
launch, as tests/examples_worker.py does (results in OUT_DIR).

For every scenario it writes under OUT_DIR/<name>/:

- ``init.pt`` (rank 0): the model's initial state_dict.
- ``steps.pt`` (rank 0): a list with the model's state_dict after each optimizer step.
- ``rank<r>.json`` (every rank): the LoopResult numbers, and per micro-batch the
  loop's ``epoch`` / ``boundary`` / ``sync`` values and the number of DDP comm-hook calls
  (gradient bucket all-reduces) that happened while that micro-batch ran, or under
  FSDP2 the reduce-scatter and all-gather calls; ``host_reads``: every tensor value read
  on the host during the loop, per micro-batch and by whom (tests/host_reads.py).

``cli_runs`` run accum-kit commands (``accum_kit.cli.run(command, argv)``, what
``accelerate launch -m accum_kit <command>`` runs) after the scenarios, in order, each
as if in a fresh process: Accelerate's shared state and dynamo's caches are reset
(``torch._dynamo.reset()``, documented as "as if you had started a fresh process") and,
where the previous command ended the process group (the train job does), a new one is
formed. Each run's exit code goes into ``cli_runs.rank<r>.json``; rank 0 copies its
``collect`` file (e.g. the train job's train_summary.json) to ``OUT_DIR/<name>.json``.
A failing command stops the list.

With ``bench_argv`` in the spec, ``accum-kit bench <bench_argv> --output_dir OUT_DIR/bench``
runs last in the same launch (under cpu_fsdp.yaml: the FSDP2 policy sweep).

The worker only runs accum_kit; all expected values are computed by the test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

import accum_kit
import accum_kit.engines.compiling
import accum_kit.profiler.held_memory
import accum_kit.profiler
from host_reads import HostReads
from job_helpers import fresh_process_group, pad_collate  # the worker runs as a script from tests/
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedDataParallelKwargs
from accum_kit.core.checkpoint import Checkpointer


def full_state_dict(model) -> dict:
    """The model's parameters and buffers as plain tensors; DTensor shards are gathered (collective)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


class Recorder:
    """LoopState callback + DDP comm hook: which micro-batch each gradient all-reduce happened in.

    Under FSDP2 it wraps ``torch.distributed.reduce_scatter_single`` and
    ``all_gather_single`` instead (:meth:`count_fsdp_collectives`).
    """

    def __init__(self, raw_model, save_steps: bool):
        self.raw_model, self.save_steps = raw_model, save_steps
        self.current = None  # index of the running micro-batch on this process
        self.micro = []  # one dict per micro-batch
        self.steps = []  # state_dicts after each optimizer step
        self.stray_calls = 0  # all-reduces outside any micro-batch (must stay 0)
        self.fsdp = False
        self.groups = {}  # collective kind -> ranks of the process group it last ran on (FSDP2)

    def count_fsdp_collectives(self):
        """Count FSDP2's collectives per micro-batch; returns a function that restores torch.distributed."""
        import torch.distributed as dist

        self.fsdp = True
        originals = {name: getattr(dist, name) for name in ("reduce_scatter_single", "all_gather_single")}

        def counting(name, key, size_arg):
            def call(*args, **kwargs):
                if self.current is not None:
                    self.micro[self.current][key] += 1
                    # nccl-tests' S: the gathered output / the reduce-scattered input, (position, keyword)
                    t = kwargs[size_arg[1]] if size_arg[1] in kwargs else args[size_arg[0]]
                    self.micro[self.current][key.replace("_calls", "_bytes")] += t.numel() * t.element_size()
                    group = kwargs.get("group")
                    if group is not None:
                        self.groups[key.replace("_calls", "")] = dist.get_process_group_ranks(group)
                elif key == "reduce_scatter_calls":
                    self.stray_calls += 1
                return originals[name](*args, **kwargs)
            return call

        dist.reduce_scatter_single = counting("reduce_scatter_single", "reduce_scatter_calls", (1, "input"))
        dist.all_gather_single = counting("all_gather_single", "all_gather_calls", (0, "output_tensor"))
        # HSDP: FSDP2 all-reduces each reduce-scattered shard across the replicate group with dist.all_reduce;
        # counted with the ranks of the group it ran on (the loop's own all-reduces run on the whole world)
        originals["all_reduce"] = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            if self.current is not None and group is not None and dist.get_world_size(group) < dist.get_world_size():
                m = self.micro[self.current]
                m["replicate_all_reduce_calls"] += 1
                m["replicate_all_reduce_bytes"] += tensor.numel() * tensor.element_size()
                self.groups["all_reduce"] = dist.get_process_group_ranks(group)
            return originals["all_reduce"](tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
        return lambda: [setattr(dist, name, fn) for name, fn in originals.items()]

    def count_block_forward(self, module, args, output):
        if self.current is not None:
            self.micro[self.current]["block_forwards"] += 1

    # --- comm hook -------------------------------------------------------
    def hook(self, process_group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if self.current is None:
            self.stray_calls += 1
        else:
            self.micro[self.current]["allreduce_calls"] += 1
        return default_hooks.allreduce_hook(process_group, bucket)

    # --- loop callbacks --------------------------------------------------
    def on_micro_batch_begin(self, state):
        if not self.micro:
            self.offset = state.micro_step  # > 0 when resumed from a checkpoint
        self.current = state.micro_step - self.offset
        assert len(self.micro) == self.current, (len(self.micro), state.micro_step, self.offset)
        self.micro.append(
            {"micro": state.micro_step, "epoch": state.epoch, "boundary": bool(state.boundary),
             "sync": bool(state.sync), "allreduce_calls": 0, "reduce_scatter_calls": 0, "all_gather_calls": 0,
             "reduce_scatter_bytes": 0, "all_gather_bytes": 0, "replicate_all_reduce_calls": 0,
             "replicate_all_reduce_bytes": 0, "block_forwards": 0}
        )

    def on_backward_end(self, state):
        # DDP launches (and waits for) its bucket all-reduces inside backward(); anything
        # after this point (e.g. the window-token all-reduce) would count as stray.
        self.current = None

    def on_step_end(self, state):
        if self.fsdp:
            full = full_state_dict(self.raw_model)  # collective: every rank
            if self.save_steps:
                self.steps.append(full)
        elif self.save_steps:
            self.steps.append({k: v.detach().clone() for k, v in self.raw_model.state_dict().items()})


def run_scenario(spec: dict, sc: dict, out_dir: Path, resume_from: int | None = None) -> None:
    import time

    started = time.perf_counter()
    precision = sc.get("mixed_precision", "no")
    state = AcceleratorState._shared_state
    if state and (state.get("_mixed_precision") != precision or os.environ.get("ACCELERATE_USE_FSDP") == "true"):
        # AcceleratorState is a per-process singleton that refuses a new mixed_precision and keeps its first
        # FSDP plugin; forget it (the process group, held by PartialState, stays), as Accelerate's own tests
        # do between configurations. Under FSDP the partial state (which keeps the process group) is
        # reset too: it holds the FSDP distributed type that accum_kit set for the previous scenario.
        AcceleratorState._reset_state(reset_partial_state=os.environ.get("ACCELERATE_USE_FSDP") == "true")
    accelerator = accum_kit.build_accelerator(
        sc["K"],
        sync_each_batch=sc["sync_each_batch"],
        accumulation_policy=sc.get("policy"),
        mixed_precision=precision,
        # Small buckets: several all-reduces per synchronised backward (the test must not assume one).
        kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=sc.get("bucket_cap_mb", 0.01))],
        torch_compile_backend=sc.get("torch_compile_backend"),
        # variable lengths: symbolic at once, unless the spec pads every micro-batch to one shape
        torch_compile_dynamic=sc.get("torch_compile_dynamic", True) if sc.get("torch_compile_backend") else None,
        gradient_checkpointing=sc.get("gradient_checkpointing", False),
        gradient_checkpointing_kwargs=sc.get("gradient_checkpointing_kwargs"),
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(spec["seed"])
    config = GPT2Config(**spec["model_config"])
    model = GPT2LMHeadModel(config)
    if sc.get("lora"):  # a peft PeftModel: every weight frozen but the adapters'
        from job_helpers import lora_model

        model = lora_model(model, sc["lora"])
    raw_model = model
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # every parameter handed over, frozen ones included: the optimizer must give them no state
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=sc.get("momentum", 0.0))
    loader = DataLoader(spec["examples"], batch_size=sc["B"], shuffle=False,
                        collate_fn=pad_collate(spec["pad_id"], spec.get("pad_to")))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    rec = Recorder(raw_model, save_steps=accelerator.is_main_process)
    if not sc.get("torch_compile_backend"):  # each block's attention runs once per forward, once more per recompute
        for block in raw_model.transformer.h:  # (not the MLP: a recompute stops after the last tensor it saves)
            block.attn.register_forward_hook(rec.count_block_forward)
    ddp = getattr(model, "_orig_mod", model)  # torch.compile(DDP(model)) wraps the DDP model
    hooked = isinstance(ddp, DistributedDataParallel)
    if hooked:
        ddp.register_comm_hook(None, rec.hook)  # state None: the default (WORLD) group
    restore = rec.count_fsdp_collectives() if accelerator.is_fsdp2 else (lambda: None)
    # Under FSDP2 accum_kit's own profiler and memory measurement run too, to be checked against the counts above.
    profiler = accum_kit.profiler.CommProfiler(accelerator, model) if accelerator.is_fsdp2 else None
    held = accum_kit.profiler.held_memory.HeldMemory(accelerator, model) if accelerator.is_fsdp2 else None
    d = out_dir / sc["name"] / (f"resumed_{resume_from}" if resume_from is not None else "")
    checkpointer = None
    if sc.get("resume_from") and resume_from is None:  # the uninterrupted run saves after every step
        checkpointer = Checkpointer(accelerator, out_dir / sc["name"] / "ckpts", checkpointing_steps=1, signals=())
    watch = None
    if sc.get("torch_compile_backend"):
        from accum_kit.engines.compiling import CompileWatch

        watch = CompileWatch(warmup_steps=1)
    reads = HostReads()
    with reads:
        result = accum_kit.train_loop(
            accelerator,
            model,
            optimizer,
            loader,
            num_train_epochs=sc.get("epochs", 1),
            max_train_steps=sc.get("max_train_steps"),
            max_grad_norm=sc.get("max_grad_norm"),
            loss_normalization=sc["mode"],
            callbacks=[rec, reads] + ([held] if held is not None else []) + ([watch] if watch is not None else []),
            profiler=profiler,
            progress=False,
            accumulation_schedule={s: k for s, k in sc["schedule"]} if sc.get("schedule") else None,
            checkpointer=checkpointer,
            resume_from=out_dir / sc["name"] / "ckpts" / f"step_{resume_from}" if resume_from is not None else None,
        )
    restore()

    d.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        torch.save(init, d / "init.pt")
        torch.save(rec.steps, d / "steps.pt")
    info = {
        "rank": rank,
        "num_processes": world,
        "distributed_type": str(accelerator.distributed_type),
        "comm_hook_registered": hooked,
        "is_fsdp2": bool(accelerator.is_fsdp2),
        "model_class": type(model).__name__,
        # modules compiled in place (torch's nn.Module.compile, what regional compilation calls per block)
        "modules_compiled_in_place": sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()),
        "accumulation_policy": accelerator.accumulation_policy.name,
        "n_layer": config.n_layer,
        "gradient_checkpointing": accelerator.run_plan.gradient_checkpointing,
        "gradient_checkpointing_kwargs": accelerator.run_plan.gradient_checkpointing_kwargs,
        "resumed_from_step": result.resumed_from_step,
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        "mixed_precision": accelerator.mixed_precision,
        "len_dataloader": len(loader),
        "train_loss": result.train_loss,
        "step_tokens": result.step_tokens,
        "step_accumulation_steps": result.step_accumulation_steps,
        "micro_batches": result.micro_batches,
        "optimizer_steps": result.optimizer_steps,
        "epochs": result.epochs,
        "micro": rec.micro,
        "stray_allreduce_calls": rec.stray_calls,
        "host_reads": reads.summary(),
        "collective_groups": rec.groups,
        "loss": accum_kit.causal_lm_loss.used,  # which causal-LM loss ran (the default: in the output layer)
    }
    if sc.get("lora"):
        from job_helpers import optimizer_state_names

        info["optimizer_state_names"] = optimizer_state_names(model, optimizer)
    if watch is not None:
        info["compile"] = watch.summary()
        info["compile_settings"] = accum_kit.engines.compiling.compile_settings(accelerator)
        watch.close()
    if profiler is not None:
        from accum_kit.profiler.held_memory import predicted_memory

        info["profiler_calls"] = [{"kind": c.kind, "micro_batch": c.micro_batch - rec.offset, "unit": c.unit,
                                   "bytes": c.bytes, "seconds": c.seconds, "group": c.group}
                                  for c in profiler.collective_calls]
        info["profiler_post_backwards"] = [{"micro_batch": r.micro_batch - rec.offset, "unit": r.unit,
                                            "reduced": r.reduced} for r in profiler.collectives.post_backwards]
        info["profiler_accumulations"] = profiler.accumulation.calls if profiler.accumulation is not None else None
        info["profiler_micro_batches"] = [{"accumulate_seconds": m.accumulate_seconds, "backward_seconds": m.backward_seconds}
                                          for m in profiler.micro_batches]
        info["parameters_with_grad"] = sum(p.requires_grad for p in model.parameters())
        info["profiler_summary"] = profiler.local_summary()
        info["profiler_summary_from_records"] = profiler.local_summary(from_records=True)
        info["memory"] = held.local()
        info["predicted_memory"] = predicted_memory(accelerator, model, sc["K"])
    info["scenario_seconds"] = time.perf_counter() - started  # build to end of training (what a scenario adds)
    (d / f"rank{rank}.json").write_text(json.dumps(info, indent=1))
    accelerator.wait_for_everyone()
    accelerator.free_memory()


def run_cli_commands(runs: list, out_dir: Path) -> int:
    """Run ``spec["cli_runs"]`` in order, each as if in a fresh process; the first non-zero exit code stops it."""
    import shutil

    from accum_kit.cli import run as cli_run
    from accum_kit.compat import reset_accelerate_state

    out_dir.mkdir(parents=True, exist_ok=True)
    codes = []
    code = 0
    for i, entry in enumerate(runs):
        fresh_process_group(f"dist_worker/cli_run{i}/")
        reset_accelerate_state()
        torch._dynamo.reset()
        code = cli_run(entry["command"], [str(a) for a in entry["argv"]])
        codes.append({"name": entry["name"], "exit_code": code})
        if code == 0 and entry.get("collect") and os.environ.get("RANK", "0") == "0":
            shutil.copyfile(entry["collect"], out_dir / f"{entry['name']}.json")
        if code != 0:
            break
    (out_dir / f"cli_runs.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(codes))
    return code


def main(argv) -> int:
    spec_path, out_dir = Path(argv[1]), Path(argv[2])
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    for sc in spec["scenarios"]:
        run_scenario(spec, sc, out_dir)
        for step in sc.get("resume_from", []):
            run_scenario(spec, sc, out_dir, resume_from=step)
    code = 0
    if spec.get("cli_runs"):
        code = run_cli_commands(spec["cli_runs"], out_dir)
    if spec.get("example_scripts") and code == 0:  # example scripts in the same launch (tests/examples_worker.py's format)
        import examples_worker

        scripts = out_dir / f"example_scripts.rank{os.environ.get('RANK', '0')}.json"
        scripts.write_text(json.dumps({"examples": spec["example_scripts"]}))
        code = examples_worker.main(str(scripts), str(out_dir))
    if spec.get("bench_argv") and code == 0:  # `accum-kit bench` last: it ends the process group
        from accum_kit.cli import run as cli_run

        AcceleratorState._reset_state(reset_partial_state=True)
        code = cli_run("bench", [*spec["bench_argv"], "--output_dir", str(out_dir / "bench")])
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
