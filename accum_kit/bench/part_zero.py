"""The DeepSpeed part of ``accum-kit bench``: ZeRO stages x K, side by side in one pair of processes.

Run it with::

    accelerate launch --config_file accelerate_configs/cpu_deepspeed.yaml -m accum_kit bench \\
        --model_presets small --accumulation_steps 1 8 --zero_stages 1 2 3 --repeats 3 --steps 3

Arms: ``--zero_stages`` (default 1 2 3), instead of the DDP modes or the FSDP2 policies.

Schedule. ``deepspeed.initialize`` fixes an engine's ZeRO stage and K, so one
engine cannot switch stage between windows as one FSDP2 model switches policy.
Instead, for each K, one engine per stage is built in the same processes
(:func:`accum_kit.compat.prepare_deepspeed_engine`), each from its own copy of
the same initial model (same seed, so the same weights) with its own AdamW,
and all of them are fed the same K micro-batches every window; so this part
runs every repeat of one K before the next K. Every stage
computes the same exact update (tests/test_deepspeed.py: within 1.5e-8 of the
single-process big batch), so the engines' weights stay equal to rounding
and every window of every engine does the same arithmetic on the same
shapes: only what the stage does around it differs. The windows then
rotate across the engines, one :func:`accum_kit.train_loop` window per engine
per cycle. Switching to a stage (:meth:`Engines.use`): ``accelerator.backward``
is re-tied to its engine (:func:`accum_kit.compat.use_deepspeed_engine`) and the
run plan follows it: its engine takes the stage's plugin, the stage is the policy
in force (``zero1``...), K is set through the plan. Per repeat ``--warmup_steps``
unmeasured cycles, then ``--steps`` measured ones, the stage order rotated by
one from one (repeat, K) to the next. A cycle's windows run seconds apart,
so the ratio of two stages' windows in one cycle is paired: the machine's
load, which drifts over minutes, is nearly the same for both; the 95 %
intervals are over those per-cycle pairs
(:func:`accum_kit.bench.report_zero.summarize_zero_preset`). Before the
repeats of a K, one unmeasured window per engine pays a fresh engine's
first-step costs (page faults, bucket allocation).

Recorded per window: step seconds and the process's CPU seconds in the
window (``time.process_time``: the work done, which other jobs' load
barely lengthens; the profiler's, process 0), every
DeepSpeed collective and the time in each engine's gradient reduction path
(:class:`accum_kit.profiler.CommProfiler`, :mod:`accum_kit.profiler.deepspeed_comm`),
the gradient and module parameter bytes held between micro-batches
(:func:`accum_kit.profiler.held_memory.held_bytes`,
:func:`accum_kit.compat.deepspeed_parameter_bytes`; the most over processes)
and the process's peak. Data are the DDP part's synthetic tokens.
"""

from __future__ import annotations

import copy
import gc
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..compat import deepspeed_parameter_bytes, prepare_deepspeed_engine, use_deepspeed_engine
from ..core.callbacks import LoopCallback
from ..core.loop import train_loop
from ..core.run_plan import run_plan_of
from ..engines.deepspeed_config import check_deepspeed_installed, deepspeed_plugin_for
from ..job.models import build_model, count_parameters
from ..profiler import CommProfiler
from ..profiler.held_memory import GRADIENT_KINDS, held_bytes
from .bench_config import MODES
from .bench_data import TokenRows, synthetic_rows
from .report_zero import ZERO_CSV_FIELDS, evaluate_zero_targets, summarize_zero_preset
from .bench_tables import format_zero_table
from .parts import WindowedPart
from .peak_memory import PeakMemory

#: Profiler summary keys a run record keeps (see :func:`accum_kit.profiler.deepspeed_comm.zero_summary`).
SUMMARY_KEYS = ("by_kind", "collective_seconds_per_step", "reduction_seconds_per_step", "reduction_calls_per_step",
                "reduction_path_collectives")


def stage_name(stage: int) -> str:
    """``"zero1"`` ...: the stage's name in records, as the run plan's policy and in :func:`accum_kit.engines.costs.zero_costs`."""
    return f"zero{stage}"


class ZeroBench(WindowedPart):
    """The ZeRO stages under DeepSpeed (see the module docstring)."""

    name = "deepspeed"
    schema = "accum_kit.bench.zero/1"
    progress = "bench runs (DeepSpeed)"
    arm_key = "stage"
    k_outer = True  # one engine per stage and K: every repeat of a K runs on the same engines
    needs = "the DeepSpeed bench needs"
    fix_suffix = " (2 processes)"
    csv_fields = ZERO_CSV_FIELDS
    figures = staticmethod(summarize_zero_preset)
    table = staticmethod(format_zero_table)
    targets = staticmethod(evaluate_zero_targets)

    def check_flags(self, cfg, policies_given: bool) -> None:
        """``--zero_stages``: stages 1-3, each once (default all three); the DDP and FSDP2 choices mean nothing
        here (the stage is the policy) and are refused.

        Raises:
            UsageError: naming the flag.
        """
        from .. import checks

        cfg.zero_stages = [1, 2, 3] if cfg.zero_stages is None else cfg.zero_stages
        checks.distinct_choices("--zero_stages", cfg.zero_stages, [1, 2, 3])
        cfg.zero_stages = sorted(cfg.zero_stages)
        refused = [("--accumulation_policies", policies_given), ("--modes", list(cfg.modes) != list(MODES)),
                   ("--torch_compile", cfg.torch_compile), *self.ddp_only_flags(cfg)]
        self.refuse(refused, "has no meaning under a DeepSpeed config: the bench compares ZeRO stages (the stage "
                    "decides what a window reduces)", "drop {flag} (pick stages with --zero_stages), or launch with "
                    "accelerate_configs/cpu_ddp.yaml or cpu_fsdp.yaml")

    def config_file(self) -> tuple[str, int]:
        return "cpu_deepspeed.yaml", 2

    def check_launch(self, cfg) -> None:
        """Refuse a DeepSpeed bench that cannot run, before anything is built.

        Raises:
            UsageError: ``--use_deepspeed`` (the package is missing: install the extra),
                ``--num_processes`` (fewer than 2: nothing to shard with).
        """
        check_deepspeed_installed()
        super().check_launch(cfg)

    def build_accelerator(self, cfg):
        from ..launch import build_accelerator

        return build_accelerator(max(cfg.accumulation_steps), **cfg.checkpointing())

    def arms(self, cfg) -> list:
        return list(cfg.zero_stages)

    def session(self, cfg, preset: str, accelerator) -> "ZeroSession":
        return ZeroSession(cfg, preset, accelerator)

    def arm_label(self, record: dict) -> str:
        return f"ZeRO-{record['stage']}"


def check_launch() -> None:
    """Refuse a DeepSpeed bench that cannot run, before anything is built (:meth:`ZeroBench.check_launch`).

    Raises:
        UsageError: ``--use_deepspeed`` (the package is missing: install the extra),
            ``--num_processes`` (fewer than 2: nothing to shard with).
    """
    ZeroBench().check_launch(None)


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

    def take(self) -> tuple[int, int, float]:
        """``(gradient bytes, parameter bytes, peak MB or -1)`` since the last take, and start again."""
        out = (self.gradient_bytes, self.parameter_bytes, max((p for p in self.peaks_mb if p is not None), default=-1.0))
        self.gradient_bytes, self.parameter_bytes, self.peaks_mb = 0, 0, []
        return out


def watch_reductions(profiler, engine) -> None:
    """Make ``profiler`` (built on the first engine) time ``engine``'s ZeRO optimizer's reduction path too: one
    profiler records every engine of the sweep. The watching is its DeepSpeed recorder's
    (:meth:`accum_kit.profiler.deepspeed_comm.ZeroRecorder.watch`), held by the profiler's DeepSpeed part
    (``profiler.part.recorder``; before the profiler had parts, ``profiler.zero``)."""
    recorder = profiler.part.recorder if hasattr(profiler, "part") else profiler.zero
    recorder.watch(engine.optimizer)


class Engines:
    """One DeepSpeed engine per ZeRO stage at one K, sharing the Accelerator; :meth:`window` runs one window of one.

    Each engine's model is a deep copy of ``model`` (the same initial weights), built before any
    engine so that ZeRO-3's in-place partitioning touches only its own copy.
    """

    def __init__(self, accelerator, model, cfg, K: int, stages: list[int], rows: TokenRows,
                 profiler_holder: dict):
        self.accelerator, self.K = accelerator, K
        plan = run_plan_of(accelerator)
        copies = {s: copy.deepcopy(model) for s in stages}
        B = cfg.per_device_train_batch_size
        self.built: dict[int, dict] = {}
        self.loader = None
        for s in stages:
            plugin = deepspeed_plugin_for(_plugin(s), gradient_accumulation_steps=K, max_grad_norm=None)
            opt = torch.optim.AdamW(copies[s].parameters(), lr=cfg.learning_rate)
            extra = () if self.loader is not None else (DataLoader(rows, batch_size=B, shuffle=False),)
            plan.engine.use_plugin(plugin)
            plan.set_accumulation_steps(K)
            prepared, wrapper = prepare_deepspeed_engine(accelerator, copies[s], opt, plugin, B, *extra)
            engine, engine_opt = prepared[0], prepared[1]
            if extra:
                self.loader = prepared[2]
            if profiler_holder.get("profiler") is None:
                profiler_holder["profiler"] = CommProfiler(accelerator, engine, keep_records=None)
            watch_reductions(profiler_holder["profiler"], engine)
            self.built[s] = {"plugin": plugin, "wrapper": wrapper, "engine": engine, "optimizer": engine_opt,
                             "memory": EngineMemory(engine, PeakMemory(accelerator.device)),
                             "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
                             "param_groups": len(engine.optimizer.param_groups),
                             # DeepSpeed casts the module to its config's bf16 / fp16: the cost table's b_p
                             "param_bytes": next(engine.module.parameters()).element_size()}
        del copies

    def use(self, stage: int) -> None:
        """Put ``stage``'s engine in force: ``accelerator.backward`` drives it, and the run plan follows it (its
        engine takes the stage's plugin, the stage is the policy in force, K is this one's)."""
        b, acc = self.built[stage], self.accelerator
        use_deepspeed_engine(acc, b["plugin"], b["wrapper"])
        plan = run_plan_of(acc)
        plan.engine.use_plugin(b["plugin"])
        plan.use_policy(stage_name(stage))
        plan.set_accumulation_steps(self.K)

    def window(self, stage: int, profiler, tag: str, measured: bool) -> tuple[float, float, float | None]:
        """One optimizer step (K micro-batches) of the stage's engine; returns its start (``perf_counter``
        seconds), its step seconds and the process's CPU seconds in it (this process)."""
        b = self.built[stage]
        self.use(stage)
        profiler.tag, profiler.enabled = tag, True  # the previous window's on_train_end switched it off
        start = time.perf_counter()
        train_loop(self.accelerator, b["engine"], b["optimizer"], self.loader, max_train_steps=1, progress=False,
                   profiler=profiler, callbacks=[b["memory"]] if measured else [])
        step = profiler.records(tag=tag).steps[-1]
        return start, step.step_seconds, step.cpu_seconds

    def close(self, plugin) -> None:
        """Destroy every engine and forget them in the Accelerator (their memory is freed); ``plugin`` (the
        launch's) is selected again, in Accelerate's state and in the run plan's engine."""
        for b in self.built.values():
            b["engine"].destroy()
        self.built = {}
        use_deepspeed_engine(self.accelerator, plugin, None)
        run_plan_of(self.accelerator).engine.use_plugin(plugin)
        self.accelerator.free_memory()


def _plugin(stage: int):
    """A fresh ``DeepSpeedPlugin`` of ``stage``, the launch's other settings (``ACCELERATE_DEEPSPEED_*``, or its
    DeepSpeed JSON) kept; the stage is written into the config too (a JSON's own stage would win otherwise)."""
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=stage)
    plugin.deepspeed_config.setdefault("zero_optimization", {})["stage"] = stage
    plugin.zero_stage = stage
    return plugin


class ZeroSession:
    """The windows of one preset under DeepSpeed: the engines of the K being run (built when its first block
    comes, destroyed when the next K's does), one profiler watching every engine."""

    def __init__(self, cfg, preset: str, accelerator):
        self.cfg, self.preset, self.accelerator = cfg, preset, accelerator
        self.plan = run_plan_of(accelerator)
        self.launch_plugin, self.launch_policy = self.plan.engine.plugin, self.plan.requested_policy.name
        self.model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
        self.n_params = count_parameters(self.model)
        self.holder: dict = {}
        self.engines, self.K, self.info_k = None, None, None

    def warm_up(self) -> None:
        """Nothing before the first K: each K's engines are warmed up when they are built (:meth:`start`)."""

    def start(self, K: int) -> None:
        """Build the engines of ``K`` (after destroying the previous K's), and run one unmeasured window on each:
        a fresh engine's first window pays page faults and bucket allocation."""
        self.finish()
        cfg, world = self.cfg, self.accelerator.num_processes
        n = K * world * cfg.per_device_train_batch_size  # one window: every engine gets the same K micro-batches
        tokens, labels = synthetic_rows(cfg, n)
        self.engines, self.K = Engines(self.accelerator, self.model, cfg, K, list(cfg.zero_stages),
                                       TokenRows(tokens, labels), self.holder), K
        gc.collect()
        for s in cfg.zero_stages:
            self.engines.window(s, self.holder["profiler"], f"warmup/K{K}", measured=False)

    def finish(self) -> None:
        """Destroy the engines of the K being run (their sizes kept for the info); put the launch's plugin and
        policy back."""
        if self.engines is None:
            return
        self.info_k = {s: {k: b[k] for k in ("parameters", "param_groups", "param_bytes")}
                       for s, b in self.engines.built.items()}
        self.engines.close(self.launch_plugin)
        self.plan.use_policy(self.launch_policy)
        self.engines = None
        gc.collect()

    def run_block(self, K: int, repeat: int, order: list[int]) -> list[dict]:
        """``--warmup_steps`` + ``--steps`` cycles of one window per stage, in ``order``; one record per stage."""
        if K != self.K:
            self.start(K)
        cfg, prof = self.cfg, self.holder["profiler"]
        seconds: dict[int, list] = {s: [] for s in order}
        cycles: dict[int, list] = {s: [] for s in order}
        starts: dict[int, list] = {s: [] for s in order}
        cpu: dict[int, list] = {s: [] for s in order}
        dist.barrier()
        for c in range(cfg.warmup_steps + cfg.steps):
            for s in order:
                measured = c >= cfg.warmup_steps
                tag = f"{stage_name(s)}/K{K}/r{repeat}" if measured else f"warmup/K{K}/r{repeat}"
                t0, t, c_s = self.engines.window(s, prof, tag, measured)
                if measured:
                    cpu[s].append(c_s)
                    seconds[s].append(t)
                    starts[s].append(t0)
                    cycles[s].append(c - cfg.warmup_steps)
        return self._records(K, repeat, order, seconds, cpu, cycles, starts)

    def _records(self, K, repeat, order, seconds, cpu, cycles, starts) -> list[dict]:
        """One record per stage of one repeat: step seconds per cycle, profiler figures, memory (max over processes)."""
        built, prof = self.engines.built, self.holder["profiler"]
        mem = torch.tensor([built[s]["memory"].take() for s in order], dtype=torch.float64,
                           device=self.accelerator.device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # memory: the most over processes
        out = []
        for i, s in enumerate(order):
            summary = prof.local_summary(f"{stage_name(s)}/K{K}/r{repeat}")
            out.append({"preset": self.preset, "K": K, "stage": s, "cycles": cycles[s], "window_starts": starts[s],
                        "step_seconds": seconds[s], "cpu_seconds": cpu[s], "optimizer_steps": len(seconds[s]),
                        "gradient_bytes": mem[i, 0].item(), "parameter_bytes": mem[i, 1].item(),
                        "peak_rss_mb": mem[i, 2].item() if mem[i, 2] >= 0 else None,
                        **{k: summary.get(k) for k in SUMMARY_KEYS}})
        return out

    def close(self) -> dict:
        """Destroy the last K's engines, detach the profiler; returns the info."""
        self.finish()
        self.holder["profiler"].detach()
        stages = list(self.cfg.zero_stages)
        return {"parameters": self.n_params, "engine_parameters": self.info_k[stages[0]]["parameters"],
                "param_groups": self.info_k[stages[0]]["param_groups"],
                "param_bytes": self.info_k[stages[0]]["param_bytes"],
                "micro_batch": f"{self.cfg.per_device_train_batch_size}x{self.cfg.block_size} tokens",
                "memory_method": PeakMemory(self.accelerator.device).method}
