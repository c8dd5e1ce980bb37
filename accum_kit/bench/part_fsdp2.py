"""The FSDP2 part of ``accum-kit bench`` (HSDP: FSDP2 on a 2-D mesh): the accumulation policies x K in one run.

Run it with::

    accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml -m accum_kit bench \\
        --model_presets small --accumulation_steps 2 4 8 --repeats 5

Arms: ``--accumulation_policies`` (default: the four of :data:`accum_kit.engines.policies.POLICIES` that
apply to FSDP2; under HSDP all five), on one prepared model (one ``fully_shard`` per layer, per the config), each
with the loss from the logits (the formula of the DDP part's references); ``<policy>_fused`` (opt-in, e.g.
``no_sync_fused``) runs ``<policy>`` with ``train_loop``'s default fused loss in the same rotation
(:class:`accum_kit.bench.loss_axis.SwitchedLoss` changes the loss between windows), compared with ``<policy>``
window by window: step time and the memory saved against the prediction (:mod:`.report_loss`).

Schedule: for each repeat and K, one :func:`accum_kit.train_loop` run from the same initial weights and
AdamW state, whose windows rotate through the policies (:class:`PolicyRotation`): ``--warmup_steps``
unmeasured windows, then ``--steps`` cycles of one window per policy, the order rotated by one from one
(repeat, K) run to the next. Between windows the policy is switched (:func:`apply_policy`): the run plan
puts it in force (:meth:`accum_kit.core.run_plan.RunPlan.use_policy`: Accelerate's ``sync_each_batch``
switch, and the policy FSDP2's engine applies inside ``no_sync``), and every unit's reshard-after-forward
setting follows it through :mod:`accum_kit.compat` (off for ``no_sync_no_reshard``, FSDP2's own
otherwise: ``fully_shard`` fixes it when the model is prepared, and only a sweep that changes policy in
the middle of a run needs to change it). Parameters do not change inside a window and every policy gives
the same update, so this is one ordinary training run. Comparing policies in adjacent windows, seconds
apart, rather than in runs minutes apart, keeps a shared machine's changing load out of the ratios. One
unrecorded run comes first (a fresh model's first steps pay page faults). A
:class:`accum_kit.profiler.CommProfiler` records every all-gather and reduce-scatter, a
:class:`accum_kit.profiler.held_memory.HeldMemory` the bytes held between micro-batches per policy, and the
process's peak memory is taken per window.

The figures are :func:`accum_kit.bench.report_fsdp2.summarize_fsdp_preset`'s; data and timing conventions
are the DDP part's (:mod:`accum_kit.bench`): synthetic tokens, step times from process 0, memory the
maximum over processes.
"""

from __future__ import annotations

import copy
import gc
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..compat import (fsdp_reshard_after_forward_state, fsdp_units, keep_fsdp_parameters_after_forward,
                      restore_fsdp_reshard_after_forward)
from ..core.callbacks import LoopCallback
from ..core.loop import train_loop
from ..core.run_plan import run_plan_of
from ..engines.fsdp2 import element_bytes, sharded_model
from ..engines.mesh import EmulatedInterNodeLink, launched_replicas
from ..engines.policies import POLICIES
from ..job.models import build_model, count_parameters
from ..profiler import CommProfiler, ProfileRecords, sharded_summary
from ..profiler.held_memory import HeldMemory
from .bench_config import MODES
from .bench_data import TokenRows, synthetic_rows
from .bench_files import plot_policies_png
from .report_fsdp2 import FSDP_CSV_FIELDS, evaluate_targets, summarize_fsdp_preset
from .bench_tables import format_fsdp_table, format_loss_axis_table, format_targets
from .loss_axis import SwitchedLoss, compute_element_bytes, is_fused, logits_arm, predicted_loss_memory
from .report_loss import fused_axis_row, fused_axis_targets
from .bench_report import paired_differences
from .checkpointing_ab import BlockForwards, TrimmedPeakMemory, checkpointed_prepare, twin_name
from .report_checkpointing import checkpointing_rows, format_checkpointing_table
from .parts import WindowedPart
from .peak_memory import PeakMemory
from .runs import reset_training_state
from .saving_parts import window_parts

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


class FSDP2Bench(WindowedPart):
    """The accumulation policies under FSDP2 / HSDP (see the module docstring)."""

    name = "fsdp2"
    measures_adapters = True
    schema = "accum_kit.bench.fsdp/1"
    progress = "bench runs (FSDP2)"
    arm_key = "policy"
    needs = "the FSDP2 bench needs"
    csv_fields = FSDP_CSV_FIELDS
    collects = ("rows", "fused_loss")
    plot = staticmethod(plot_policies_png)
    figures = staticmethod(summarize_fsdp_preset)
    table = staticmethod(format_fsdp_table)
    targets = staticmethod(evaluate_targets)

    def hybrid(self) -> bool:
        return launched_replicas() > 1

    def check_flags(self, cfg, policies_given: bool) -> None:
        """Refuse DDP's flags (``--tune``, ``--comm_hook``, the constructor settings), DDP's ``--modes``,
        ``--torch_compile`` and ``--zero_stages``: under FSDP2 the bench compares accumulation policies.

        Raises:
            UsageError: naming the flag.
        """
        self.refuse(self.ddp_only_flags(cfg), "is a DDP setting; under an FSDP2 config the bench compares "
                    "accumulation policies", "drop {flag}, or launch with accelerate_configs/cpu_ddp.yaml")
        self.refuse([("--modes", list(cfg.modes) != list(MODES))], "chooses DDP loops; under an FSDP2 config the "
                    "bench compares accumulation policies", "drop --modes and pass --accumulation_policies")
        self.refuse([("--torch_compile", cfg.torch_compile)], "compares compiled with eager under DDP, and this "
                    "launch is sharded", "launch with accelerate_configs/cpu_ddp.yaml")
        self.refuse_stages(cfg)

    def config_file(self) -> tuple[str, int]:
        return ("cpu_hsdp.yaml", 4) if self.hybrid() else ("cpu_fsdp.yaml", 2)

    def arms(self, cfg) -> list:
        return list(cfg.accumulation_policies)

    def twin_arms(self, cfg) -> list:
        """Every policy: with ``--gradient_checkpointing_ab`` a second, checkpointed model runs the same rotation
        (its fused arms' windows too, not reported)."""
        return [p for p in cfg.accumulation_policies if not is_fused(p)]

    def session(self, cfg, preset: str, accelerator) -> "FSDP2Session":
        return FSDP2Session(cfg, preset, accelerator)

    def summarize(self, preset, info, runs, cfg, world) -> dict:
        """The policies' figures (:func:`summarize_fsdp_preset`, on the runs without checkpointing and with the
        logits), the loss axis (:func:`fsdp_loss_axis`), and with ``--gradient_checkpointing_ab`` the preset's
        ``checkpointing`` rows (:mod:`.report_checkpointing`)."""
        policies = self.twin_arms(cfg)
        base = copy.copy(cfg)
        base.accumulation_policies = policies
        figures = summarize_fsdp_preset(preset, info, [r for r in runs if r["policy"] in policies], base, world)
        figures["fused_loss"] = fsdp_loss_axis(preset, info, runs, cfg)
        if cfg.gradient_checkpointing_ab:
            figures["checkpointing"] = checkpointing_rows(preset, runs, "policy", policies, cfg.accumulation_steps)
        return figures

    def format_preset(self, preset, info, collected, cfg) -> str:
        text = format_fsdp_table(preset, info, collected["rows"])
        if "checkpointing" in info:
            text += "\n" + format_checkpointing_table(preset, info["checkpointing"])
        if collected["fused_loss"]:
            text += "\n" + format_loss_axis_table(preset, collected["fused_loss"])
        return text

    def result(self, cfg, presets, collected, runs, world):
        """The policies' result and targets, with the loss axis's rows and verdicts added."""
        body, _ = super().result(cfg, presets, collected, runs, world)
        axis = [r for c in collected.values() for r in c["fused_loss"]]
        body["fused_loss"] = axis
        body["targets"] += fused_axis_targets(axis)
        return body, format_targets(body["targets"])


def fsdp_loss_axis(preset: str, info: dict, runs: list[dict], cfg) -> list[dict]:
    """Every ``<policy>_fused`` of ``--accumulation_policies`` against ``<policy>``, per K
    (:func:`accum_kit.bench.report_loss.fused_axis_row`): step time paired per (repeat, cycle) of windows, the memory
    saved as the logits window's peak minus the fused window's (the most over processes), against the memory
    model's prediction. The first losses are not compared: the two arms' windows hold different data."""
    out = []
    predicted = (info.get("fused_loss_prediction") or {}).get("saved_mb")
    for policy in (p for p in cfg.accumulation_policies if is_fused(p)):
        for K in cfg.accumulation_steps:
            fused = [r for r in runs if r["K"] == K and r["policy"] == policy]
            logits = [r for r in runs if r["K"] == K and r["policy"] == logits_arm(policy)]
            out.append(fused_axis_row(preset, K, policy, logits_arm(policy), fused, logits,
                                      paired_differences(logits, fused, "window_peak_mb"), predicted,
                                      f"the window's peak ({info['memory_method']}), the most over processes, "
                                      "paired per (repeat, cycle)", compare_losses=False))
    return out


def apply_policy(accelerator, model, policy: str, fsdp_defaults: list) -> None:
    """Make the next window run ``policy`` on the prepared FSDP2 ``model`` (call between windows only).

    The run plan puts the policy in force; every unit's reshard-after-forward setting is put back to
    ``fsdp_defaults`` (:func:`accum_kit.compat.fsdp_reshard_after_forward_state`, taken after the model's
    first forward, when FSDP2 has settled its root) and switched off where the policy keeps parameters
    gathered through the window.
    """
    run_plan_of(accelerator).use_policy(policy)
    restore_fsdp_reshard_after_forward(fsdp_defaults)
    if POLICIES[policy].reshard_after_forward is False:
        keep_fsdp_parameters_after_forward(model)


class PolicyRotation(LoopCallback):
    """Loop callback: the run's windows rotate through the policies, one window each, so that they are compared
    seconds apart (a shared machine's load changes on that scale too).

    The first ``warmup`` windows run ``policies[0]`` and are tagged ``warmup/<label>``; then window ``w`` runs
    ``policies[(w - warmup) % n]`` (cycle ``(w - warmup) // n``), tagged ``<policy>/<label>``. The policy is applied
    between windows (in ``on_step_end``, after the profiler has recorded the step), and the process's peak memory
    is taken per window (:class:`accum_kit.bench.peak_memory.PeakMemory`).

    Attributes:
        windows: per measured window: ``step`` (its index), ``policy``, ``cycle``, ``peak_mb``.
    """

    def __init__(self, accelerator, model, profiler, policies: list[str], warmup: int, label: str, defaults: list,
                 memory: PeakMemory, loss: SwitchedLoss | None = None):
        self.accelerator, self.model, self.profiler, self.policies = accelerator, model, profiler, policies
        self.warmup, self.label, self.defaults, self.memory, self.loss = warmup, label, defaults, memory, loss
        self.windows: list[dict] = []

    def tag(self, policy: str) -> str:
        return f"{policy}/{self.label}"

    def _policy(self, w: int) -> str:
        return self.policies[0] if w < self.warmup else self.policies[(w - self.warmup) % len(self.policies)]

    def _start(self, w: int) -> None:
        policy = self._policy(w)
        apply_policy(self.accelerator, self.model, logits_arm(policy), self.defaults)
        if self.loss is not None:  # a fused arm: its policy with train_loop's default loss
            self.loss.fused = is_fused(policy)
        self.profiler.mode = MODE[logits_arm(policy)]
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


def pooled_summaries(prof, cfg, order: list[str]) -> dict:
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


class FSDP2Session:
    """The runs of one preset under FSDP2: one prepared model, its profiler (and, under the emulation, the
    slow link), the data of every K."""

    def __init__(self, cfg, preset: str, accelerator):
        self.cfg, self.preset, self.accelerator = cfg, preset, accelerator
        world, device = accelerator.num_processes, accelerator.device
        model = cfg.build_model(preset)  # with --use_peft: a PeftModel, every weight frozen but the adapters
        self.n_params = count_parameters(model)
        self.n_all = count_parameters(model, trainable_only=False)
        self.fused_prediction = (predicted_loss_memory(model.config.to_dict(), cfg.per_device_train_batch_size,
                                                       cfg.block_size, element_bytes=compute_element_bytes(accelerator))
                                 if any(is_fused(p) for p in cfg.accumulation_policies) else None)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
        self.model, self.opt = accelerator.prepare(model, opt)
        self.initial = [p.detach().clone() for p in self.model.parameters()]  # DTensor shards
        self.link = (EmulatedInterNodeLink(self.model, cfg.emulate_inter_node_GBps).install()
                     if cfg.emulate_inter_node_GBps is not None else None)  # before the profiler: its timings include it
        self.prof = CommProfiler(accelerator, self.model, keep_records=None)  # short runs: every raw record

        self.order = list(cfg.accumulation_policies)
        self.loss = SwitchedLoss()  # the logits' formula, or the fused loss in a fused arm's windows
        self.run_steps = cfg.warmup_steps + cfg.steps * len(self.order)
        B, K_max = cfg.per_device_train_batch_size, max(cfg.accumulation_steps)
        tokens, labels = synthetic_rows(cfg, self.run_steps * K_max * world * B)
        self.loaders = {}
        for K in cfg.accumulation_steps:
            n = self.run_steps * K * world * B
            self.loaders[K] = accelerator.prepare(DataLoader(TokenRows(tokens[:n], labels[:n]), batch_size=B,
                                                             shuffle=False))
        self.memory = PeakMemory(device)
        with torch.no_grad():  # FSDP2 settles its root's reshard setting at the first forward: save them after it
            self.model(input_ids=tokens[:1].to(device))
        for unit, _ in fsdp_units(self.model):  # without a backward the units kept after forward stay gathered
            unit.reshard()
        self.defaults = fsdp_reshard_after_forward_state(self.model)
        self.layout = sharded_model(self.model)  # read with FSDP2's own settings in force
        self.twin = self._twin(cfg, preset, tokens[:1].to(device)) if cfg.gradient_checkpointing_ab else None
        self.forwards = {id(m.model): BlockForwards(m.model) for m in (self, self.twin) if self.twin is not None}
        if self.twin is not None:  # A/B: each window's peak from the memory in use, not what the last one left resident
            self.memory = TrimmedPeakMemory(device)

    def _twin(self, cfg, preset: str, first_input):
        """``--gradient_checkpointing_ab``: the same model prepared with activation checkpointing (Accelerate's
        FSDP2 wrapper), its optimizer, profiler and reshard settings; its runs start from :attr:`initial` too."""
        accelerator = self.accelerator
        model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
        with checkpointed_prepare(accelerator):
            model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate))
        link = (EmulatedInterNodeLink(model, cfg.emulate_inter_node_GBps).install()
                if cfg.emulate_inter_node_GBps is not None else None)
        prof = CommProfiler(accelerator, model, keep_records=None)
        with torch.no_grad():
            model(input_ids=first_input)
        for unit, _ in fsdp_units(model):
            unit.reshard()
        return SimpleNamespace(model=model, opt=opt, prof=prof, link=link,
                               defaults=fsdp_reshard_after_forward_state(model))

    def one_run(self, K: int, rep, policies: list[str], twin: bool = False) -> list[dict]:
        """One train_loop whose windows rotate through ``policies``; one record per policy, in that order.
        ``twin``: on the checkpointed model (``--gradient_checkpointing_ab``), its records named ``<policy>+gc``."""
        m = self.twin if twin else self
        accelerator, prof, device = self.accelerator, m.prof, self.accelerator.device
        reset_training_state(m.model, self.initial, m.opt)
        prof.enabled = True  # the previous run's on_train_end switched it off
        held = HeldMemory(accelerator, m.model)
        rotation = PolicyRotation(accelerator, m.model, prof, policies, self.cfg.warmup_steps, f"K{K}/r{rep}",
                                  m.defaults, self.memory, self.loss)
        run_plan_of(accelerator).set_accumulation_steps(K)
        forwards = self.forwards.get(id(m.model))
        gc.collect()
        dist.barrier()
        if forwards is not None:
            forwards.take()
        t0 = time.perf_counter()
        result = train_loop(accelerator, m.model, m.opt, self.loaders[K], max_train_steps=self.run_steps,
                            progress=False, profiler=prof, callbacks=[rotation, held], loss_fn=self.loss)
        wall = time.perf_counter() - t0
        counted = {} if forwards is None else {"block_forwards": forwards.take() / len(policies),
                                               "blocks": forwards.blocks, "micro_batches_run": self.run_steps * K / len(policies)}
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
            prof.mode = MODE[logits_arm(policy)]  # the profiler summarises the records of its current mode
            s = prof.local_summary(tag)
            mine = [(w, pk) for w, pk in zip(rotation.windows, peaks) if w["policy"] == policy]
            steps = {x.step: x for x in prof.records(tag=tag).steps}
            records.append({
                "preset": self.preset, "K": K, "policy": twin_name(policy) if twin else policy, "run_wall_seconds": wall,
                **counted,
                "losses": result.train_loss, "cycles": [w["cycle"] for w, _ in mine],
                "step_seconds": [steps[w["step"]].step_seconds for w, _ in mine], "optimizer_steps": len(mine),
                "step_cpu_seconds": [steps[w["step"]].cpu_seconds for w, _ in mine],
                "peak_rss_mb": max((pk for _, pk in mine), default=None) if self.memory.method else None,
                "window_peak_mb": [pk if pk >= 0 and self.memory.method else None for _, pk in mine],
                "gradient_bytes": mem[i, 0].item(), "gathered_parameter_bytes": mem[i, 1].item(),
                **{k: s.get(k) for k in SUMMARY_KEYS}})
        return records

    def warm_up(self) -> None:
        """One unrecorded run: a fresh model's first steps are slow."""
        self.one_run(self.cfg.accumulation_steps[0], "preset_warmup", self.order)
        if self.twin is not None:
            self.one_run(self.cfg.accumulation_steps[0], "preset_warmup", self.order, twin=True)
        self.element_bytes = element_bytes(self.accelerator, self.model)

    def run_block(self, K: int, repeat: int, order: list[str]) -> list[dict]:
        """One run at ``K`` whose windows rotate through ``order``; with ``--gradient_checkpointing_ab`` then
        (or first: every other block) the same on the checkpointed model."""
        if self.twin is None:
            return self.one_run(K, repeat, order)
        twin_first = (repeat + self.cfg.accumulation_steps.index(K)) % 2 == 1
        return [r for twin in (twin_first, not twin_first) for r in self.one_run(K, repeat, order, twin)]

    def close(self) -> dict:
        """Put ``no_sync`` and FSDP2's reshard settings back, remove the emulated link, detach the profiler;
        returns the info (the pooled profiler figures, the mesh, the units, the element sizes)."""
        cfg, prof, link = self.cfg, self.prof, self.link
        b_p, b_c, b_r = self.element_bytes
        apply_policy(self.accelerator, self.model, "no_sync", self.defaults)
        if link is not None:
            link.remove()
        prof.detach()
        if self.twin is not None:
            apply_policy(self.accelerator, self.twin.model, "no_sync", self.twin.defaults)
            if self.twin.link is not None:
                self.twin.link.remove()
            self.twin.prof.detach()
        for counter in self.forwards.values():
            counter.remove()
        info = {"pooled": pooled_summaries(prof, cfg, self.order), "parameters": self.n_params,
                "all_parameters": self.n_all, "adapter": cfg.adapter_info(),
                "micro_batch": f"{cfg.per_device_train_batch_size}x{cfg.block_size} tokens",
                "memory_method": self.memory.method,
                "mesh": {"dp_replicate_size": prof.replicate_size, "dp_shard_size": prof.shard_size},
                "emulated_inter_node_GBps": cfg.emulate_inter_node_GBps,
                "emulated_seconds_added": link.seconds_added if link is not None else 0.0,
                "units": {"resharded": list(self.layout.resharded), "kept": list(self.layout.kept),
                          # trainable elements per unit (resharded then kept; None: every parameter trains)
                          "trainable": None if self.layout.trainable is None else list(self.layout.trainable)},
                "element_bytes": {"b_p": b_p, "b_c": b_c, "b_r": b_r},
                "fused_loss_prediction": self.fused_prediction}
        self.model = self.opt = self.loaders = self.prof = self.twin = self.forwards = None
        self.accelerator.free_memory()
        return info
