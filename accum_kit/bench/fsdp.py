"""``accum-kit bench`` under FSDP2: the four accumulation policies x K, side by side in one run.

Run it with::

    accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml -m accum_kit bench \\
        --model_presets small --accumulation_steps 2 4 8 --repeats 5

Under an FSDP2 launch the bench sweeps ``--accumulation_policies`` (default:
all four of :data:`accum_kit.policies.POLICIES`) instead of the DDP modes,
on one prepared model (one ``fully_shard`` per layer, per the config): before
every run it applies the policy (Accelerate's ``sync_each_batch`` flag
through :mod:`accum_kit.compat`, the Accelerator's policy, and every unit's
reshard-after-forward setting: off for ``no_sync_no_reshard``, FSDP2's own
otherwise) and resets the weights and the AdamW state, so every policy
computes the same losses. Each run trains ``--warmup_steps`` unmeasured and
``--steps`` measured optimizer steps with :func:`accum_kit.train_loop`, a
:class:`accum_kit.profiler.CommProfiler` (every all-gather and reduce-scatter)
and a :class:`accum_kit.memory.HeldMemory` (bytes held between micro-batches).

Schedule: one unrecorded run per policy, then for each repeat, for each K,
the policies in an order rotated by one from one (repeat, K) block to the
next. The figures (:mod:`.fsdp_report`) and files (:mod:`.fsdp_files`) are
documented there; data and timing conventions are the DDP bench's
(:mod:`accum_kit.bench`): synthetic tokens, step times from process 0, memory
the maximum over processes.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..compat import (fsdp_reshard_after_forward_state, keep_fsdp_parameters_after_forward,
                      restore_fsdp_reshard_after_forward, set_sync_each_batch)
from ..errors import UsageError
from ..launch import build_accelerator, launcher_world_size
from ..loop import train_loop
from ..memory import HeldMemory
from ..models import build_model, count_parameters
from ..outputs import library_versions
from ..policies import POLICIES
from ..profiler import CommProfiler
from ..sharding import element_bytes, sharded_model
from ..stats import median
from .config import MODES, BenchConfig
from .data import TokenRows, synthetic_tokens, variable_target_labels
from .fsdp_files import write_fsdp_outputs
from .fsdp_report import evaluate_targets, format_fsdp_table, format_targets, summarize_fsdp_preset
from .memory import PeakMemory
from .records import TagWindows
from .sweep import machine, reset_training_state

MB = 2**20


def apply_policy(accelerator, model, policy: str, fsdp_defaults: list) -> None:
    """Make the next window run ``policy`` on the prepared FSDP2 ``model`` (call between runs only).

    ``fsdp_defaults``: :func:`accum_kit.compat.fsdp_reshard_after_forward_state`
    taken after the model's first forward, when FSDP2 has settled its root.
    """
    p = POLICIES[policy]
    accelerator.accumulation_policy = p
    set_sync_each_batch(accelerator, p.sync_each_batch)
    restore_fsdp_reshard_after_forward(fsdp_defaults)
    if p.reshard_after_forward is False:
        keep_fsdp_parameters_after_forward(model)


def command(cfg: BenchConfig, world: int) -> str:
    """The command line that repeats this sweep (flags that differ from the defaults)."""
    default = BenchConfig()
    flags = []
    for name, value in asdict(cfg).items():
        if name == "modes" or value == getattr(default, name):
            continue
        flags.append(f"--{name} " + (" ".join(map(str, value)) if isinstance(value, list) else str(value).lower()
                                     if isinstance(value, bool) else str(value)))
    procs = "" if world == 2 else f" --num_processes {world}"
    return (f"accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml{procs} -m accum_kit bench"
            + "".join(f" {f}" for f in flags))


def bench_fsdp_preset(cfg: BenchConfig, preset: str, accelerator, bar) -> tuple[dict, list[dict]]:
    """All runs of one preset under FSDP2; returns (info, runs)."""
    world, device = accelerator.num_processes, accelerator.device
    model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
    n_params = count_parameters(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    acc_model, acc_opt = accelerator.prepare(model, opt)
    initial = [p.detach().clone() for p in acc_model.parameters()]  # DTensor shards
    prof = CommProfiler(accelerator, acc_model)

    run_steps = cfg.warmup_steps + cfg.steps
    B, K_max = cfg.per_device_train_batch_size, max(cfg.accumulation_steps)
    tokens = synthetic_tokens(run_steps * K_max * world * B, cfg.block_size, cfg.vocab_size, cfg.seed + 1)
    labels = variable_target_labels(tokens, cfg.seed + 2) if cfg.variable_targets else tokens
    loaders = {}
    for K in cfg.accumulation_steps:
        n = run_steps * K * world * B
        loaders[K] = accelerator.prepare(DataLoader(TokenRows(tokens[:n], labels[:n]), batch_size=B, shuffle=False))
    memory = PeakMemory(device)
    defaults: list = []

    def one_run(policy: str, K: int, tag: str) -> dict:
        apply_policy(accelerator, acc_model, policy, defaults)
        reset_training_state(acc_model, initial, acc_opt)
        prof.enabled = True  # the previous run's on_train_end switched it off
        prof.mode = "sync_each_batch" if policy == "sync_each_batch" else "no_sync"
        held = HeldMemory(accelerator, acc_model)
        accelerator.gradient_accumulation_steps = K
        gc.collect()
        dist.barrier()
        memory.reset()
        t0 = time.perf_counter()
        result = train_loop(accelerator, acc_model, acc_opt, loaders[K], max_train_steps=run_steps, progress=False,
                            profiler=prof, callbacks=[TagWindows(prof, cfg.warmup_steps, tag), held])
        wall = time.perf_counter() - t0
        peak, _ = memory.peak()
        local = held.local()
        mem = torch.tensor([-1.0 if peak is None else peak, local["gradient_bytes"] or 0,
                            local["gathered_parameter_bytes"] or 0], dtype=torch.float64, device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        s = prof.local_summary(tag)
        steps = prof.records(tag=tag).steps
        keys = ("reduce_scatter_calls_per_step", "reduce_scatter_bytes_per_step", "reduce_scatter_busbw_GBps",
                "all_gather_calls_per_step", "all_gather_bytes_per_step", "all_gather_busbw_GBps", "syncs",
                "skipped_syncs", "compute_seconds", "exposed_comm_seconds", "exposed_all_gather_seconds_per_step",
                "optimizer_seconds", "ideal_seconds_per_step", "estimated_seconds_saved_per_step")
        return {"preset": preset, "K": K, "policy": policy, "wall_seconds": wall, "losses": result.train_loss,
                "step_seconds": [x.step_seconds for x in steps], "optimizer_steps": len(steps),
                "peak_rss_mb": None if peak is None else mem[0].item(),
                "gradient_bytes": mem[1].item(), "gathered_parameter_bytes": mem[2].item(),
                **{k: s.get(k) for k in keys}}

    with torch.no_grad():  # FSDP2 settles its root's reshard setting at the first forward: save them after it
        acc_model(input_ids=tokens[:1].to(device))
    for m in acc_model.modules():  # without a backward the units kept after forward stay gathered: free them
        if isinstance(m, FSDPModule):
            m.reshard()
    defaults[:] = fsdp_reshard_after_forward_state(acc_model)
    layout = sharded_model(acc_model)  # read with FSDP2's own settings in force
    gc.collect()
    gc.freeze()  # as the DDP sweep: keep the collector from re-scanning what lives for the whole preset
    for policy in cfg.accumulation_policies:  # unrecorded: a fresh model's first steps pay page faults
        one_run(policy, cfg.accumulation_steps[0], f"preset_warmup/{policy}")
    b_p, b_c, b_r = element_bytes(accelerator, acc_model)
    runs, rotation, order = [], 0, list(cfg.accumulation_policies)
    for rep in range(cfg.repeats):
        for K in cfg.accumulation_steps:
            shift = rotation % len(order)
            rotation += 1
            for position, policy in enumerate(order[shift:] + order[:shift]):
                rec = one_run(policy, K, f"{policy}/K{K}/r{rep}")
                rec.update(repeat=rep, position=position)
                runs.append(rec)
                bar.set_postfix_str(f"{preset} K={K} {policy}: {median(rec['step_seconds']):.3f} s/step")
                bar.update(1)
    apply_policy(accelerator, acc_model, "no_sync", defaults)
    info = {"parameters": n_params, "micro_batch": f"{B}x{cfg.block_size} tokens", "memory_method": memory.method,
            "units": {"resharded": list(layout.resharded), "kept": list(layout.kept)},
            "element_bytes": {"b_p": b_p, "b_c": b_c, "b_r": b_r}}
    del acc_model, acc_opt, loaders, model, opt, prof
    accelerator.free_memory()
    gc.unfreeze()
    gc.collect()
    return info, runs


def run(cfg: BenchConfig) -> dict:
    """The FSDP2 sweep described by ``cfg``; the result is also written to ``cfg.output_dir`` by process 0.

    Raises:
        UsageError: fewer than 2 processes, or DDP ``--modes`` given (they mean nothing under FSDP2).
    """
    if launcher_world_size() < 2:
        raise UsageError("--num_processes", f"the FSDP2 bench needs >= 2 processes (launched: {launcher_world_size()})",
                         "run it under accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml -m accum_kit bench")
    if list(cfg.modes) != list(MODES):
        raise UsageError("--modes", "chooses DDP loops; under an FSDP2 config the bench compares accumulation "
                         "policies", "drop --modes and pass --accumulation_policies")
    accelerator = build_accelerator(None)
    world = accelerator.num_processes
    started, load_start, t0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), os.getloadavg(), time.perf_counter()
    total = len(cfg.model_presets) * cfg.repeats * len(cfg.accumulation_steps) * len(cfg.accumulation_policies)
    bar = tqdm(total=total, desc="bench runs (FSDP2)", disable=not accelerator.is_main_process, file=sys.stdout)
    presets, rows, all_runs, tables = {}, [], [], []
    for preset in cfg.model_presets:
        info, runs = bench_fsdp_preset(cfg, preset, accelerator, bar)
        info.update(summarize_fsdp_preset(preset, info, runs, cfg, world))
        presets[preset], all_runs = info, all_runs + runs
        rows += info.pop("rows")
        tables.append(format_fsdp_table(preset, info, [r for r in rows if r["preset"] == preset]))
        if accelerator.is_main_process:
            bar.write(tables[-1] + "\n")
    bar.close()
    targets = evaluate_targets(rows, presets)
    result = {
        "schema": "accum_kit.bench.fsdp/1",
        "command": command(cfg, world),
        "config": asdict(cfg),
        "machine": machine(accelerator),
        "versions": library_versions(),
        "data": "synthetic: uniformly random token ids, every position a target; seed --seed + 1",
        "timings_from": "process 0 (step times); memory: max over processes",
        "presets": presets,
        "rows": rows,
        "targets": targets,
        "runs": all_runs,
        "timing": {"started": started, "total_seconds": time.perf_counter() - t0,
                   "load_average_start": list(load_start), "load_average_end": list(os.getloadavg())},
    }
    if accelerator.is_main_process:
        paths = write_fsdp_outputs(cfg.output_dir, result)
        print("\n".join(tables))
        print(format_targets(targets))
        print(f"wrote {', '.join(str(p) for p in paths)} ({result['timing']['total_seconds']:.0f} s; "
              f"load average {load_start[0]:.2f} at start, {result['timing']['load_average_end'][0]:.2f} at end)")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result
