"""The ``--torch_compile`` mode of ``accum-kit bench``: the compiled ``no_sync`` loop against the eager one, paired.

One Accelerator, one DDP model prepared as the train job prepares it (on one
process, the prepared model itself: no DDP wrapper); the
compiled arm calls ``torch.compile`` on that model, as Accelerate's
``prepare`` does with a dynamo plugin (``torch.compile(DDP(model))``), so both
arms run the same weights, optimizer and data through
:func:`accum_kit.train_loop` with ``no_sync``; switching between them is picking
the model object. Before every run the weights and AdamW state are reset, so
the two arms compute the same losses up to the compiled graph's rounding
(``loss_max_abs_diff`` in the output).

Schedule: one compiled window first, whose compiles are timed by
:class:`accum_kit.engines.compiling.CompileWatch` (``compile_seconds``) and which also
serves as the unmeasured warm-up of the compiled arm, one eager window as the
eager arm's warm-up; then the sweep's blocks: for each repeat, for each K, one run per arm in an
order that alternates from one (repeat, K) to the next, each ``--warmup_steps``
unmeasured plus ``--steps`` measured optimizer steps. Per K
(:func:`accum_kit.bench.report_compiled.summarize_k`): the median step of
each arm, the paired ratio compiled / eager with its 95 % interval
(:func:`accum_kit.stats.ratio_interval` over the repeats), the seconds saved
per step (eager median minus compiled median) and the break-even step count,
``compile_seconds / saved`` (None when compiling does not save time: then it
never pays). Recompiles after the first window are counted too (there should
be none: the shapes do not change).

Writes ``compile.json`` to ``--output_dir`` (process 0) and prints a table.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..core.loop import train_loop
from ..core.run_plan import run_plan_of
from ..engines.compiling import CompileWatch, check_backend_available, resolve_flags
from ..job.models import PRESETS, build_model, count_parameters
from .bench_data import TokenRows, synthetic_rows
from .report_compiled import COMPILE_MODES, summarize_k
from .bench_tables import format_compiled_table
from .parts import BenchPart
from .runs import load_average, reset_training_state

MODES = COMPILE_MODES


class CompiledBench(BenchPart):
    """``--torch_compile`` (see the module docstring): eager and compiled at every K, one ``compile.json``."""

    name = "compile"
    schema = "accum_kit.bench.compile/1"
    collects = ()
    stem = "compile"
    needs = "the bench compares DDP runs and needs"
    fix_suffix = " --torch_compile"

    def __init__(self):
        self.backend, self.mode = None, None

    def check_launch(self, cfg) -> None:
        """Refuse a backend that cannot compile here, before anything is built. One process is allowed (no DDP
        wrapper there: the compiled model is the prepared model itself, the one-GPU case).

        Raises:
            UsageError: ``--torch_compile_backend``.
        """
        self.backend, self.mode = resolve_flags(cfg.torch_compile, cfg.torch_compile_backend, cfg.torch_compile_mode)
        check_backend_available(self.backend)

    def arms(self, cfg) -> list:
        return list(COMPILE_MODES)

    def shift(self, repeat: int, k_index: int, block: int) -> int:
        """Eager first, then compiled first, alternating over (repeat, K)."""
        return repeat + k_index

    def session(self, cfg, preset: str, accelerator) -> "CompiledSession":
        return CompiledSession(cfg, preset, accelerator, self.backend, self.mode)

    def summarize(self, preset, info, runs, cfg, world) -> dict:
        return {"per_k": [summarize_k(preset, runs, K, info["compile_seconds"]) for K in cfg.accumulation_steps],
                "runs": runs}

    def format_preset(self, preset, info, collected, cfg) -> str:
        return format_compiled_table([info])

    def result(self, cfg, presets, collected, runs, world):
        return {"backend": self.backend, "mode": self.mode or "default", "world_size": world,
                "presets": list(presets.values())}, None



class CompiledSession:
    """The runs of one preset: the prepared DDP model, its compiled wrapper, the data of every K."""

    def __init__(self, cfg, preset: str, accelerator, backend: str, mode: str | None):
        self.cfg, self.preset, self.accelerator = cfg, preset, accelerator
        world = accelerator.num_processes
        model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
        self.initial = [p.detach().clone() for p in model.parameters()]
        self.n_params = count_parameters(model)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
        self.ddp, self.opt = accelerator.prepare(model, opt)
        self.models = {"eager": self.ddp, "compiled": torch.compile(self.ddp, backend=backend, mode=mode)}
        self.run_steps, B = cfg.warmup_steps + cfg.steps, cfg.per_device_train_batch_size
        tokens, labels = synthetic_rows(cfg, self.run_steps * max(cfg.accumulation_steps) * world * B)
        self.loaders = {K: accelerator.prepare(DataLoader(TokenRows(tokens[: self.run_steps * K * world * B],
                                                                    labels[: self.run_steps * K * world * B]), batch_size=B))
                        for K in cfg.accumulation_steps}
        self.watch = self.info = None

    def one_run(self, name: str, K: int, steps: int | None = None) -> dict:
        """One run of the ``no_sync`` loop on arm ``name``: ``{"step_seconds", "losses"}`` and its wall time."""
        reset_training_state(self.ddp, self.initial, self.opt)
        gc.collect()
        t0 = time.perf_counter()
        run_plan_of(self.accelerator).set_accumulation_steps(K)
        if dist.is_initialized():
            dist.barrier()
        result = train_loop(self.accelerator, self.models[name], self.opt, self.loaders[K],
                            max_train_steps=steps or self.run_steps, progress=False)
        return {"preset": self.preset, "K": K, "mode": name, "wall_seconds": time.perf_counter() - t0,
                "load_average_1min": load_average(), "step_seconds": result.step_seconds, "losses": result.train_loss}

    def warm_up(self) -> None:
        """One compiled window (its compiles timed), one eager window."""
        k0 = self.cfg.accumulation_steps[0]
        self.watch = CompileWatch()  # not a loop callback here: recompiles after the first window counted by difference
        first = self.one_run("compiled", k0, steps=1)  # compiles: forward at the first micro-batch, backward at its backward
        first["compile"] = self.watch.summary()
        warm = {"eager": self.one_run("eager", k0, steps=1), "compiled": first}
        self.info = {"preset": self.preset, "parameters": self.n_params, "config": PRESETS[self.preset],
                     "compile_seconds": first["compile"]["compile_seconds"], "first_window_seconds": first["wall_seconds"],
                     "compile": first["compile"], "warmup_runs": warm}

    def run_block(self, K: int, repeat: int, order: list[str]) -> list[dict]:
        """One run of each arm at ``K``, in ``order``; ``measured``: the steps after ``--warmup_steps``."""
        records = [self.one_run(name, K) for name in order]
        for rec in records:
            rec["measured"] = rec["step_seconds"][self.cfg.warmup_steps:]
        return records

    def close(self) -> dict:
        """Count the recompiles after the first window, drop the models and dynamo's caches; returns the info."""
        watch_end = self.watch.summary()
        self.watch.close()
        self.info["recompiles_after_first_window"] = watch_end["recompiles"] - self.info["compile"]["recompiles"]
        self.models = self.ddp = self.opt = self.loaders = None
        self.accelerator.free_memory()
        torch._dynamo.reset()
        return self.info
