"""The ``--tune`` part of ``accum-kit bench``: DDP's constructor settings, each on its own model copy, timed side by side.

Arms: the settings (:func:`tune_settings`): the bench's own DDP flags (the base), then each bucket size of
``--tune_bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph`` and ``find_unused_parameters``
changed one at a time. Every setting gets a fresh copy of the preset's model wrapped in
``torch.nn.parallel.DistributedDataParallel`` with the constructor arguments of Accelerate's
``DistributedDataParallelKwargs(**setting).to_kwargs()``, as ``Accelerator.prepare`` builds it (DDP allows
one wrapper per module, so the settings cannot share one), its own AdamW and a
:class:`accum_kit.profiler.CommProfiler`; switching between them is picking that copy. All of them run the
toolkit's loop (:func:`accum_kit.train_loop`, ``no_sync``) at one K on the same data from the same weights,
in the sweep's rotated schedule: after one unrecorded run per setting, every repeat runs each setting once,
in an order rotated by one from repeat to repeat. The runs are recorded like the DDP modes' (the setting's
label stands in the ``mode`` field), so :func:`accum_kit.bench.report_tune.summarize_tune` pairs them the
same way; ``tune.json`` and ``tune.csv`` are written instead of the bench's files.
"""

from __future__ import annotations

import copy
import gc
import time

import torch
import torch.distributed as dist
from accelerate.utils import DistributedDataParallelKwargs
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ..core.run_plan import run_plan_of
from ..job.models import PRESETS, build_model, count_parameters
from ..profiler import CommProfiler
from .bench_config import BenchConfig
from .bench_data import TokenRows, synthetic_rows
from .report_tune import TUNE_BASE, TUNE_CSV_FIELDS, recommend, summarize_tune
from .bench_tables import format_tune_table
from .parts import BenchPart
from .peak_memory import PeakMemory
from .run_records import TagWindows, run_record
from .runs import comm_hook, device_ids, gathered_peaks, load_average, reset_training_state, run_toolkit

#: The label of the settings every other one is compared with (the bench's own DDP flags).
BASE = TUNE_BASE


def tune_settings(cfg: BenchConfig) -> list[tuple[str, dict]]:
    """``[(label, DDP constructor kwargs), ...]``: the base (the bench's DDP flags), then one change at a time.

    The changes: each ``--tune_bucket_cap_mb`` size other than the base's,
    then ``gradient_as_bucket_view``, ``static_graph`` and
    ``find_unused_parameters`` turned on where the base has them off.
    """
    base = cfg.ddp_kwargs()
    settings = [(BASE, base)]
    for mb in cfg.tune_bucket_cap_mb:
        if mb != base.get("bucket_cap_mb", 25):
            settings.append((f"bucket_cap_mb={mb:g}", {**base, "bucket_cap_mb": mb}))
    for flag in ("gradient_as_bucket_view", "static_graph", "find_unused_parameters"):
        if not base.get(flag):
            settings.append((flag, {**base, flag: True}))
    return settings


def ddp_kwargs_of(settings: list[tuple[str, dict]], label: str) -> dict:
    """The constructor kwargs of the setting called ``label``."""
    return next(kwargs for name, kwargs in settings if name == label)


class TuneBench(BenchPart):
    """``--tune`` (see the module docstring): DDP's settings at one K, one model copy each."""

    name = "tune"
    schema = "accum_kit.bench.tune/1"
    collects = ("rows", "recommendation")
    stem = "tune"
    csv_fields = TUNE_CSV_FIELDS

    def arms(self, cfg) -> list:
        return [label for label, _ in tune_settings(cfg)]

    def session(self, cfg, preset: str, accelerator) -> "TuneSession":
        return TuneSession(cfg, preset, accelerator)

    def summarize(self, preset, info, runs, cfg, world) -> dict:
        rows = summarize_tune(preset, runs, info["settings"])
        return {"rows": rows, "recommendation": recommend(rows)}

    def format_preset(self, preset, info, collected, cfg) -> str:
        return format_tune_table(preset, info, collected["rows"], collected["recommendation"])

    def result(self, cfg, presets, collected, runs, world):
        rows = [r for c in collected.values() for r in c["rows"]]
        recommendations = {preset: c["recommendation"] for preset, c in collected.items()}
        return {"presets": presets, "rows": rows, "recommendations": recommendations, "runs": runs}, None



class TuneSession:
    """The runs of one preset under ``--tune``: one DDP copy, AdamW and profiler per setting, one dataloader."""

    def __init__(self, cfg: BenchConfig, preset: str, accelerator):
        self.cfg, self.preset, self.accelerator = cfg, preset, accelerator
        world, device = accelerator.num_processes, accelerator.device
        (self.K,) = cfg.accumulation_steps
        model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
        if run_plan_of(accelerator).gradient_checkpointing:  # every arm's copy checkpoints, not only the prepared one
            model = run_plan_of(accelerator).engine.apply_activation_checkpointing(accelerator, model)
        self.initial = [p.detach().clone().to(device) for p in model.parameters()]
        self.settings = tune_settings(cfg)
        hook = comm_hook(cfg.comm_hook)
        self.built = {}
        for label, kwargs in self.settings:
            ddp = DistributedDataParallel(copy.deepcopy(model).to(device), device_ids=device_ids(accelerator),
                                          **DistributedDataParallelKwargs(**kwargs).to_kwargs())
            self.built[label] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=cfg.learning_rate),
                                 CommProfiler(accelerator, ddp, hook=hook, keep_records=None))
        self.run_steps = cfg.warmup_steps + cfg.steps
        B = cfg.per_device_train_batch_size
        tokens, labels = synthetic_rows(cfg, self.run_steps * self.K * world * B)
        self.loader = accelerator.prepare(DataLoader(TokenRows(tokens, labels), batch_size=B, shuffle=False))
        run_plan_of(accelerator).use_policy("no_sync")
        self.memory = PeakMemory(device)
        self.info = {"config": PRESETS[preset], "parameters": count_parameters(model),
                     "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
                     "micro_batch": f"{B}x{cfg.block_size} tokens", "memory_method": self.memory.method, "K": self.K,
                     "comm_hook": cfg.comm_hook, "settings": {label: kwargs for label, kwargs in self.settings}}

    def one_run(self, label: str, tag: str) -> dict:
        """One run of the setting ``label`` from the initial weights and AdamW state; its record."""
        ddp, opt, prof = self.built[label]
        reset_training_state(ddp, self.initial, opt)
        prof.enabled, prof.mode = True, "no_sync"
        gc.collect()
        dist.barrier()
        self.memory.reset()
        t0 = time.perf_counter()
        losses = run_toolkit(self.accelerator, ddp, opt, self.loader, self.K, self.run_steps,
                             [prof, TagWindows(prof, self.cfg.warmup_steps, tag)])
        wall = time.perf_counter() - t0
        peak, increase = gathered_peaks(self.memory, self.accelerator.device)
        return {"preset": self.preset, "K": self.K, "mode": label, "ddp_kwargs": dict(ddp_kwargs_of(self.settings, label)),
                "wall_seconds": wall, "losses": losses, "load_average_1min": load_average(),
                "peak_rss_mb": peak, "peak_increase_mb": increase, **run_record(prof, tag)}

    def warm_up(self) -> None:
        """One unrecorded run per setting: the first steps of a fresh DDP wrapper rebuild its buckets."""
        for label, _ in self.settings:
            self.one_run(label, f"preset_warmup/{label}")

    def run_block(self, K: int, repeat: int, order: list[str]) -> list[dict]:
        """One run of every setting, in ``order``."""
        return [self.one_run(label, f"{label}/K{K}/r{repeat}") for label in order]

    def close(self) -> dict:
        """Drop the copies and the dataloader; returns the info."""
        self.built = self.loader = None
        self.accelerator.free_memory()
        return self.info
