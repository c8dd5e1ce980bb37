"""What the FSDP2 and DeepSpeed benches share around their runs: the preset loop with its progress bar and
tables, and the end (files written by process 0, tables and targets printed, the processes released)."""

from __future__ import annotations

import os
import sys
import time

from tqdm.auto import tqdm


def sweep_presets(cfg, accelerator, desc: str, bench_preset, summarize, format_table) -> tuple[dict, list, list, list]:
    """Run ``bench_preset(cfg, preset, accelerator, bar) -> (info, runs)`` for every preset, then
    ``summarize(preset, info, runs, cfg, world) -> dict`` (its ``rows`` are popped into the rows) and
    ``format_table(preset, info, rows) -> str`` (printed by process 0 as each preset ends).

    Returns:
        ``(presets, rows, runs, tables)``: ``{preset: info}``, every row, every run record, the tables.
    """
    world = accelerator.num_processes
    total = len(cfg.model_presets) * cfg.repeats * len(cfg.accumulation_steps)
    bar = tqdm(total=total, desc=desc, disable=not accelerator.is_main_process, file=sys.stdout)
    presets, rows, all_runs, tables = {}, [], [], []
    for preset in cfg.model_presets:
        info, runs = bench_preset(cfg, preset, accelerator, bar)
        info.update(summarize(preset, info, runs, cfg, world))
        presets[preset], all_runs = info, all_runs + runs
        rows += info.pop("rows")
        tables.append(format_table(preset, info, [r for r in rows if r["preset"] == preset]))
        if accelerator.is_main_process:
            bar.write(tables[-1] + "\n")
    bar.close()
    return presets, rows, all_runs, tables


def result_head(schema: str, command: str, cfg, accelerator) -> dict:
    """The keys every sharded bench's result starts with: schema, command, config, machine, versions, data,
    where the timings come from."""
    from dataclasses import asdict

    from ..outputs import library_versions
    from .data import data_description
    from .sweep import machine

    return {"schema": schema, "command": command, "config": asdict(cfg), "machine": machine(accelerator),
            "versions": library_versions(), "data": data_description(cfg),
            "timings_from": "process 0 (step times); memory: max over processes"}


class Clock:
    """When and under what load a sweep started; :meth:`timing` is the result's ``timing`` block."""

    def __init__(self):
        self.started, self.load_start, self.t0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), os.getloadavg(), time.perf_counter()

    def timing(self) -> dict:
        """``{"started", "total_seconds", "load_average_start", "load_average_end"}`` (seconds; 1, 5, 15-minute loads)."""
        return {"started": self.started, "total_seconds": time.perf_counter() - self.t0,
                "load_average_start": list(self.load_start), "load_average_end": list(os.getloadavg())}


def publish(accelerator, result: dict, tables: list[str], targets_text: str, write) -> None:
    """Process 0 writes the files (``write(output_dir, result) -> paths``) and prints tables, targets and
    where the files went; then every process waits and ends training."""
    if accelerator.is_main_process:
        paths = write(result["config"]["output_dir"], result)
        timing = result["timing"]
        print("\n".join(tables))
        print(targets_text)
        print(f"wrote {', '.join(str(p) for p in paths)} ({timing['total_seconds']:.0f} s; load average "
              f"{timing['load_average_start'][0]:.2f} at start, {timing['load_average_end'][0]:.2f} at end)")
    accelerator.wait_for_everyone()
    accelerator.end_training()
