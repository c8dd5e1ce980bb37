"""``accum-kit bench --torch_compile``: the compiled ``no_sync`` loop against the eager one, paired.

One Accelerator, one DDP model prepared as the train job prepares it; the
compiled mode calls ``torch.compile`` on that DDP model, as Accelerate's
``prepare`` does with a dynamo plugin (``torch.compile(DDP(model))``), so both
modes run the same weights, optimizer and data through
:func:`accum_kit.train_loop` with ``no_sync``. Before every run the weights
and AdamW state are reset, so the two modes compute the same losses up to
the compiled graph's rounding (``loss_max_abs_diff`` in the output).

Schedule: one compiled window first, whose compiles are timed by
:class:`accum_kit.engines.compiling.CompileWatch` (``compile_seconds``) and which also
serves as the unmeasured warm-up of the compiled mode, one eager window as the
eager mode's warm-up; then for each repeat, for each K, one run per mode in an
order that alternates from one (repeat, K) to the next, each ``--warmup_steps``
unmeasured plus ``--steps`` measured optimizer steps. Per K: the median step of
each mode, the paired ratio compiled / eager with its 95 % interval
(:func:`accum_kit.stats.ratio_interval` over the repeats), the seconds saved
per step (eager median minus compiled median) and the break-even step count,
``compile_seconds / saved`` (None when compiling does not save time: then it
never pays). Recompiles after the first window are counted too (there should
be none: the shapes do not change).

Writes ``compile.json`` to ``--output_dir`` (process 0) and prints a table.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..engines.compiling import CompileWatch, check_backend_available, resolve_flags
from ..errors import UsageError
from ..launch import build_accelerator, launcher_world_size
from ..core.loop import train_loop
from ..job.models import PRESETS, build_model, count_parameters
from ..outputs import atomic_write_json, library_versions
from ..stats import RATIO_INTERVAL_METHOD, median, ratio_interval
from .config import BenchConfig
from .data import TokenRows, synthetic_tokens, variable_target_labels
from .runs import load_average, reset_training_state
from .sweep import command

MODES = ("eager", "compiled")


def _run(accelerator, model, optimizer, loader, K: int, steps: int) -> dict:
    """One run of the no_sync loop: ``{"step_seconds", "losses"}`` for ``steps`` optimizer steps."""
    accelerator.gradient_accumulation_steps = K
    dist.barrier()
    result = train_loop(accelerator, model, optimizer, loader, max_train_steps=steps, progress=False)
    return {"step_seconds": result.step_seconds, "losses": result.train_loss}


def bench_compiled_preset(cfg: BenchConfig, preset: str, accelerator, backend: str, mode: str | None) -> dict:
    """Every run of one preset, and its figures per K (see the module docstring)."""
    world = accelerator.num_processes
    model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
    initial = [p.detach().clone() for p in model.parameters()]
    n_params = count_parameters(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    ddp, opt = accelerator.prepare(model, opt)
    compiled = torch.compile(ddp, backend=backend, mode=mode)
    models = {"eager": ddp, "compiled": compiled}
    run_steps, B = cfg.warmup_steps + cfg.steps, cfg.per_device_train_batch_size
    tokens = synthetic_tokens(run_steps * max(cfg.accumulation_steps) * world * B, cfg.block_size, cfg.vocab_size, cfg.seed + 1)
    labels = variable_target_labels(tokens, cfg.seed + 2) if cfg.variable_targets else tokens
    loaders = {K: accelerator.prepare(DataLoader(TokenRows(tokens[: run_steps * K * world * B],
                                                           labels[: run_steps * K * world * B]), batch_size=B))
               for K in cfg.accumulation_steps}

    def one_run(name: str, K: int, steps: int = run_steps) -> dict:
        reset_training_state(ddp, initial, opt)
        gc.collect()
        t0 = time.perf_counter()
        rec = _run(accelerator, models[name], opt, loaders[K], K, steps)
        return {"preset": preset, "K": K, "mode": name, "wall_seconds": time.perf_counter() - t0,
                "load_average_1min": load_average(), **rec}

    k0 = cfg.accumulation_steps[0]
    watch = CompileWatch()  # not a loop callback here: recompiles after the first window are counted by difference
    first = one_run("compiled", k0, steps=1)  # compiles: forward at the first micro-batch, backward at its backward
    first["compile"] = watch.summary()
    compile_seconds = first["compile"]["compile_seconds"]
    warm = {"eager": one_run("eager", k0, steps=1), "compiled": first}
    runs = []
    for rep in range(cfg.repeats):
        for i, K in enumerate(cfg.accumulation_steps):
            order = MODES if (rep + i) % 2 == 0 else MODES[::-1]
            for position, name in enumerate(order):
                rec = one_run(name, K)
                rec.update(repeat=rep, position=position, measured=rec["step_seconds"][cfg.warmup_steps:])
                runs.append(rec)
    watch_end = watch.summary()
    watch.close()
    per_k = [summarize_k(preset, runs, K, compile_seconds) for K in cfg.accumulation_steps]
    del compiled, models, ddp, opt, loaders, model
    accelerator.free_memory()
    torch._dynamo.reset()
    return {"preset": preset, "parameters": n_params, "config": PRESETS[preset], "compile_seconds": compile_seconds,
            "first_window_seconds": first["wall_seconds"], "compile": first["compile"],
            "recompiles_after_first_window": watch_end["recompiles"] - first["compile"]["recompiles"], "per_k": per_k,
            "warmup_runs": warm, "runs": runs}


def summarize_k(preset: str, runs: list[dict], K: int, compile_seconds: float) -> dict:
    """The figures of one K from its runs (each with ``repeat``, ``mode``, ``measured`` step seconds, ``losses``).

    Returns:
        median step seconds per mode over all measured steps, the paired ratio
        compiled / eager (per repeat: ratio of the two runs' median steps) with
        its 95 % interval, ``seconds_saved_per_step`` (eager minus compiled
        median), ``break_even_steps`` (``compile_seconds`` / saved; None when
        nothing is saved), ``break_even_steps_interval`` (the same at the two
        ends of the ratio's interval, with the eager median; None at an end
        where compiling does not save time: then it may never pay) and the
        largest per-step loss difference.
    """
    by = {(r["repeat"], r["mode"]): r for r in runs if r["K"] == K}
    repeats = sorted({rep for rep, _ in by})
    ratios = [median(by[(rep, "compiled")]["measured"]) / median(by[(rep, "eager")]["measured"]) for rep in repeats]
    med = {m: median([s for r in runs if r["K"] == K and r["mode"] == m for s in r["measured"]]) for m in MODES}
    saved = med["eager"] - med["compiled"]
    diffs = [abs(a - b) for rep in repeats for a, b in zip(by[(rep, "compiled")]["losses"], by[(rep, "eager")]["losses"])]
    ci = ratio_interval(ratios)

    def even(ratio):  # steps to earn the compile back if compiled / eager were ``ratio`` (None: never)
        return compile_seconds / (med["eager"] * (1 - ratio)) if ratio is not None and ratio < 1 else None

    return {"preset": preset, "K": K, "eager_step_seconds": med["eager"], "compiled_step_seconds": med["compiled"],
            "compiled_over_eager": ci, "seconds_saved_per_step": saved,
            "break_even_steps": compile_seconds / saved if saved > 0 else None,
            # from the ratio's interval: (at its low end, at its high end); None at an end where compiling is slower
            "break_even_steps_interval": [even(ci["low"]), even(ci["high"])],
            "loss_max_abs_diff": max(diffs) if diffs else None}


def format_compiled_table(presets: list[dict]) -> str:
    """The per-K figures as text: step times, the paired ratio with its interval, break-even steps."""
    lines = []
    for p in presets:
        lines.append(f"{p['preset']} ({p['parameters'] / 1e6:.2f}M parameters): compile {p['compile_seconds']:.1f} s "
                     f"(first window {p['first_window_seconds']:.1f} s), {p['compile']['graphs']} graphs, "
                     f"recompiles after the first window: {p['recompiles_after_first_window']}")
        lines.append(f"{'K':>3} {'eager s/step':>13} {'compiled s/step':>16} {'compiled/eager [95% CI]':>28} "
                     f"{'saved s/step':>13} {'break-even steps [95% CI]':>26}")
        for r in p["per_k"]:
            ci = r["compiled_over_eager"]
            interval = (f"{ci['geometric_mean']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}]" if ci["low"] is not None
                        else f"{ci['geometric_mean']:.3f} [n/a]")
            lo, hi = r["break_even_steps_interval"]
            even = f"{r['break_even_steps']:.0f}" if r["break_even_steps"] is not None else "never"
            even += f" [{lo:.0f}, {hi:.0f}]" if lo is not None and hi is not None else (
                f" [{lo:.0f}, never]" if lo is not None else "")
            lines.append(f"{r['K']:>3} {r['eager_step_seconds']:>13.4f} {r['compiled_step_seconds']:>16.4f} "
                         f"{interval:>28} {r['seconds_saved_per_step']:>13.4f} {even:>26}")
    return "\n".join(lines)


def run(cfg: BenchConfig) -> dict:
    """Compiled against eager for every preset and K; process 0 writes ``compile.json`` and prints the table.

    Raises:
        UsageError: fewer than 2 processes, or a backend that cannot compile here
            (before any output is written).
    """
    if launcher_world_size() < 2:
        raise UsageError("--num_processes", f"the bench compares DDP runs and needs >= 2 processes (launched: "
                         f"{launcher_world_size()})", "run it under accelerate launch --config_file "
                         "accelerate_configs/cpu_ddp.yaml -m accum_kit bench --torch_compile")
    backend, mode = resolve_flags(cfg.torch_compile, cfg.torch_compile_backend, cfg.torch_compile_mode)
    check_backend_available(backend)
    accelerator = build_accelerator(None, ddp_kwargs=cfg.ddp_kwargs())
    t0, load_start = time.perf_counter(), os.getloadavg()
    presets = [bench_compiled_preset(cfg, p, accelerator, backend, mode) for p in cfg.model_presets]
    result = {"schema": "accum_kit.bench.compile/1", "command": command(cfg, accelerator.num_processes), "config": asdict(cfg),
              "backend": backend, "mode": mode or "default", "world_size": accelerator.num_processes,
              "versions": library_versions(), "interval_method": RATIO_INTERVAL_METHOD,
              "timing": {"total_seconds": time.perf_counter() - t0, "load_average_start": list(load_start),
                         "load_average_end": list(os.getloadavg())},
              "presets": presets}
    if accelerator.is_main_process:
        os.makedirs(cfg.output_dir, exist_ok=True)
        atomic_write_json(os.path.join(cfg.output_dir, "compile.json"), result)
        print(format_compiled_table(presets))
        print(f"wrote {os.path.join(cfg.output_dir, 'compile.json')} ({result['timing']['total_seconds']:.0f} s)")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result
