"""The DDP part of ``accum-kit bench``: the modes (loops) side by side on one model, data and seed.

Arms: ``--modes`` (default ``sync_each_batch``, ``no_sync``, ``raw_ddp``; opt-in ``no_sync_fused``, the manual
all-reduce modes and the peers ``trainer`` and ``accelerate_guide``, :mod:`.peers`); what each runs is in
:mod:`accum_kit.bench`'s docstring. The kit's modes run the loss from the logits, raw DDP's formula, so that
``no_sync`` / ``raw_ddp`` is the loop alone; ``no_sync_fused`` runs ``no_sync`` with ``train_loop``'s default
fused loss on the same prepared model, and its comparison with ``no_sync`` (step time and the memory saved
against the prediction, :mod:`.loss_axis`, :mod:`.report_loss`) is the loss alone. Every block of the sweep runs each mode once, a whole run of
``--warmup_steps`` + ``--steps`` optimizer steps from the same weights and AdamW state (reset before every
run), the order rotated by one from one block to the next.

Switching between the modes (:meth:`DDPSession.switch`): ``sync_each_batch`` and ``no_sync`` share the one
prepared model and differ only in the policy the run plan puts in force
(:meth:`accum_kit.core.run_plan.RunPlan.use_policy`, as :class:`accum_kit.profiler.ABSwitch` does); ``raw_ddp``
runs a fresh copy of the model wrapped in plain DDP with the same constructor settings, the manual modes a
plain copy (gradients averaged by hand), ``trainer`` a new Trainer on its own copy per run, and
``accelerate_guide`` the prepared model. Each run becomes one record (:func:`accum_kit.bench.run_records.run_record`
plus memory, losses and wall time); :func:`accum_kit.bench.report_ddp.summarize_preset` turns them into the
rows, the per-K figures and the bars.
"""

from __future__ import annotations

import copy
import gc
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ..core.run_plan import run_plan_of
from ..job.models import PRESETS, count_parameters
from ..profiler import CommProfiler
from ..reference.manual_allreduce import MANUAL_MODES
from ..reference.raw_ddp import train_raw_ddp
from .bench_config import MODES
from .checkpointing_ab import GC_SUFFIX, BlockForwards, TrimmedPeakMemory, checkpointed_prepare, twin_name
from .report_checkpointing import checkpointing_rows, format_checkpointing_table
from .bench_data import TokenRows, raw_batch_indices, synthetic_rows
from .bench_files import plot_modes_png
from .report_ddp import DDP_CSV_FIELDS, evaluate_bars, summarize_preset
from .report_loss import fused_axis_row, fused_axis_targets
from .bench_tables import (format_bars, format_loss_axis_table, format_peer_table, format_preset_table, format_profile,
                           format_targets)
from .loss_axis import compute_element_bytes, is_fused, logits_arm, loss_fn, predicted_loss_memory
from .parts import BenchPart
from .peak_memory import PeakMemory
from .run_records import TagWindows, run_record
from .runs import (comm_hook, device_ids, gathered_peaks, load_average, reset_training_state, reset_weights,
                   run_toolkit)


class DDPBench(BenchPart):
    """The DDP modes (see the module docstring); ``--tune`` hands over to :class:`accum_kit.bench.part_tune.TuneBench`."""

    measures_adapters = True

    collects = ("rows", "per_k", "fused_loss")
    csv_fields = DDP_CSV_FIELDS
    plot = staticmethod(plot_modes_png)

    def for_config(self, cfg) -> BenchPart:
        if cfg.tune:
            from .part_tune import TuneBench

            return TuneBench()
        return self

    def twin_arms(self, cfg) -> list:
        """``sync_each_batch``, ``no_sync`` and ``raw_ddp``, those of ``--modes``."""
        return [m for m in cfg.modes if m in MODES]

    def arms(self, cfg) -> list:
        """``--modes``; with ``--gradient_checkpointing_ab`` each twin right after its mode."""
        twins = self.twin_arms(cfg) if cfg.gradient_checkpointing_ab else []
        return [a for m in cfg.modes for a in ([m, twin_name(m)] if m in twins else [m])]

    def session(self, cfg, preset: str, accelerator) -> "DDPSession":
        return DDPSession(cfg, preset, accelerator)

    def summarize(self, preset, info, runs, cfg, world) -> dict:
        rows, per_k = summarize_preset(preset, info, runs, cfg, world)
        if cfg.gradient_checkpointing_ab:
            info["checkpointing"] = checkpointing_rows(preset, runs, "mode", self.twin_arms(cfg), cfg.accumulation_steps)
        return {"rows": rows, "per_k": per_k, "fused_loss": ddp_loss_axis(preset, info, runs, cfg)}

    def format_preset(self, preset, info, collected, cfg) -> str:
        text = (format_preset_table(preset, info, collected["rows"], collected["per_k"], cfg.modes) + "\n"
                + format_profile(info["profile"]))
        if set(cfg.modes) - set(MODES):  # peers or manual all-reduce modes
            text += "\n" + format_peer_table(collected["rows"], cfg.modes, cfg.variable_targets)
        if "checkpointing" in info:
            text += "\n" + format_checkpointing_table(preset, info["checkpointing"])
        if collected["fused_loss"]:
            text += "\n" + format_loss_axis_table(preset, collected["fused_loss"])
        return text

    def result(self, cfg, presets, collected, runs, world):
        rows = [r for c in collected.values() for r in c["rows"]]
        per_k = [d for c in collected.values() for d in c["per_k"]]
        axis = [r for c in collected.values() for r in c["fused_loss"]]
        bars, targets = evaluate_bars(rows, per_k, runs), fused_axis_targets(axis)
        text = format_bars(bars) + ("\n" + format_targets(targets) if targets else "")
        return {"presets": presets, "rows": rows, "per_k": per_k, "bars": bars, "fused_loss": axis, "targets": targets,
                "runs": runs}, text


def ddp_loss_axis(preset: str, info: dict, runs: list[dict], cfg) -> list[dict]:
    """Every fused mode of ``--modes`` against its mode with the logits, per K (:func:`fused_axis_row`): step time
    paired per repeat, the memory saved as the logits run's rise of the peak over its start minus the fused run's
    (per repeat, the most over processes), against the memory model's prediction (``info["fused_loss_prediction"]``)."""
    out = []
    predicted = (info.get("fused_loss_prediction") or {}).get("saved_mb")
    for mode in (m for m in cfg.modes if is_fused(m)):
        for K in cfg.accumulation_steps:
            fused = [r for r in runs if r["K"] == K and r["mode"] == mode]
            logits = [r for r in runs if r["K"] == K and r["mode"] == logits_arm(mode)]
            rise = {r["repeat"]: r["peak_increase_mb"] for r in fused if r["peak_increase_mb"] is not None}
            saved = [r["peak_increase_mb"] - rise[r["repeat"]] for r in sorted(logits, key=lambda r: r["repeat"])
                     if r["peak_increase_mb"] is not None and r["repeat"] in rise]
            out.append(fused_axis_row(preset, K, mode, logits_arm(mode), fused, logits, saved, predicted,
                                      f"rise of the peak over the run's start ({info['memory_method']}), the most over "
                                      "processes, paired per repeat"))
    return out



class DDPSession:
    """The runs of one preset under DDP: one prepared model (``sync_each_batch``, ``no_sync``, the guide) and
    the copies the other modes need, the data of every K, one :class:`accum_kit.profiler.CommProfiler` per model.

    Attributes:
        info: what the preset's entry in ``bench.json`` starts with (config, parameters, gradient bytes...).
    """

    def __init__(self, cfg, preset: str, accelerator):
        self.cfg, self.preset, self.accelerator = cfg, preset, accelerator
        self.plan = run_plan_of(accelerator)
        world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
        model = cfg.build_model(preset)  # with --use_peft: a PeftModel, every weight frozen but the adapters
        if run_plan_of(accelerator).gradient_checkpointing:  # every arm's copy checkpoints, not only the prepared one
            model = run_plan_of(accelerator).engine.apply_activation_checkpointing(accelerator, model)
        modes = set(cfg.modes)

        def copy_for(wanted: bool):  # a fresh copy of the same weights, for a mode that wraps its own
            return copy.deepcopy(model).to(device) if wanted else None

        raw_model = copy_for("raw_ddp" in modes)
        ab = cfg.gradient_checkpointing_ab  # twins: a checkpointed copy, prepared as --gradient_checkpointing prepares
        self.gc_model = self.gc_opt = self.raw_gc_ddp = self.raw_gc_opt = self.prof_gc = self.prof_raw_gc = None
        if ab:
            with checkpointed_prepare(accelerator):
                gc_model = self.plan.engine.apply_activation_checkpointing(accelerator, copy.deepcopy(model))
                raw_gc = copy.deepcopy(gc_model).to(device) if "raw_ddp" in modes else None
                self.gc_opt = torch.optim.AdamW(gc_model.parameters(), lr=cfg.learning_rate)
                self.gc_model, self.gc_opt = accelerator.prepare(gc_model, self.gc_opt)
        self.peer_model = copy_for("trainer" in modes)  # Trainer wraps its own DDP
        self.manual_model = copy_for(bool(modes & set(MANUAL_MODES)))  # no DDP: gradients averaged by hand
        self.initial = [p.detach().clone() for p in model.parameters()]
        n_params = count_parameters(model)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

        opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
        self.acc_model, self.acc_opt = accelerator.prepare(model, opt)
        self.acc_sched = None
        if "accelerate_guide" in modes:  # the guide's loop calls scheduler.step(): a constant one, prepared as the guide does
            from .peers import constant_schedule

            self.acc_sched = accelerator.prepare(constant_schedule(opt))
        ddp_kw = cfg.ddp_kwargs()
        self.hook = comm_hook(cfg.comm_hook)
        self.prof_acc = CommProfiler(accelerator, self.acc_model, hook=self.hook, keep_records=None)  # short runs: every raw record
        self.raw_ddp = self.raw_opt = self.prof_raw = None
        if raw_model is not None:  # plain DDP, the same constructor arguments as Accelerate's DistributedDataParallelKwargs
            self.raw_ddp = DistributedDataParallel(raw_model, device_ids=device_ids(accelerator), **ddp_kw)
            self.raw_opt = torch.optim.AdamW(self.raw_ddp.parameters(), lr=cfg.learning_rate)
            self.prof_raw = CommProfiler(accelerator, self.raw_ddp, hook=self.hook, keep_records=None)
        if ab:
            self.prof_gc = CommProfiler(accelerator, self.gc_model, hook=self.hook, keep_records=None)
            if raw_gc is not None:
                self.raw_gc_ddp = DistributedDataParallel(raw_gc, device_ids=device_ids(accelerator), **ddp_kw)
                self.raw_gc_opt = torch.optim.AdamW(self.raw_gc_ddp.parameters(), lr=cfg.learning_rate)
                self.prof_raw_gc = CommProfiler(accelerator, self.raw_gc_ddp, hook=self.hook, keep_records=None)
        # with --gradient_checkpointing_ab every model counts its blocks' forwards (twice per micro-batch with checkpointing)
        self.forwards = {id(m): BlockForwards(m) for m in (self.acc_model, self.raw_ddp, self.gc_model, self.raw_gc_ddp)
                         if ab and m is not None}
        self.manual_opt = self.prof_manual = None
        if self.manual_model is not None:  # one plain copy for both manual modes (weights and AdamW state reset every run)
            self.manual_opt = torch.optim.AdamW(self.manual_model.parameters(), lr=cfg.learning_rate)
            self.prof_manual = CommProfiler(accelerator, self.manual_model, distributed=True, keep_records=None)

        # Data: the K-th dataloader holds exactly (warm-up + measured) x K micro-batches per process.
        self.run_steps = cfg.warmup_steps + cfg.steps
        B, K_max = cfg.per_device_train_batch_size, max(cfg.accumulation_steps)
        tokens, labels = synthetic_rows(cfg, self.run_steps * K_max * world * B)
        self.loaders = {}
        for K in cfg.accumulation_steps:
            n_batches = self.run_steps * K * world
            rows = TokenRows(tokens[: n_batches * B], labels[: n_batches * B])
            self.loaders[K] = {
                "rows": rows,
                "toolkit": accelerator.prepare(DataLoader(rows, batch_size=B, shuffle=False)),
                "raw": DataLoader(rows, batch_sampler=raw_batch_indices(n_batches, B, rank, world)),
            }
        fused = any(is_fused(m) for m in cfg.modes)
        # A/B (checkpointing, the loss): each peak from the memory in use
        self.memory = (TrimmedPeakMemory if ab or fused else PeakMemory)(device)
        self.info = {"config": PRESETS[preset], "parameters": n_params, "gradient_bytes": grad_bytes,
                     "all_parameters": count_parameters(model, trainable_only=False), "adapter": cfg.adapter_info(),
                     "micro_batch": f"{B}x{cfg.block_size} tokens", "memory_method": self.memory.method,
                     "ddp_kwargs": ddp_kw, "comm_hook": cfg.comm_hook,
                     # targets per micro-batch over all processes, averaged over the data of the largest K
                     "targets_per_micro_batch": float((labels[:, 1:] != -100).sum()) / (self.run_steps * K_max),
                     "fused_loss_prediction": predicted_loss_memory(
                         model.config.to_dict(), B, cfg.block_size, compute_element_bytes(accelerator),
                         checkpointing=self.plan.gradient_checkpointing)
                     if fused else None}

    def switch(self, mode: str):
        """Put ``mode`` in force; returns its ``(model, optimizer, profiler)`` (None for ``trainer``, which
        builds its own per run)."""
        if mode == "trainer":
            return None, None, None
        if mode == "raw_ddp":
            return self.raw_ddp, self.raw_opt, self.prof_raw
        if mode == twin_name("raw_ddp"):
            return self.raw_gc_ddp, self.raw_gc_opt, self.prof_raw_gc
        if mode in MANUAL_MODES:
            return self.manual_model, self.manual_opt, self.prof_manual
        base = mode.removesuffix(GC_SUFFIX)
        self.plan.use_policy("sync_each_batch" if base == "sync_each_batch" else "no_sync")
        return (self.gc_model, self.gc_opt, self.prof_gc) if base != mode else (self.acc_model, self.acc_opt, self.prof_acc)

    def one_run(self, mode: str, K: int, tag: str) -> dict:
        """One run of ``mode`` at ``K`` from the initial weights and AdamW state; its record (tagged ``tag``)."""
        cfg, accelerator, device, loaders = self.cfg, self.accelerator, self.accelerator.device, self.loaders
        model, opt, prof = self.switch(mode)
        forwards = self.forwards.get(id(model))
        mode, twin = mode.removesuffix(GC_SUFFIX), mode  # a twin runs its mode's loop on its checkpointed model
        if prof is not None:
            reset_training_state(model, self.initial, opt)
            prof.enabled = True  # the previous run's on_train_end switched it off
            prof.mode = "sync_each_batch" if mode == "sync_each_batch" else "no_sync"  # others sync once per window
            callbacks = [prof, TagWindows(prof, cfg.warmup_steps, tag)]
        else:
            reset_weights(self.peer_model, self.initial)  # run_trainer makes a fresh AdamW
        gc.collect()
        dist.barrier()
        self.memory.reset()
        if forwards is not None:
            forwards.take()
        t0 = time.perf_counter()
        if mode == "trainer":
            from .peers import run_trainer

            losses, prof = run_trainer(self.peer_model, loaders[K]["rows"], cfg, K, self.run_steps, accelerator,
                                       self.hook, lambda p: [p, TagWindows(p, cfg.warmup_steps, tag)])
        elif mode == "accelerate_guide":
            from .peers import train_accelerate_guide

            losses = train_accelerate_guide(accelerator, model, opt, self.acc_sched, loaders[K]["toolkit"], K, callbacks)
        elif mode == "raw_ddp":
            losses = train_raw_ddp(model, opt, iter(loaders[K]["raw"]), K, self.run_steps, device, callbacks=callbacks)
        elif mode in MANUAL_MODES:
            sync, record = MANUAL_MODES[mode], prof.record_allreduce
            losses = train_raw_ddp(model, opt, iter(loaders[K]["raw"]), K, self.run_steps, device, callbacks=callbacks,
                                   average_gradients=lambda params: sync(params, on_call=record))
        else:  # the kit's modes: the logits' loss (raw DDP's formula), the fused modes train_loop's default
            losses = run_toolkit(accelerator, model, opt, loaders[K]["toolkit"], K, self.run_steps, callbacks,
                                 loss_fn=loss_fn(mode))
        wall = time.perf_counter() - t0
        peak, increase = gathered_peaks(self.memory, device)
        counted = {} if forwards is None else {"block_forwards": forwards.take(), "blocks": forwards.blocks,
                                               "micro_batches_run": self.run_steps * K}
        return {"preset": self.preset, "K": K, "mode": twin, "wall_seconds": wall, "losses": losses,
                "load_average_1min": load_average(), "peak_rss_mb": peak, "peak_increase_mb": increase,
                **counted, **run_record(prof, tag)}

    def warm_up(self) -> None:
        """One unrecorded run per mode: a fresh model's first steps pay page faults and allocator growth that
        the per-run warm-up step does not fully absorb. (The guide's loop last: it shares the toolkit's DDP
        model, whose first run primes a static graph.)"""
        for mode in sorted(DDPBench().arms(self.cfg), key=lambda m: m == "accelerate_guide"):
            self.one_run(mode, self.cfg.accumulation_steps[0], f"preset_warmup/{mode}")

    def run_block(self, K: int, repeat: int, order: list[str]) -> list[dict]:
        """One run of every mode at ``K``, in ``order``."""
        return [self.one_run(mode, K, f"{mode}/K{K}/r{repeat}") for mode in order]

    def close(self) -> dict:
        """Put ``no_sync`` back in force, drop the preset's models, optimizers and dataloaders; returns the info."""
        self.plan.use_policy("no_sync")
        for counter in self.forwards.values():
            counter.remove()
        for name in ("acc_model", "acc_opt", "acc_sched", "raw_ddp", "raw_opt", "prof_acc", "prof_raw", "loaders",
                     "peer_model", "manual_model", "manual_opt", "prof_manual", "gc_model", "gc_opt", "raw_gc_ddp",
                     "raw_gc_opt", "prof_gc", "prof_raw_gc", "forwards"):
            setattr(self, name, None)
        self.accelerator.free_memory()  # drops the prepared model, optimizer and dataloaders of this preset
        return self.info
