"""``accum-kit bench`` under DeepSpeed: ZeRO stages x K, side by side in one pair of processes.

Run it with::

    accelerate launch --config_file accelerate_configs/cpu_deepspeed.yaml -m accum_kit bench \\
        --model_presets small --accumulation_steps 1 8 --zero_stages 1 2 3 --repeats 3 --steps 3

Under a DeepSpeed launch the bench sweeps ``--zero_stages`` (default 1 2 3)
instead of the DDP modes or the FSDP2 policies.

Schedule. ``deepspeed.initialize`` fixes an engine's ZeRO stage and K, so one
engine cannot switch stage between windows as one FSDP2 model switches policy.
Instead, for each K, one engine per stage is built in the same processes
(:func:`accum_kit.compat.prepare_deepspeed_engine`), each from its own copy of
the same initial model (same seed, so the same weights) with its own AdamW,
and all of them are fed the same K micro-batches every window. Every stage
computes the same exact update (tests/test_deepspeed.py: within 1.5e-8 of the
single-process big batch), so the engines' weights stay equal to rounding
and every window of every engine does the same arithmetic on the same
shapes: only what the stage does around it differs. The windows then
rotate across the engines (one :func:`accum_kit.train_loop` window per engine
per cycle, ``accelerator.backward`` re-tied to the engine whose turn it is,
:func:`accum_kit.compat.use_deepspeed_engine`): per repeat ``--warmup_steps``
unmeasured cycles, then ``--steps`` measured ones, the stage order rotated by
one from one (repeat, K) to the next. A cycle's windows run seconds apart,
so the ratio of two stages' windows in one cycle is paired: the machine's
load, which drifts over minutes, is nearly the same for both; the 95 %
intervals are over those per-cycle pairs (:mod:`.zero_report`). Before the
repeats, one unmeasured window per engine pays a fresh engine's first-step
costs (page faults, bucket allocation).

Recorded per window: step seconds and the process's CPU seconds in the
window (``time.process_time``: the work done, which other jobs' load
barely lengthens; the profiler's, process 0), every
DeepSpeed collective and the time in each engine's gradient reduction path
(:class:`accum_kit.profiler.CommProfiler`, :mod:`accum_kit.profiler.deepspeed_comm`),
the gradient and module parameter bytes held between micro-batches
(:func:`accum_kit.profiler.held_memory.held_bytes`,
:func:`accum_kit.compat.deepspeed_parameter_bytes`; the most over processes)
and the process's peak. Data are the DDP bench's synthetic tokens.
"""

from __future__ import annotations

import copy
import gc
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..core.callbacks import LoopCallback
from ..compat import deepspeed_parameter_bytes, prepare_deepspeed_engine, use_deepspeed_engine
from ..core.run_plan import run_plan_of
from ..errors import UsageError
from ..launch import build_accelerator, launcher_world_size
from ..core.loop import train_loop
from ..profiler.held_memory import GRADIENT_KINDS, held_bytes
from ..job.models import build_model, count_parameters
from ..profiler import CommProfiler
from ..stats import median
from ..engines.deepspeed import check_deepspeed_installed, deepspeed_plugin_for
from .config import BenchConfig
from .driver import Clock, publish, result_head, sweep_presets
from .data import TokenRows, synthetic_tokens, variable_target_labels
from .fsdp import command as sweep_command
from .memory import PeakMemory
from .zero_report import evaluate_zero_targets, format_zero_table, format_zero_targets, summarize_zero_preset
from .zero_files import write_zero_outputs

#: Profiler summary keys a run record keeps (see :func:`accum_kit.profiler.deepspeed_comm.zero_summary`).
SUMMARY_KEYS = ("by_kind", "collective_seconds_per_step", "reduction_seconds_per_step", "reduction_calls_per_step",
                "reduction_path_collectives")


def stage_name(stage: int) -> str:
    """``"zero1"`` ...: the stage's name in records and in :func:`accum_kit.engines.costs.zero_costs`."""
    return f"zero{stage}"


class EngineMemory(LoopCallback):
    """Loop callback: the most gradient and module parameter bytes an engine holds between two micro-batches
    (after a backward that does not end the window), and the process's peak per window."""

    def __init__(self, engine, peak: PeakMemory):
        self.engine, self.peak = engine, peak
        self.gradient_bytes, self.parameter_bytes, self.peaks_mb = 0, 0, []

    def on_train_begin(self, state):
        self.peak.reset()

    def on_backward_end(self, state):
        if state.boundary:
            return
        held = held_bytes(self.engine)
        self.gradient_bytes = max(self.gradient_bytes, sum(v for k, v in held.items() if k in GRADIENT_KINDS))
        self.parameter_bytes = max(self.parameter_bytes, deepspeed_parameter_bytes(self.engine))

    def on_train_end(self, state):
        self.peaks_mb.append(self.peak.peak()[0])


class Engines:
    """One DeepSpeed engine per ZeRO stage at one K, sharing the Accelerator; :meth:`window` runs one window of one.

    Each engine's model is a deep copy of ``model`` (the same initial weights), built before any
    engine so that ZeRO-3's in-place partitioning touches only its own copy.
    """

    def __init__(self, accelerator, model, cfg: BenchConfig, K: int, stages: list[int], rows: TokenRows,
                 profiler_holder: dict):
        self.accelerator, self.K = accelerator, K
        copies = {s: copy.deepcopy(model) for s in stages}
        B = cfg.per_device_train_batch_size
        self.built: dict[int, dict] = {}
        self.loader = None
        for s in stages:
            plugin = deepspeed_plugin_for(_plugin(s), gradient_accumulation_steps=K, max_grad_norm=None)
            opt = torch.optim.AdamW(copies[s].parameters(), lr=cfg.learning_rate)
            extra = () if self.loader is not None else (DataLoader(rows, batch_size=B, shuffle=False),)
            run_plan_of(accelerator).set_accumulation_steps(K)
            prepared, wrapper = prepare_deepspeed_engine(accelerator, copies[s], opt, plugin, B, *extra)
            engine, engine_opt = prepared[0], prepared[1]
            if extra:
                self.loader = prepared[2]
            if profiler_holder.get("profiler") is None:
                profiler_holder["profiler"] = CommProfiler(accelerator, engine, keep_records=None)
            profiler_holder["profiler"].zero.watch(engine.optimizer)
            self.built[s] = {"plugin": plugin, "wrapper": wrapper, "engine": engine, "optimizer": engine_opt,
                             "memory": EngineMemory(engine, PeakMemory(accelerator.device)),
                             "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
                             "param_groups": len(engine.optimizer.param_groups)}
        del copies

    def window(self, stage: int, profiler, tag: str, measured: bool) -> tuple[float, float, float | None]:
        """One optimizer step (K micro-batches) of the stage's engine; returns its start (``perf_counter``
        seconds), its step seconds and the process's CPU seconds in it (this process)."""
        b, acc = self.built[stage], self.accelerator
        use_deepspeed_engine(acc, b["plugin"], b["wrapper"])
        plan = run_plan_of(acc)  # the stage is this window's policy; K through the plan
        plan.engine.use_plugin(b["plugin"])
        plan.use_policy(stage_name(stage))
        plan.set_accumulation_steps(self.K)
        profiler.tag, profiler.enabled = tag, True  # the previous window's on_train_end switched it off
        start = time.perf_counter()
        train_loop(acc, b["engine"], b["optimizer"], self.loader, max_train_steps=1, progress=False,
                   profiler=profiler, callbacks=[b["memory"]] if measured else [])
        step = profiler.records(tag=tag).steps[-1]
        return start, step.step_seconds, step.cpu_seconds

    def close(self) -> None:
        """Destroy every engine and forget them in the Accelerator (their memory is freed)."""
        for b in self.built.values():
            b["engine"].destroy()
        self.built = {}
        self.accelerator.deepspeed_engine_wrapped = None
        self.accelerator.free_memory()


def _plugin(stage: int):
    """A fresh ``DeepSpeedPlugin`` of ``stage``, the launch's other settings (``ACCELERATE_DEEPSPEED_*``, or its
    DeepSpeed JSON) kept; the stage is written into the config too (a JSON's own stage would win otherwise)."""
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=stage)
    plugin.deepspeed_config.setdefault("zero_optimization", {})["stage"] = stage
    plugin.zero_stage = stage
    return plugin


def bench_zero_preset(cfg: BenchConfig, preset: str, accelerator, bar) -> tuple[dict, list[dict]]:
    """All engines and windows of one preset; returns (info, runs): one run record per (K, stage, repeat)."""
    world, device = accelerator.num_processes, accelerator.device
    model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
    n_params = count_parameters(model)
    B, stages = cfg.per_device_train_batch_size, list(cfg.zero_stages)
    holder: dict = {}
    runs = []
    for k_index, K in enumerate(cfg.accumulation_steps):
        n = K * world * B  # one window: every engine gets the same K micro-batches per process every window
        tokens = synthetic_tokens(n, cfg.block_size, cfg.vocab_size, cfg.seed + 1)
        labels = variable_target_labels(tokens, cfg.seed + 2) if cfg.variable_targets else tokens
        engines = Engines(accelerator, model, cfg, K, stages, TokenRows(tokens, labels), holder)
        prof = holder["profiler"]
        gc.collect()
        for s in stages:  # unmeasured: a fresh engine's first window pays page faults and bucket allocation
            engines.window(s, prof, f"warmup/K{K}", measured=False)
        for rep in range(cfg.repeats):
            shift = (rep + k_index) % len(stages)
            order = stages[shift:] + stages[:shift]
            seconds: dict[int, list] = {s: [] for s in order}
            cycles: dict[int, list] = {s: [] for s in order}
            starts: dict[int, list] = {s: [] for s in order}
            cpu: dict[int, list] = {s: [] for s in order}
            dist.barrier()
            for c in range(cfg.warmup_steps + cfg.steps):
                for s in order:
                    measured = c >= cfg.warmup_steps
                    tag = f"{stage_name(s)}/K{K}/r{rep}" if measured else f"warmup/K{K}/r{rep}"
                    t0, t, c_s = engines.window(s, prof, tag, measured)
                    if measured:
                        cpu[s].append(c_s)
                        seconds[s].append(t)
                        starts[s].append(t0)
                        cycles[s].append(c - cfg.warmup_steps)
            runs += _records(engines, prof, preset, K, rep, order, (seconds, cpu), cycles, starts, device)
            bar.set_postfix_str(f"{preset} K={K} " + ", ".join(f"ZeRO-{s} {median(seconds[s]):.2f}" for s in order))
            bar.update(1)
        info_k = {s: {"parameters": b["parameters"], "param_groups": b["param_groups"]}
                  for s, b in engines.built.items()}
        engines.close()
        del engines
        gc.collect()
    prof.detach()
    info = {"parameters": n_params, "engine_parameters": info_k[stages[0]]["parameters"],
            "param_groups": info_k[stages[0]]["param_groups"], "micro_batch": f"{B}x{cfg.block_size} tokens",
            "memory_method": PeakMemory(device).method}
    return info, runs


def _records(engines, prof, preset, K, rep, order, times, cycles, starts, device) -> list[dict]:
    """One record per stage of one repeat: step seconds per cycle, profiler figures, memory (max over processes)."""
    seconds, cpu = times
    mem = torch.tensor([[engines.built[s]["memory"].gradient_bytes, engines.built[s]["memory"].parameter_bytes,
                         max((p for p in engines.built[s]["memory"].peaks_mb if p is not None), default=-1.0)]
                        for s in order], dtype=torch.float64, device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # memory: the most over processes
    out = []
    for i, s in enumerate(order):
        summary = prof.local_summary(f"{stage_name(s)}/K{K}/r{rep}")
        out.append({"preset": preset, "K": K, "stage": s, "repeat": rep, "position": i, "cycles": cycles[s],
                    "window_starts": starts[s],
                    "step_seconds": seconds[s], "cpu_seconds": cpu[s], "optimizer_steps": len(seconds[s]),
                    "gradient_bytes": mem[i, 0].item(), "parameter_bytes": mem[i, 1].item(),
                    "peak_rss_mb": mem[i, 2].item() if mem[i, 2] >= 0 else None,
                    **{k: summary.get(k) for k in SUMMARY_KEYS}})
        engines.built[s]["memory"].gradient_bytes = engines.built[s]["memory"].parameter_bytes = 0
        engines.built[s]["memory"].peaks_mb = []
    return out


def check_launch() -> None:
    """Refuse a DeepSpeed bench that cannot run, before anything is built.

    Raises:
        UsageError: ``--use_deepspeed`` (the package is missing: install the extra),
            ``--num_processes`` (fewer than 2: nothing to shard with).
    """
    check_deepspeed_installed()
    if launcher_world_size() < 2:
        raise UsageError("--num_processes", f"the DeepSpeed bench needs >= 2 processes (launched: "
                         f"{launcher_world_size()})", "run it under accelerate launch --config_file "
                         "accelerate_configs/cpu_deepspeed.yaml -m accum_kit bench (2 processes)")


def run(cfg: BenchConfig) -> dict:
    """The ZeRO sweep described by ``cfg``; the result is also written to ``cfg.output_dir`` by process 0.

    Raises:
        UsageError: see :func:`check_launch`.
    """
    check_launch()
    accelerator = build_accelerator(max(cfg.accumulation_steps))
    clock = Clock()
    presets, rows, all_runs, tables = sweep_presets(cfg, accelerator, "bench runs (DeepSpeed)", bench_zero_preset,
                                                    summarize_zero_preset, format_zero_table)
    targets = evaluate_zero_targets(rows, presets)
    result = {**result_head("accum_kit.bench.zero/1", sweep_command(cfg, accelerator.num_processes,
                                                                      config="cpu_deepspeed.yaml"), cfg, accelerator),
              "presets": presets, "rows": rows, "targets": targets, "runs": all_runs, "timing": clock.timing()}
    publish(accelerator, result, tables, format_zero_targets(targets), write_zero_outputs)
    return result
