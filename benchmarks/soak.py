"""Soak: a long run of the accumulation loop, to see that nothing accum-kit keeps grows with the step count.

Run it (2 processes; ``cpu_fsdp.yaml`` for FSDP2)::

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml benchmarks/soak.py \\
        --steps 20000 --output_dir runs/soak_ddp

The run: the ``tiny`` GPT-2 preset, random byte sequences of ``--block``
tokens, one per micro-batch, K = ``--K``, ``accum_kit.train_loop`` with a
``CommProfiler`` (``--no_profiler`` leaves it out), a ``TrackerLogger`` to
tensorboard (``--no_tracker``), a checkpoint every ``--checkpoint_every``
steps, ``--checkpoints_total_limit`` kept. Every ``--sample_every`` steps
rank 0 records its resident set (``VmRSS``), the size of the newest
checkpoint's ``loop_state.json`` and the profiler's raw records kept.

Printed and written to ``<output_dir>/soak.json`` (rank 0):

- RSS growth after ``--warmup_steps``: least-squares slope of the samples,
  MB per 1,000 and per 10,000 steps;
- step time of the last block of ``--block_steps`` steps over the first
  block after step 1 (start-up), in wall seconds and in rank 0's CPU
  seconds (the one to read when other jobs share the machine): the block
  is cut into 10 parts, the median step of each part of the last block over
  that of the same part of the first gives 10 ratios, summarised by their geometric mean and a 95 %
  t-interval on the logs (:func:`accum_kit.stats.ratio_interval`);
- the median step time of every block and their least-squares trend, % of
  the first block per 10,000 steps with a 95 % interval (``step_time_trend``);
- checkpoint save seconds and bytes (first and last save), ``loop_state.json``
  bytes over the run; the profiler's records kept and calls counted.

Only the library's public API is used, so the same script measures another
checkout of accum-kit put first on ``PYTHONPATH`` (``soak.json`` says which).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import accum_kit
from accum_kit.core.checkpoint import Checkpointer, latest_checkpoint
from accum_kit.errors import UsageError
from accum_kit.profiler.held_memory import proc_status_kb
from accum_kit.job.models import build_model
from accum_kit.profiler import CommProfiler
from accum_kit.stats import ratio_interval, t_quantile
from accum_kit.job.tracking import TrackerLogger


def parse_args(argv) -> argparse.Namespace:
    """The flags; raises UsageError for a value that cannot work."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20000, help="optimizer steps")
    p.add_argument("--K", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--block", type=int, default=8, help="tokens per micro-batch")
    p.add_argument("--examples", type=int, default=512, help="examples per epoch (the run goes over them many times)")
    p.add_argument("--checkpoint_every", type=int, default=1000)
    p.add_argument("--checkpoints_total_limit", type=int, default=2)
    p.add_argument("--sample_every", type=int, default=1000, help="steps between RSS samples")
    p.add_argument("--warmup_steps", type=int, default=None, help="steps left out of the RSS slope (default: steps / 10)")
    p.add_argument("--block_steps", type=int, default=1000, help="steps in the first and last block compared")
    p.add_argument("--keep_records", type=int, default=None, help="the profiler's raw records kept (default: its own)")
    p.add_argument("--no_profiler", action="store_true")
    p.add_argument("--no_tracker", action="store_true")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for flag in ("steps", "K", "block", "examples", "checkpoint_every", "checkpoints_total_limit", "sample_every",
                 "block_steps"):
        if getattr(a, flag) < 1:
            raise UsageError(f"--{flag}", f"must be >= 1 (got {getattr(a, flag)})", "pass a positive integer")
    if 2 * a.block_steps > a.steps or a.block_steps < 10:
        raise UsageError("--block_steps", f"{a.block_steps} does not fit twice in --steps {a.steps} (or is below 10)",
                         "pass at least 10 and at most half of --steps")
    a.warmup_steps = a.steps // 10 if a.warmup_steps is None else a.warmup_steps
    return a


class Sampler(accum_kit.LoopCallback):
    """Every ``every`` steps: VmRSS (MB), the newest checkpoint's loop_state.json bytes, the profiler's records kept."""

    def __init__(self, every: int, ckpt_dir: Path, profiler):
        self.every, self.ckpt_dir, self.profiler, self.samples = every, ckpt_dir, profiler, []

    def on_step_end(self, state):
        if state.step % self.every:
            return
        latest = latest_checkpoint(self.ckpt_dir)  # the save of this step comes after the callbacks
        records = self.profiler.records() if self.profiler is not None else None
        self.samples.append({
            "step": state.step, "rss_mb": proc_status_kb("VmRSS") / 1024,
            "loop_state_bytes": (latest / "loop_state.json").stat().st_size if latest else None,
            "records_kept": None if records is None else {k: len(getattr(records, k)) for k in
                                                          ("calls", "micro_batches", "steps", "collectives")}})


class StepCPU(accum_kit.LoopCallback):
    """This process's CPU seconds (all threads) per optimizer step: less moved by other jobs than wall time."""

    def __init__(self):
        self.last, self.seconds = time.process_time(), []

    def on_step_end(self, state):
        now = time.process_time()
        self.seconds.append(now - self.last)
        self.last = now


def slope_per_step(points) -> float | None:
    """Least-squares slope of ``[(x, y), ...]``; None with fewer than 2 points."""
    if len(points) < 2:
        return None
    mx, my = statistics.fmean(p[0] for p in points), statistics.fmean(p[1] for p in points)
    sxx = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx else None


def step_time_ratio(step_seconds: list, block: int) -> dict:
    """Last ``block`` steps over the first ``block`` after step 1: 10 part-median ratios, geometric mean, 95 % CI."""
    first, last = step_seconds[1:1 + block], step_seconds[-block:]
    n = block // 10
    ratios = [statistics.median(last[i * n:(i + 1) * n]) / statistics.median(first[i * n:(i + 1) * n]) for i in range(10)]
    out = ratio_interval(ratios)
    out.update(first_median_s=statistics.median(first), last_median_s=statistics.median(last))
    return out


def block_trend(step_seconds: list, block: int) -> dict | None:
    """Median step time of each block of ``block`` steps (the last ending at the run's end), and their trend.

    ``block_median_ms``: one median per whole block; ``percent_per_10000_steps``: the fitted slope over
    those medians, in % of the first block's median per 10,000 steps, with its 95 % t-interval
    (``low``, ``high``; the textbook slope standard error, ``s / sqrt(Sxx)`` with n - 2 degrees of
    freedom). A slow machine-wide drift moves single blocks by more than a real trend over the run
    would; the slope over every block shows a trend the first and last blocks alone cannot. None
    with fewer than 3 blocks.
    """
    n = (len(step_seconds) - 1) // block
    start = len(step_seconds) - n * block  # whole blocks, the last ending at the last step, step 1 left out
    medians = [statistics.median(step_seconds[start + i * block:start + (i + 1) * block]) * 1e3 for i in range(n)]
    if len(medians) < 3:
        return None
    xs = [(i + 0.5) * block for i in range(len(medians))]
    b = slope_per_step(list(zip(xs, medians)))
    mx, my = statistics.fmean(xs), statistics.fmean(medians)
    resid = [y - (my + b * (x - mx)) for x, y in zip(xs, medians)]
    sxx = sum((x - mx) ** 2 for x in xs)
    se = (sum(r * r for r in resid) / (len(xs) - 2) / sxx) ** 0.5
    t = t_quantile(0.975, len(xs) - 2)
    scale = 1e4 * 100 / medians[0]
    return {"block_steps": block, "block_median_ms": medians, "percent_per_10000_steps": b * scale,
            "low": (b - t * se) * scale, "high": (b + t * se) * scale}


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.output_dir)
    tracking = {} if args.no_tracker else dict(log_with="tensorboard", project_dir=str(out))
    accelerator = accum_kit.build_accelerator(args.K, **tracking)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = build_model("tiny", vocab_size=256, n_positions=args.block, seed=args.seed)
    ids = torch.randint(0, 256, (args.examples, args.block), generator=torch.Generator().manual_seed(args.seed))
    data = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]
    loader = DataLoader(data, batch_size=1, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    profiler = None
    if not args.no_profiler:
        kw = {} if args.keep_records is None else {"keep_records": args.keep_records}
        profiler = CommProfiler(accelerator, model, **kw)
    callbacks = []
    if not args.no_tracker:
        accelerator.init_trackers("soak")
        callbacks.append(TrackerLogger(accelerator, optimizer, profiler))
    sampler, cpu = Sampler(args.sample_every, out / "checkpoints", profiler), StepCPU()
    ckpt = Checkpointer(accelerator, out / "checkpoints", args.checkpoint_every, args.checkpoints_total_limit, signals=())
    result = accum_kit.train_loop(accelerator, model, optimizer, loader, max_train_steps=args.steps,
                                  callbacks=[cpu, sampler, *callbacks], profiler=profiler, checkpointer=ckpt, progress=False)
    comm = profiler.summary() if profiler is not None else None  # collective
    accelerator.end_training()
    if not accelerator.is_main_process:
        return 0
    after = [(s["step"], s["rss_mb"]) for s in sampler.samples if s["step"] >= args.warmup_steps]
    slope = slope_per_step(after)
    report = {
        "accum_kit": str(Path(accum_kit.__file__).parent), "argv": sys.argv[1:], "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type), "steps": result.optimizer_steps, "epochs": result.epochs,
        "rss_mb_per_1000_steps": None if slope is None else slope * 1000,
        "rss_mb_per_10000_steps": None if slope is None else slope * 10000,
        "step_time_last_over_first": step_time_ratio(result.step_seconds, args.block_steps),
        "step_cpu_last_over_first": step_time_ratio(cpu.seconds, args.block_steps),
        "step_time_trend": block_trend(result.step_seconds, args.block_steps),
        "checkpoint_saves": ckpt.timings, "samples": sampler.samples,
        "profiler_calls_counted": None if comm is None else {
            k: comm.get(k) for k in ("allreduce_calls", "all_gather_calls", "reduce_scatter_calls", "micro_batches",
                                     "optimizer_steps")},
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    r, saves = report["step_time_last_over_first"], ckpt.timings
    print(f"soak: {report['steps']} steps, {report['distributed_type']}, {report['world_size']} processes, "
          f"profiler {'off' if profiler is None else 'on'}, accum_kit from {report['accum_kit']}")
    print(f"  RSS after step {args.warmup_steps}: {report['rss_mb_per_10000_steps']:.2f} MB per 10,000 steps "
          f"({len(after)} samples, {after[0][1]:.1f} -> {after[-1][1]:.1f} MB)")
    print(f"  step time, last {args.block_steps} over first: {r['geometric_mean']:.3f} [{r['low']:.3f}, {r['high']:.3f}] "
          f"({r['first_median_s'] * 1e3:.2f} -> {r['last_median_s'] * 1e3:.2f} ms)")
    trend = report["step_time_trend"]
    if trend is not None:
        print(f"  step time trend over {len(trend['block_median_ms'])} blocks: {trend['percent_per_10000_steps']:+.2f} % "
              f"per 10,000 steps [{trend['low']:+.2f}, {trend['high']:+.2f}] of the first block's median")
    c = report["step_cpu_last_over_first"]
    print(f"  step CPU time (rank 0), last over first: {c['geometric_mean']:.3f} [{c['low']:.3f}, {c['high']:.3f}] "
          f"({c['first_median_s'] * 1e3:.2f} -> {c['last_median_s'] * 1e3:.2f} ms)")
    if saves:
        print(f"  checkpoint save: first {saves[0]['seconds']:.3f} s {saves[0]['bytes']} B, last {saves[-1]['seconds']:.3f} s "
              f"{saves[-1]['bytes']} B; loop_state.json {sampler.samples[1]['loop_state_bytes'] if len(sampler.samples) > 1 else None}"
              f" -> {sampler.samples[-1]['loop_state_bytes']} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
