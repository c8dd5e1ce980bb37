"""The sweep of ``accum-kit bench``, the same under every engine: presets x K x arms, rotated, repeated, recorded.

:func:`run` takes the part of the run (:func:`accum_kit.bench.parts.run_part`: the launch's engine's, or
``--torch_compile``'s) and does the rest:

1. refuse a launch the part cannot run, build the Accelerator;
2. per preset (:func:`sweep_preset`): the part's session builds the model(s) and data and warms them up;
   then the blocks (:func:`blocks`): for each repeat and K (or, for a part that builds its arms per K,
   for each K and repeat) one run of every arm, in an order rotated from one block to the next, so each
   arm takes every position in turn; the session returns one record per arm, to which the block's
   ``repeat`` and the arm's ``position`` are added;
3. the part's figures per preset (rows, paired ratios with 95 % intervals; :mod:`.bench_report`), its table
   printed as the preset ends;
4. the result: a head every part shares (``schema``, ``command``, ``config``, ``machine``, ``versions``,
   ``data``, ``timings_from``, ``interval_method``), the part's keys (``presets``, ``rows``, ``runs``, its
   verdicts...), ``timing``; process 0 writes the part's files through the one writer
   (:func:`accum_kit.bench.bench_files.write_files`: staged, all or nothing) and prints the tables, the
   verdicts and where the files went.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from dataclasses import asdict, fields

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..outputs import library_versions
from ..stats import median
from .bench_config import BenchConfig
from .bench_data import data_description
from .bench_files import write_files
from .bench_report import INTERVAL_METHOD
from .parts import BenchPart, run_part


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


def command(cfg: BenchConfig, world: int, config: str = "cpu_ddp.yaml", launched: int = 2) -> str:
    """The command line that repeats this sweep: the flags whose value differs from the default, under the
    accelerate config ``config`` (``accelerate_configs/``), which starts ``launched`` processes."""
    procs = "" if world == launched else f" --num_processes {world}"
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
    return (f"accelerate launch --config_file accelerate_configs/{config}{procs} -m accum_kit bench"
            + "".join(f" {x}" for x in flags))


class Clock:
    """When and under what load a sweep started; :meth:`timing` is the result's ``timing`` block."""

    def __init__(self):
        self.started, self.load_start, self.t0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), os.getloadavg(), time.perf_counter()

    def timing(self) -> dict:
        """``{"started", "total_seconds", "load_average_start", "load_average_end"}`` (seconds; 1, 5, 15-minute loads)."""
        return {"started": self.started, "total_seconds": time.perf_counter() - self.t0,
                "load_average_start": list(self.load_start), "load_average_end": list(os.getloadavg())}


def blocks(part: BenchPart, cfg: BenchConfig, arms: list):
    """Yield ``(repeat, K, arms in this block's order)`` for every block of one preset, in run order.

    Repeat-major (every K once per repeat) unless the part runs every repeat of one K first
    (``part.k_outer``); the arms' order is rotated by ``part.shift(repeat, k_index, block)`` places.
    """
    ks = cfg.accumulation_steps
    pairs = ([(rep, k) for k in range(len(ks)) for rep in range(cfg.repeats)] if part.k_outer
             else [(rep, k) for rep in range(cfg.repeats) for k in range(len(ks))])
    for block, (rep, k) in enumerate(pairs):
        shift = part.shift(rep, k, block) % len(arms)
        yield rep, ks[k], arms[shift:] + arms[:shift]


def sweep_preset(part: BenchPart, cfg: BenchConfig, preset: str, accelerator, bar) -> tuple[dict, list[dict]]:
    """Every run of one preset (see the module docstring); returns ``(info, runs)``.

    ``bar``: the progress bar (``set_postfix_str``, ``update``: one step per block).
    """
    session = part.session(cfg, preset, accelerator)
    # Everything built so far lives until the preset is done: keep the cyclic garbage collector from
    # re-scanning it (a full collection over transformers' objects takes ~0.1-0.5 s, in or out of a timed step).
    gc.collect()
    gc.freeze()
    session.warm_up()
    runs = []
    for repeat, K, order in blocks(part, cfg, part.arms(cfg)):
        records = session.run_block(K, repeat, order)
        for position, rec in enumerate(records):
            rec.update(repeat=repeat, position=position)
        runs += records
        bar.set_postfix_str(f"{preset} K={K} " + ", ".join(f"{part.arm_label(r)} {median(r['step_seconds']):.3f}"
                                                          for r in records))
        bar.update(1)
    info = session.close()
    del session
    gc.unfreeze()
    gc.collect()
    return info, runs


def run(cfg: BenchConfig) -> dict:
    """Run the sweep ``cfg`` describes under the launch's engine (see the module docstring); return the result.

    Process 0 also writes the part's files to ``cfg.output_dir`` (``bench.json``, ``bench.csv`` and for the
    DDP modes and the FSDP2 policies ``bench.png``; one process: ``bench.json``, ``bench.csv``; ``--tune``:
    ``tune.json``, ``tune.csv``; ``--torch_compile``: ``compile.json``) and prints the tables.

    Raises:
        UsageError: fewer than 2 processes for a part that needs them (``--torch_compile``, FSDP2, DeepSpeed; a DDP
            launch of one process runs the one-process part), an HSDP-only flag outside HSDP, or what the part refuses
            (a DeepSpeed launch without the package, a compile backend that cannot run), before any output.
        ProcessCountError: launched and visible process counts differ.
    """
    part = run_part(cfg)
    cfg.check_hsdp_flags(part.hybrid())
    part.check_launch(cfg)
    accelerator = part.build_accelerator(cfg)
    world = accelerator.num_processes
    clock = Clock()
    bar = tqdm(total=len(cfg.model_presets) * cfg.repeats * len(cfg.accumulation_steps), desc=part.progress,
               disable=not accelerator.is_main_process, file=sys.stdout)
    presets, collected, all_runs, tables = {}, {}, [], []
    for preset in cfg.model_presets:
        info, runs = sweep_preset(part, cfg, preset, accelerator, bar)
        figures = part.summarize(preset, info, runs, cfg, world)
        collected[preset] = {key: figures.pop(key) for key in part.collects}
        info.update(figures)
        presets[preset], all_runs = info, all_runs + runs
        tables.append(part.format_preset(preset, info, collected[preset], cfg))
        if accelerator.is_main_process:
            bar.write(tables[-1] + "\n")
    bar.close()
    body, verdicts = part.result(cfg, presets, collected, all_runs, world)
    result = {"schema": part.schema, "command": command(cfg, world, *part.config_file()), "config": asdict(cfg),
              "machine": machine(accelerator), "versions": library_versions(), "data": data_description(cfg),
              "timings_from": part.timings_from, "interval_method": INTERVAL_METHOD, **body,
              "timing": clock.timing()}
    if accelerator.is_main_process:
        paths = write_files(cfg.output_dir, part.files(result))  # every file made first: an error writes none
        timing = result["timing"]
        print("\n".join(tables))
        if verdicts is not None:
            print(verdicts)
        print(f"wrote {', '.join(str(p) for p in paths)} ({timing['total_seconds']:.0f} s; load average "
              f"{timing['load_average_start'][0]:.2f} at start, {timing['load_average_end'][0]:.2f} at end)")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result
