"""``accum-kit bench --tune``: DDP's constructor settings, each on its own model copy, timed side by side.

Every setting gets a fresh copy of the preset's model wrapped in
``torch.nn.parallel.DistributedDataParallel`` with the constructor arguments
of Accelerate's ``DistributedDataParallelKwargs(**setting).to_kwargs()``, as
``Accelerator.prepare`` builds it (DDP allows one wrapper per module, so the
settings cannot share one), its own AdamW and a
:class:`accum_kit.profiler.CommProfiler`. All of them run the toolkit's loop
(:func:`accum_kit.train_loop`, ``no_sync``) at one K on the same data from the
same weights, in the sweep's interleaved schedule: after one unrecorded run per
setting, every repeat runs each setting once, in an order rotated by one from
repeat to repeat. The runs are recorded like the sweep's (the setting's label
stands in the ``mode`` field), so :mod:`accum_kit.bench.tune_report` pairs
them the same way.
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

from ..compat import set_sync_each_batch
from ..job.models import PRESETS, build_model, count_parameters
from ..profiler import CommProfiler
from ..stats import median
from .config import BenchConfig
from .data import TokenRows, synthetic_tokens, variable_target_labels
from .memory import PeakMemory
from .records import TagWindows, run_record
from .runs import comm_hook, load_average, reset_training_state, run_toolkit

#: The label of the settings every other one is compared with (the bench's own DDP flags).
BASE = "base"


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


def tune_preset(cfg: BenchConfig, preset: str, accelerator, bar) -> tuple[dict, list[dict]]:
    """Every run of ``--tune`` for one preset; returns ``(info, runs)`` shaped like the sweep's."""
    world, device = accelerator.num_processes, accelerator.device
    (K,) = cfg.accumulation_steps
    model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
    initial = [p.detach().clone().to(device) for p in model.parameters()]
    settings = tune_settings(cfg)
    dev_ids = [device.index if device.index is not None else accelerator.local_process_index] if device.type == "cuda" else None
    hook = comm_hook(cfg.comm_hook)
    built = {}
    for label, kwargs in settings:
        ddp = DistributedDataParallel(copy.deepcopy(model).to(device), device_ids=dev_ids,
                                      **DistributedDataParallelKwargs(**kwargs).to_kwargs())
        built[label] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=cfg.learning_rate),
                        CommProfiler(accelerator, ddp, hook=hook, keep_records=None))
    run_steps = cfg.warmup_steps + cfg.steps
    B = cfg.per_device_train_batch_size
    tokens = synthetic_tokens(run_steps * K * world * B, cfg.block_size, cfg.vocab_size, cfg.seed + 1)
    labels = variable_target_labels(tokens, cfg.seed + 2) if cfg.variable_targets else tokens
    loader = accelerator.prepare(DataLoader(TokenRows(tokens, labels), batch_size=B, shuffle=False))
    set_sync_each_batch(accelerator, False)
    memory = PeakMemory(device)
    info = {"config": PRESETS[preset], "parameters": count_parameters(model),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
            "micro_batch": f"{B}x{cfg.block_size} tokens", "memory_method": memory.method, "K": K,
            "comm_hook": cfg.comm_hook, "settings": {label: kwargs for label, kwargs in settings}}

    def one_run(label: str, tag: str) -> dict:
        ddp, opt, prof = built[label]
        reset_training_state(ddp, initial, opt)
        prof.enabled, prof.mode = True, "no_sync"
        gc.collect()
        dist.barrier()
        memory.reset()
        t0 = time.perf_counter()
        losses = run_toolkit(accelerator, ddp, opt, loader, K, run_steps, [prof, TagWindows(prof, cfg.warmup_steps, tag)])
        wall = time.perf_counter() - t0
        peak, increase = memory.peak()
        mem = torch.tensor([-1.0 if peak is None else peak, -1.0 if increase is None else increase],
                           dtype=torch.float64, device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        return {"preset": preset, "K": K, "mode": label, "ddp_kwargs": dict(ddp_kwargs_of(settings, label)),
                "wall_seconds": wall, "losses": losses, "load_average_1min": load_average(),
                "peak_rss_mb": None if peak is None else mem[0].item(),
                "peak_increase_mb": None if increase is None else mem[1].item(), **run_record(prof, tag)}

    gc.collect()
    gc.freeze()
    labels_ = [label for label, _ in settings]
    for label in labels_:  # first steps of a fresh DDP wrapper rebuild its buckets: not measured
        one_run(label, f"preset_warmup/{label}")
    runs = []
    for rep in range(cfg.repeats):
        shift = rep % len(labels_)
        for position, label in enumerate(labels_[shift:] + labels_[:shift]):
            rec = one_run(label, f"{label}/K{K}/r{rep}")
            rec.update(repeat=rep, position=position)
            runs.append(rec)
            bar.set_postfix_str(f"{preset} K={K} {label}: {median(rec['step_seconds']):.3f} s/step")
            bar.update(1)
    del built, loader, model
    accelerator.free_memory()
    gc.unfreeze()
    gc.collect()
    return info, runs


def ddp_kwargs_of(settings: list[tuple[str, dict]], label: str) -> dict:
    """The constructor kwargs of the setting called ``label``."""
    return next(kwargs for name, kwargs in settings if name == label)
