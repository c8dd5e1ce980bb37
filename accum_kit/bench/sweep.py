"""The sweep of ``accum-kit bench``: every preset x repeat x K x mode, run and recorded.

Each run resets the weights and AdamW state, trains ``--warmup_steps`` +
``--steps`` optimizer steps with a :class:`accum_kit.profiler.CommProfiler`
attached, and becomes one plain dict (:func:`accum_kit.bench.records.run_record`
plus memory, losses and wall time). The report (:mod:`accum_kit.bench.report`)
turns those dicts into figures; nothing here computes them.
"""

from __future__ import annotations

import copy
import gc
import os
import platform
import sys
import time
from dataclasses import asdict, fields

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..compat import set_sync_each_batch
from ..errors import UsageError
from ..launch import build_accelerator, launcher_world_size
from ..reference.manual_allreduce import MANUAL_MODES
from ..job.models import PRESETS, build_model, count_parameters
from ..outputs import library_versions
from ..profiler import CommProfiler
from ..reference.raw_ddp import train_raw_ddp
from ..stats import median
from .config import MODES, BenchConfig
from .data import TokenRows, data_description, raw_batch_indices, synthetic_tokens, variable_target_labels
from .files import write_outputs, write_tune_outputs
from .memory import PeakMemory
from .peers import constant_schedule, run_trainer, train_accelerate_guide
from .records import TagWindows, run_record
from .report import INTERVAL_METHOD, evaluate_bars, summarize_preset
from .runs import comm_hook, load_average, reset_training_state, reset_weights, run_toolkit
from .tables import format_bars, format_peer_table, format_preset_table, format_profile
from .tune import tune_settings, tune_preset
from .tune_report import format_tune_table, recommend, summarize_tune


def machine(accelerator) -> dict:
    """Where the sweep ran: platform, CPU model and count, threads, world size, device, backend."""
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu_model": cpu, "cpu_count": os.cpu_count(),
            "torch_threads_per_process": torch.get_num_threads(), "world_size": accelerator.num_processes,
            "device": str(accelerator.device), "backend": dist.get_backend() if dist.is_initialized() else None,
            "distributed_type": str(accelerator.distributed_type),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def command(cfg: BenchConfig, world: int) -> str:
    """The command line that repeats this sweep: the flags whose value differs from the default."""
    procs = "" if world == 2 else f" --num_processes {world}"  # accelerate_configs/cpu_ddp.yaml starts 2
    default = BenchConfig()
    flags = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if value == getattr(default, f.name):
            continue
        if isinstance(value, bool):
            flags.append(f"--{f.name} {str(value).lower()}")
        elif isinstance(value, list):
            flags.append(f"--{f.name} " + " ".join(map(str, value)))
        else:
            flags.append(f"--{f.name} {value}")
    return (f"accelerate launch --config_file accelerate_configs/cpu_ddp.yaml{procs} -m accum_kit bench"
            + "".join(f" {x}" for x in flags))


def bench_preset(cfg: BenchConfig, preset: str, accelerator, bar) -> tuple[dict, list[dict]]:
    """All runs of one preset: build, prepare, then repeats x K x modes (rotated); returns (info, runs)."""
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
    want_raw, want_trainer = "raw_ddp" in cfg.modes, "trainer" in cfg.modes
    want_manual = bool(set(cfg.modes) & set(MANUAL_MODES))
    raw_model = copy.deepcopy(model).to(device) if want_raw else None  # a fresh copy of the same weights
    peer_model = copy.deepcopy(model).to(device) if want_trainer else None  # Trainer wraps its own DDP
    manual_model = copy.deepcopy(model).to(device) if want_manual else None  # no DDP: gradients averaged by hand
    initial = [p.detach().clone() for p in model.parameters()]
    n_params = count_parameters(model)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    acc_model, acc_opt = accelerator.prepare(model, opt)
    # The guide's loop calls scheduler.step(): a constant schedule, prepared like the guide prepares its own.
    acc_sched = accelerator.prepare(constant_schedule(opt)) if "accelerate_guide" in cfg.modes else None
    ddp_kw = cfg.ddp_kwargs()
    dev_ids = [device.index if device.index is not None else accelerator.local_process_index] if device.type == "cuda" else None
    hook = comm_hook(cfg.comm_hook)
    prof_acc = CommProfiler(accelerator, acc_model, hook=hook, keep_records=None)  # short runs: every raw record
    raw_ddp = raw_opt = prof_raw = None
    if want_raw:  # plain DDP, the same constructor arguments as Accelerate's DistributedDataParallelKwargs
        raw_ddp = DistributedDataParallel(raw_model, device_ids=dev_ids, **ddp_kw)
        raw_opt = torch.optim.AdamW(raw_ddp.parameters(), lr=cfg.learning_rate)
        prof_raw = CommProfiler(accelerator, raw_ddp, hook=hook, keep_records=None)
    manual_opt = prof_manual = None
    if want_manual:  # one plain copy for both manual modes (weights and AdamW state reset before every run)
        manual_opt = torch.optim.AdamW(manual_model.parameters(), lr=cfg.learning_rate)
        prof_manual = CommProfiler(accelerator, manual_model, distributed=True, keep_records=None)  # told of each all-reduce

    # Data: the K-th dataloader holds exactly (warm-up + measured) x K micro-batches per process.
    run_steps = cfg.warmup_steps + cfg.steps
    B, K_max = cfg.per_device_train_batch_size, max(cfg.accumulation_steps)
    tokens = synthetic_tokens(run_steps * K_max * world * B, cfg.block_size, cfg.vocab_size, cfg.seed + 1)
    labels = variable_target_labels(tokens, cfg.seed + 2) if cfg.variable_targets else tokens
    loaders = {}
    for K in cfg.accumulation_steps:
        n_batches = run_steps * K * world
        rows = TokenRows(tokens[: n_batches * B], labels[: n_batches * B])
        loaders[K] = {
            "rows": rows,
            "toolkit": accelerator.prepare(DataLoader(rows, batch_size=B, shuffle=False)),
            "raw": DataLoader(rows, batch_sampler=raw_batch_indices(n_batches, B, rank, world)),
        }
    memory = PeakMemory(device)
    info = {"config": PRESETS[preset], "parameters": n_params, "gradient_bytes": grad_bytes,
            "micro_batch": f"{B}x{cfg.block_size} tokens", "memory_method": memory.method,
            "ddp_kwargs": ddp_kw, "comm_hook": cfg.comm_hook,
            # targets per micro-batch over all processes, averaged over the data of the largest K
            "targets_per_micro_batch": float((labels[:, 1:] != -100).sum()) / (run_steps * K_max)}

    def one_run(mode: str, K: int, tag: str) -> dict:
        if mode == "trainer":  # a new Trainer (and DDP wrapper, profiler) per run, on the peer copy
            reset_weights(peer_model, initial)  # run_trainer makes a fresh AdamW
            prof = None
        elif mode == "raw_ddp":
            model_, opt_, prof = raw_ddp, raw_opt, prof_raw
        elif mode in MANUAL_MODES:
            model_, opt_, prof = manual_model, manual_opt, prof_manual
        else:
            model_, opt_, prof = acc_model, acc_opt, prof_acc
            set_sync_each_batch(accelerator, mode == "sync_each_batch")
        if prof is not None:
            reset_training_state(model_, initial, opt_)
            prof.enabled = True  # the previous run's on_train_end switched it off
            prof.mode = "sync_each_batch" if mode == "sync_each_batch" else "no_sync"  # others sync once per window
            callbacks = [prof, TagWindows(prof, cfg.warmup_steps, tag)]
        gc.collect()
        dist.barrier()
        memory.reset()
        t0 = time.perf_counter()
        if mode == "trainer":
            losses, prof = run_trainer(peer_model, loaders[K]["rows"], cfg, K, run_steps, accelerator, hook,
                                       lambda p: [p, TagWindows(p, cfg.warmup_steps, tag)])
        elif mode == "accelerate_guide":
            losses = train_accelerate_guide(accelerator, model_, opt_, acc_sched, loaders[K]["toolkit"], K, callbacks)
        elif mode == "raw_ddp":
            losses = train_raw_ddp(model_, opt_, iter(loaders[K]["raw"]), K, run_steps, device, callbacks=callbacks)
        elif mode in MANUAL_MODES:
            sync, record = MANUAL_MODES[mode], prof.record_allreduce
            losses = train_raw_ddp(model_, opt_, iter(loaders[K]["raw"]), K, run_steps, device, callbacks=callbacks,
                                   average_gradients=lambda params: sync(params, on_call=record))
        else:
            losses = run_toolkit(accelerator, model_, opt_, loaders[K]["toolkit"], K, run_steps, callbacks)
        wall = time.perf_counter() - t0
        peak, increase = memory.peak()
        mem = torch.tensor([-1.0 if peak is None else peak, -1.0 if increase is None else increase],
                           dtype=torch.float64, device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        return {"preset": preset, "K": K, "mode": mode, "wall_seconds": wall, "losses": losses,
                "load_average_1min": load_average(),
                "peak_rss_mb": None if peak is None else mem[0].item(),
                "peak_increase_mb": None if increase is None else mem[1].item(),
                **run_record(prof, tag)}

    # Everything built so far lives until the preset is done: keep the cyclic garbage collector from
    # re-scanning it (a full collection over transformers' objects takes ~0.1-0.5 s, in or out of a timed step).
    gc.collect()
    gc.freeze()

    # One unrecorded run per mode first: a fresh model's first steps pay page faults and allocator
    # growth that the per-run warm-up step does not fully absorb.
    # (The guide's loop last: it shares the toolkit's DDP model, whose first run primes a static graph.)
    for mode in sorted(cfg.modes, key=lambda m: m == "accelerate_guide"):
        one_run(mode, cfg.accumulation_steps[0], f"preset_warmup/{mode}")
    runs = []
    rotation = 0
    for rep in range(cfg.repeats):
        for K in cfg.accumulation_steps:
            shift = rotation % len(cfg.modes)
            order = cfg.modes[shift:] + cfg.modes[:shift]  # each mode takes every position in turn
            rotation += 1
            for position, mode in enumerate(order):
                rec = one_run(mode, K, f"{mode}/K{K}/r{rep}")
                rec.update(repeat=rep, position=position)
                runs.append(rec)
                bar.set_postfix_str(f"{preset} K={K} {mode}: {median(rec['step_seconds']):.3f} s/step")
                bar.update(1)
    set_sync_each_batch(accelerator, False)
    del acc_model, acc_opt, acc_sched, raw_ddp, raw_opt, prof_acc, prof_raw, loaders, model, raw_model, peer_model, opt
    del manual_model, manual_opt, prof_manual
    accelerator.free_memory()  # drops the prepared model, optimizer and dataloaders of this preset
    gc.unfreeze()
    gc.collect()
    return info, runs


def run(cfg: BenchConfig) -> dict:
    """Run the sweep described by ``cfg`` (or, with ``--tune``, the DDP settings' sweep); return the result.

    Process 0 also writes it to ``cfg.output_dir`` (bench.json, bench.csv,
    bench.png; with ``--tune`` tune.json and tune.csv) and prints the tables.

    Raises:
        UsageError: fewer than 2 processes, before any output is written.
        ProcessCountError: launched and visible process counts differ.
    """
    if launcher_world_size() < 2:
        raise UsageError("--num_processes", f"the bench compares DDP modes and needs >= 2 processes (launched: {launcher_world_size()})",
                         "run it under accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m accum_kit bench")
    accelerator = build_accelerator(None, ddp_kwargs=cfg.ddp_kwargs())
    world = accelerator.num_processes
    started, load_start, t0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), os.getloadavg(), time.perf_counter()
    per_pass = len(tune_settings(cfg)) if cfg.tune else len(cfg.accumulation_steps) * len(cfg.modes)
    bar = tqdm(total=len(cfg.model_presets) * cfg.repeats * per_pass, desc="bench runs",
               disable=not accelerator.is_main_process, file=sys.stdout)
    result = {"schema": "accum_kit.bench/2" if not cfg.tune else "accum_kit.bench.tune/1", "command": command(cfg, world),
              "config": asdict(cfg), "machine": machine(accelerator), "versions": library_versions(),
              "data": data_description(cfg),
              "timings_from": "process 0 (step times); peak memory: max over processes",
              "interval_method": INTERVAL_METHOD}
    presets, rows, all_runs, tables = {}, [], [], []
    if cfg.tune:
        recommendations = {}
        for preset in cfg.model_presets:
            info, runs = tune_preset(cfg, preset, accelerator, bar)
            p_rows = summarize_tune(preset, runs, info["settings"])
            recommendations[preset] = recommend(p_rows)
            presets[preset], all_runs, rows = info, all_runs + runs, rows + p_rows
            tables.append(format_tune_table(preset, info, p_rows, recommendations[preset]))
            if accelerator.is_main_process:
                bar.write(tables[-1] + "\n")
        result.update(presets=presets, rows=rows, recommendations=recommendations, runs=all_runs)
    else:
        per_k = []
        for preset in cfg.model_presets:
            info, runs = bench_preset(cfg, preset, accelerator, bar)
            p_rows, p_k = summarize_preset(preset, info, runs, cfg, world)
            presets[preset], all_runs = info, all_runs + runs
            rows += p_rows
            per_k += p_k
            tables.append(format_preset_table(preset, info, p_rows, p_k, cfg.modes) + "\n" + format_profile(info["profile"]))
            if set(cfg.modes) - set(MODES):  # peers or manual all-reduce modes
                tables[-1] += "\n" + format_peer_table(p_rows, cfg.modes, cfg.variable_targets)
            if accelerator.is_main_process:
                bar.write(tables[-1] + "\n")
        bars = evaluate_bars(rows, per_k, all_runs)
        tables.append(format_bars(bars))
        result.update(presets=presets, rows=rows, per_k=per_k, bars=bars, runs=all_runs)
    bar.close()
    result["timing"] = {"started": started, "total_seconds": time.perf_counter() - t0,
                        "load_average_start": list(load_start), "load_average_end": list(os.getloadavg())}
    if accelerator.is_main_process:
        paths = (write_tune_outputs if cfg.tune else write_outputs)(cfg.output_dir, result)
        print("\n".join(tables))
        print(f"wrote {', '.join(str(p) for p in paths)} ({result['timing']['total_seconds']:.0f} s; "
              f"load average {load_start[0]:.2f} at start, {result['timing']['load_average_end'][0]:.2f} at end)")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result
