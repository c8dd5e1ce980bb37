"""``accum-kit bench`` under FSDP2: the four accumulation policies x K, side by side in one run.

Run it with::

    accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml -m accum_kit bench \\
        --model_presets small --accumulation_steps 2 4 8 --repeats 5

Under an FSDP2 launch the bench sweeps ``--accumulation_policies`` (default:
all four of :data:`accum_kit.engines.policies.POLICIES`) instead of the DDP modes,
on one prepared model (one ``fully_shard`` per layer, per the config).

Schedule: for each repeat and K, one :func:`accum_kit.train_loop` run from
the same initial weights and AdamW state, whose windows rotate through the
policies (:class:`PolicyRotation`): ``--warmup_steps`` unmeasured windows, then
``--steps`` cycles of one window per policy, the order rotated by one from
one (repeat, K) run to the next. Between windows the policy is applied
(Accelerate's ``sync_each_batch`` flag through :mod:`accum_kit.compat`, the
Accelerator's policy, and every unit's reshard-after-forward setting: off for
``no_sync_no_reshard``, FSDP2's own otherwise); parameters do not change
inside a window and every policy gives the same update, so this is one
ordinary training run. Comparing policies in adjacent windows, seconds
apart, rather than in runs minutes apart, keeps a shared machine's changing
load out of the ratios. One unrecorded run comes first (a fresh model's
first steps pay page faults). A :class:`accum_kit.profiler.CommProfiler`
records every all-gather and reduce-scatter, a
:class:`accum_kit.profiler.held_memory.HeldMemory` the bytes held between micro-batches
per policy, and the process's peak memory is taken per window.

The figures (:mod:`.fsdp_report`) and files (:mod:`.fsdp_files`) are
documented there; data and timing conventions are the DDP bench's
(:mod:`accum_kit.bench`): synthetic tokens, step times from process 0,
memory the maximum over processes.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from ..compat import (fsdp_reshard_after_forward_state, keep_fsdp_parameters_after_forward,
                      restore_fsdp_reshard_after_forward)
from ..errors import UsageError
from ..engines.mesh import EmulatedInterNodeLink, launched_replicas
from ..launch import build_accelerator, launcher_world_size
from ..core.callbacks import LoopCallback
from ..core.loop import train_loop
from ..profiler.held_memory import HeldMemory
from ..job.models import build_model, count_parameters
from ..engines.policies import POLICIES
from ..profiler import CommProfiler, ProfileRecords, sharded_summary
from ..engines.fsdp2 import element_bytes, sharded_model
from ..stats import median
from .config import MODES, BenchConfig
from .driver import Clock, publish, result_head, sweep_presets
from .data import TokenRows, synthetic_tokens, variable_target_labels
from .fsdp_files import write_fsdp_outputs
from .fsdp_report import evaluate_targets, format_fsdp_table, format_targets, summarize_fsdp_preset
from .memory import PeakMemory
from .runs import reset_training_state
from .saving_parts import window_parts

MB = 2**20


#: The profiler's mode for each policy (``sync_each_batch`` or not: what Accelerate's flag says).
MODE = {name: "sync_each_batch" if p.sync_each_batch else "no_sync" for name, p in POLICIES.items()}
#: The profiler summary keys a run record keeps (see :mod:`accum_kit.profiler.sharded`).
SUMMARY_KEYS = ("reduce_scatter_calls_per_step", "reduce_scatter_bytes_per_step", "reduce_scatter_busbw_GBps",
                "all_gather_calls_per_step", "all_gather_bytes_per_step", "all_gather_busbw_GBps",
                "all_reduce_calls_per_step", "all_reduce_bytes_per_step", "by_group", "syncs",
                "skipped_syncs", "compute_seconds", "accumulation_seconds", "accumulation_source", "exposed_comm_seconds",
                "exposed_all_gather_seconds_per_step",
                "optimizer_seconds", "ideal_seconds_per_step", "estimated_seconds_saved_per_step",
                "post_backward_sync_seconds", "post_backward_no_sync_seconds", "post_backward_adding_seconds",
                "shard_add_seconds", "shard_add_source", "saved_per_skipped_sync_seconds",
                "estimated_cpu_seconds_saved_per_step", "saved_per_skipped_sync_cpu_seconds",
                "accumulation_cpu_seconds", "shard_add_cpu_seconds", "post_backward_sync_cpu_seconds",
                "post_backward_no_sync_cpu_seconds", "post_backward_adding_cpu_seconds")


def apply_policy(accelerator, model, policy: str, fsdp_defaults: list) -> None:
    """Make the next window run ``policy`` on the prepared FSDP2 ``model`` (call between runs only).

    ``fsdp_defaults``: :func:`accum_kit.compat.fsdp_reshard_after_forward_state`
    taken after the model's first forward, when FSDP2 has settled its root.
    """
    from ..core.run_plan import run_plan_of

    p = POLICIES[policy]
    run_plan_of(accelerator).use_policy(policy)
    restore_fsdp_reshard_after_forward(fsdp_defaults)
    if p.reshard_after_forward is False:
        keep_fsdp_parameters_after_forward(model)


class PolicyRotation(LoopCallback):
    """Loop callback: the run's windows rotate through the policies, one window each, so that they are compared
    seconds apart (a shared machine's load changes on that scale too).

    The first ``warmup`` windows run ``policies[0]`` and are tagged ``warmup/<label>``; then window ``w`` runs
    ``policies[(w - warmup) % n]`` (cycle ``(w - warmup) // n``), tagged ``<policy>/<label>``. The policy is applied
    between windows (in ``on_step_end``, after the profiler has recorded the step), and the process's peak memory
    is taken per window (:class:`accum_kit.bench.memory.PeakMemory`).

    Attributes:
        windows: per measured window: ``step`` (its index), ``policy``, ``cycle``, ``peak_mb``.
    """

    def __init__(self, accelerator, model, profiler, policies: list[str], warmup: int, label: str, defaults: list,
                 memory: PeakMemory):
        self.accelerator, self.model, self.profiler, self.policies = accelerator, model, profiler, policies
        self.warmup, self.label, self.defaults, self.memory = warmup, label, defaults, memory
        self.windows: list[dict] = []

    def tag(self, policy: str) -> str:
        return f"{policy}/{self.label}"

    def _policy(self, w: int) -> str:
        return self.policies[0] if w < self.warmup else self.policies[(w - self.warmup) % len(self.policies)]

    def _start(self, w: int) -> None:
        policy = self._policy(w)
        apply_policy(self.accelerator, self.model, policy, self.defaults)
        self.profiler.mode = MODE[policy]
        self.profiler.tag = f"warmup/{self.label}" if w < self.warmup else self.tag(policy)
        self.memory.reset()

    def on_train_begin(self, state):
        self._start(0)

    def on_step_end(self, state):
        w = state.step - 1  # the window that just ended
        if w >= self.warmup:
            self.windows.append({"step": w, "policy": self._policy(w), "cycle": (w - self.warmup) // len(self.policies),
                                 "peak_mb": self.memory.peak()[0]})
        self._start(state.step)


def pooled_summaries(prof, cfg: BenchConfig, world: int, order: list[str]) -> dict:
    """The profiler's figures per (K, policy) over all repeats at once (``"K<K>/<policy>"`` -> SUMMARY_KEYS).

    Pooling the repeats' records gives the medians behind the exposed
    reduce-scatter (one synchronised backward per window) several times the
    samples of one run. Read with FSDP2's own reshard settings in force, so the
    all-gathers the estimated saving compares with are those of the real
    ``sync_each_batch``. Each also has ``window_parts``
    (:func:`accum_kit.bench.saving_parts.window_parts`).
    """
    units = prof.collectives.unit_info()
    every = prof.records()
    out = {}
    for K in cfg.accumulation_steps:
        for policy in order:
            tags = {f"{policy}/K{K}/r{rep}" for rep in range(cfg.repeats)}
            mine = ProfileRecords(*([r for r in records if r.tag in tags] for records in
                                    (every.calls, every.micro_batches, every.steps, every.collectives,
                                     every.post_backwards)))
            summary = sharded_summary(mine, shard_size=prof.shard_size, replicate_size=prof.replicate_size, units=units)
            out[f"K{K}/{policy}"] = {**{k: summary.get(k) for k in SUMMARY_KEYS}, "window_parts": window_parts(mine)}
    return out


def command(cfg: BenchConfig, world: int, hybrid: bool = False, config: str | None = None) -> str:
    """The command line that repeats this sweep (flags that differ from the defaults); ``config``: the
    accelerate config's file name when not cpu_fsdp.yaml / cpu_hsdp.yaml (both start 2 processes)."""
    default = BenchConfig()
    flags = []
    for name, value in asdict(cfg).items():
        if name == "modes" or value == getattr(default, name):
            continue
        flags.append(f"--{name} " + (" ".join(map(str, value)) if isinstance(value, list) else str(value).lower()
                                     if isinstance(value, bool) else str(value)))
    config, usual = (config, 2) if config else ("cpu_hsdp.yaml", 4) if hybrid else ("cpu_fsdp.yaml", 2)
    procs = "" if world == usual else f" --num_processes {world}"
    return (f"accelerate launch --config_file accelerate_configs/{config}{procs} -m accum_kit bench"
            + "".join(f" {f}" for f in flags))


def bench_fsdp_preset(cfg: BenchConfig, preset: str, accelerator, bar) -> tuple[dict, list[dict]]:
    """All runs of one preset under FSDP2; returns (info, runs)."""
    world, device = accelerator.num_processes, accelerator.device
    model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
    n_params = count_parameters(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    acc_model, acc_opt = accelerator.prepare(model, opt)
    initial = [p.detach().clone() for p in acc_model.parameters()]  # DTensor shards
    link = (EmulatedInterNodeLink(acc_model, cfg.emulate_inter_node_GBps).install()
            if cfg.emulate_inter_node_GBps is not None else None)  # before the profiler: its timings include it
    prof = CommProfiler(accelerator, acc_model, keep_records=None)  # short runs: every raw record

    order = list(cfg.accumulation_policies)
    run_steps = cfg.warmup_steps + cfg.steps * len(order)
    B, K_max = cfg.per_device_train_batch_size, max(cfg.accumulation_steps)
    tokens = synthetic_tokens(run_steps * K_max * world * B, cfg.block_size, cfg.vocab_size, cfg.seed + 1)
    labels = variable_target_labels(tokens, cfg.seed + 2) if cfg.variable_targets else tokens
    loaders = {}
    for K in cfg.accumulation_steps:
        n = run_steps * K * world * B
        loaders[K] = accelerator.prepare(DataLoader(TokenRows(tokens[:n], labels[:n]), batch_size=B, shuffle=False))
    memory = PeakMemory(device)
    defaults: list = []

    def one_run(K: int, rep, policies: list[str]) -> list[dict]:
        """One train_loop whose windows rotate through ``policies``; one record per policy."""
        reset_training_state(acc_model, initial, acc_opt)
        prof.enabled = True  # the previous run's on_train_end switched it off
        held = HeldMemory(accelerator, acc_model)
        rotation = PolicyRotation(accelerator, acc_model, prof, policies, cfg.warmup_steps, f"K{K}/r{rep}", defaults,
                                  memory)
        accelerator.gradient_accumulation_steps = K
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        result = train_loop(accelerator, acc_model, acc_opt, loaders[K], max_train_steps=run_steps, progress=False,
                            profiler=prof, callbacks=[rotation, held])
        wall = time.perf_counter() - t0
        by_policy = held.local()["by_policy"]
        mem = torch.tensor([[by_policy.get(p, {}).get("gradient_bytes", 0),
                             by_policy.get(p, {}).get("gathered_parameter_bytes", 0)] for p in policies] +
                           [[w["peak_mb"] if w["peak_mb"] is not None else -1.0, 0] for w in rotation.windows],
                           dtype=torch.float64, device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # memory: the most over processes
        peaks = mem[len(policies):, 0].tolist()
        records = []
        for i, policy in enumerate(policies):
            tag = rotation.tag(policy)
            prof.mode = MODE[policy]  # the profiler summarises the records of its current mode
            s = prof.local_summary(tag)
            mine = [(w, pk) for w, pk in zip(rotation.windows, peaks) if w["policy"] == policy]
            steps = {x.step: x for x in prof.records(tag=tag).steps}
            records.append({
                "preset": preset, "K": K, "policy": policy, "repeat": rep, "position": i, "run_wall_seconds": wall,
                "losses": result.train_loss, "cycles": [w["cycle"] for w, _ in mine],
                "step_seconds": [steps[w["step"]].step_seconds for w, _ in mine], "optimizer_steps": len(mine),
                "step_cpu_seconds": [steps[w["step"]].cpu_seconds for w, _ in mine],
                "peak_rss_mb": max((pk for _, pk in mine), default=None) if memory.method else None,
                "gradient_bytes": mem[i, 0].item(), "gathered_parameter_bytes": mem[i, 1].item(),
                **{k: s.get(k) for k in SUMMARY_KEYS}})
        return records

    with torch.no_grad():  # FSDP2 settles its root's reshard setting at the first forward: save them after it
        acc_model(input_ids=tokens[:1].to(device))
    for m in acc_model.modules():  # without a backward the units kept after forward stay gathered: free them
        if isinstance(m, FSDPModule):
            m.reshard()
    defaults[:] = fsdp_reshard_after_forward_state(acc_model)
    layout = sharded_model(acc_model)  # read with FSDP2's own settings in force
    gc.collect()
    gc.freeze()  # as the DDP sweep: keep the collector from re-scanning what lives for the whole preset
    one_run(cfg.accumulation_steps[0], "preset_warmup", order)  # unrecorded: a fresh model's first steps are slow
    b_p, b_c, b_r = element_bytes(accelerator, acc_model)
    runs = []
    for rep in range(cfg.repeats):
        for k_index, K in enumerate(cfg.accumulation_steps):
            shift = (rep + k_index) % len(order)  # each K's leading policy changes every repeat
            recs = one_run(K, rep, order[shift:] + order[:shift])
            runs += recs
            bar.set_postfix_str(f"{preset} K={K} " + ", ".join(f"{r['policy']} {median(r['step_seconds']):.2f}"
                                                              for r in recs))
            bar.update(1)
    apply_policy(accelerator, acc_model, "no_sync", defaults)
    if link is not None:
        link.remove()
    prof.detach()
    info = {"pooled": pooled_summaries(prof, cfg, world, order), "parameters": n_params, "micro_batch": f"{B}x{cfg.block_size} tokens", "memory_method": memory.method,
            "mesh": {"dp_replicate_size": prof.replicate_size, "dp_shard_size": prof.shard_size},
            "emulated_inter_node_GBps": cfg.emulate_inter_node_GBps,
            "emulated_seconds_added": link.seconds_added if link is not None else 0.0,
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
    clock = Clock()
    presets, rows, all_runs, tables = sweep_presets(cfg, accelerator, "bench runs (FSDP2)", bench_fsdp_preset,
                                                    summarize_fsdp_preset, format_fsdp_table)
    targets = evaluate_targets(rows, presets)
    result = {**result_head("accum_kit.bench.fsdp/1", command(cfg, world, launched_replicas() > 1), cfg, accelerator),
              "presets": presets, "rows": rows, "targets": targets, "runs": all_runs, "timing": clock.timing()}
    publish(accelerator, result, tables, format_targets(targets), write_fsdp_outputs)
    return result
