"""``accum-kit bench``: what ``no_sync`` accumulation buys, measured side by side.

Run it with::

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m accum_kit bench

It sweeps the gradient accumulation steps K (``--accumulation_steps``, default
1 2 4 8 16) over three modes, on the same model, data and seed:

- ``sync_each_batch``: :func:`accum_kit.train_loop` with Accelerate's
  ``sync_each_batch`` flag on, so every micro-batch's backward all-reduces
  (what a loop that forgets ``no_sync`` costs);
- ``no_sync``: :func:`accum_kit.train_loop` as shipped (all-reduce on the
  window's last micro-batch only);
- ``raw_ddp``: the loop a user writes without Accelerate, on a fresh copy of
  the model wrapped in plain ``torch.nn.parallel.DistributedDataParallel``
  with the same DDP settings, toggling ``model.require_backward_grad_sync =
  (micro == K - 1)`` as nanoGPT does, with the same loss arithmetic (summed
  token loss, gradients scaled by ``world_size / N`` once per window after
  one all-reduce of the window's token count) and the same data.

``sync_each_batch`` and ``no_sync`` share one prepared model (the flag is
flipped between runs, as :class:`accum_kit.profiler.ABSwitch` does); before
every run the weights and the AdamW state are reset to the same initial
values, so the three modes compute the same losses (the JSON records them and
the largest difference between modes).

Schedule: for each preset, one unrecorded run of every mode (a fresh model's
first steps pay page faults and allocator growth), then for each repeat, for
each K, the modes in an order rotated by one from one (repeat, K) to the
next; each run is ``--warmup_steps`` optimizer steps that are not measured,
then ``--steps`` measured ones. Medians, min / max and quartiles are over all
measured steps of all repeats. Timings come from process 0 (the processes
meet at every all-reduce, so their step times agree); memory is the maximum
over processes.

Every mode carries the same instrumentation: a
:class:`accum_kit.profiler.CommProfiler` on its DDP model (a comm hook around
the default all-reduce or the ``--comm_hook`` compression hook, counting and
timing every gradient bucket) and the same phase timers around forward,
backward and the optimizer step.

Data are synthetic: uniformly random token ids (``--vocab_size``, default 384,
the size of the byte tokenizer the train job uses), every position a target,
fixed micro-batches of ``--per_device_train_batch_size`` x ``--block_size``
tokens. Timing does not depend on the token values.

Derived figures (per preset; seconds):

- ``c``: compute per micro-batch = median forward + backward of the no-sync
  micro-batches of the ``no_sync`` mode (all K >= 2, all repeats);
- ``a``: exposed all-reduce per synchronised backward = median backward of
  ``sync_each_batch`` micro-batches minus median backward of ``no_sync``'s
  no-sync micro-batches (0 if negative);
- ideal ``no_sync`` step time ``K c + a``, ideal ``sync_each_batch`` step time
  ``K c + K a``, ideal speedup ``(K c + K a) / (K c + a)``; the measured
  speedup is ``sync_each_batch`` / ``no_sync`` step time, also shown as a
  fraction of the ideal. Ratios of two modes (this one and ``no_sync`` /
  ``raw_ddp``) are paired: the median over repeats of the ratio of the two
  runs' median steps within one (repeat, K) block, which ran back to back
  (the ratio of the pooled medians is in the JSON too);
- ``overhead``: measured ``no_sync`` step minus ``K c + a`` (optimizer step,
  gradient rescale, the token-count all-reduce, data loading); the ideal
  speedup with it added to both sides is ``ideal_speedup_with_overhead``;
- ``other``: per step, the time outside the timed phases (forward,
  backward, optimizer step incl. rescale and token-count all-reduce):
  fetching batches and the loop's own code. It is where the toolkit's loop
  could cost more than the raw loop, measured directly rather than as the
  difference of two whole steps, which the machine's noise can swamp;
- exposed communication share of a mode: syncs per step x ``a`` / its step time;
  all-reduce busy share: time with a gradient all-reduce in flight (first
  bucket handed over to last bucket done, overlapped or not) / step time.

Peak memory per run: on CPU the process's resident set high-water mark
(``VmHWM`` in ``/proc/self/status``), reset before each run by writing 5 to
``/proc/self/clear_refs``; on CUDA ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats`` (that path is written but was only run on CPU).

Bars, printed PASS / FAIL (measured in this one run, never in unit tests):
the communication-heavy preset at K=8 must give ``no_sync`` a speedup of at
least 1.25x over ``sync_each_batch`` and at least 90 % of the ideal speedup;
``no_sync`` / ``raw_ddp`` step time at most 1.03 at every K; peak memory at
K=16 at most 1.05x that at K=1.

Outputs in ``--output_dir`` (default ``runs/bench``), each written atomically:
``bench.json`` (everything, including every run), ``bench.csv`` (one row per
preset x K x mode) and ``bench.png`` (step time against K per mode with the
ideal, and the share of time spent in communication).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

from .cli import ArgumentParser, parse_args
from .errors import AccumKitError, UsageError
from .models import PRESETS
from .bench_report import (
    MODES, _median, evaluate_bars, format_bars, format_preset_table, format_profile, summarize_preset, write_outputs,
)
from .outputs import check_output_dir, library_versions

COMM_HOOKS = ("none", "fp16", "bf16")
DEFAULT_PRESETS = ("comm_heavy", "small")
DEFAULT_KS = (1, 2, 4, 8, 16)

@dataclass
class BenchConfig:
    """Settings of ``accum-kit bench`` (see ``--help``)."""

    accumulation_steps: list = field(default_factory=lambda: list(DEFAULT_KS))
    modes: list = field(default_factory=lambda: list(MODES))
    model_presets: list = field(default_factory=lambda: list(DEFAULT_PRESETS))
    per_device_train_batch_size: int = 1
    block_size: int = 64
    vocab_size: int = 384
    steps: int = 2
    warmup_steps: int = 1
    repeats: int = 3
    learning_rate: float = 1e-4
    seed: int = 42
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: str = "none"
    output_dir: str = "runs/bench"

    def validate(self) -> None:
        """Raise :class:`UsageError` naming the flag of the first bad value; writes nothing."""
        ks = self.accumulation_steps
        if not ks:
            raise UsageError("--accumulation_steps", "no value given", "pass one or more integers, e.g. 1 2 4 8 16")
        for k in ks:
            if k < 1:
                raise UsageError("--accumulation_steps", f"must be >= 1 (got {k})", "pass positive integers, e.g. 1 2 4 8 16")
        if len(set(ks)) != len(ks):
            raise UsageError("--accumulation_steps", f"repeated value in {ks}", "give each K once")
        _check_names("--modes", self.modes, MODES)
        _check_names("--model_presets", self.model_presets, tuple(PRESETS))
        positive = {"--steps": self.steps, "--repeats": self.repeats,
                    "--per_device_train_batch_size": self.per_device_train_batch_size}
        for flag, value in positive.items():
            if value < 1:
                raise UsageError(flag, f"must be >= 1 (got {value})", "pass a positive integer")
        if self.warmup_steps < 0:
            raise UsageError("--warmup_steps", f"must be >= 0 (got {self.warmup_steps})", "pass 0 or a positive integer")
        if self.block_size < 2:
            raise UsageError("--block_size", f"must be >= 2 (got {self.block_size})", "pass at least 2 tokens (one target)")
        if self.vocab_size < 2:
            raise UsageError("--vocab_size", f"must be >= 2 (got {self.vocab_size})", "pass a positive vocabulary size")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise UsageError("--bucket_cap_mb", f"must be > 0 (got {self.bucket_cap_mb})", "pass a size in MB, e.g. 25 (DDP's default)")
        if self.comm_hook not in COMM_HOOKS:
            raise UsageError("--comm_hook", f"unknown value {self.comm_hook!r}", f"use one of {list(COMM_HOOKS)}")
        if not self.learning_rate > 0:
            raise UsageError("--learning_rate", f"must be > 0 (got {self.learning_rate})", "pass a positive float")
        check_output_dir(self.output_dir)

    def ddp_kwargs(self) -> dict:
        """The DDP constructor arguments that differ from DDP's defaults (same for every mode)."""
        out = {}
        if self.bucket_cap_mb is not None:
            out["bucket_cap_mb"] = self.bucket_cap_mb
        if self.gradient_as_bucket_view:
            out["gradient_as_bucket_view"] = True
        if self.static_graph:
            out["static_graph"] = True
        return out


def _check_names(flag: str, given: list, allowed: tuple) -> None:
    if not given:
        raise UsageError(flag, "no value given", f"pass one or more of {list(allowed)}")
    for name in given:
        if name not in allowed:
            raise UsageError(flag, f"unknown value {name!r}", f"use one or more of {list(allowed)}")
    if len(set(given)) != len(given):
        raise UsageError(flag, f"repeated value in {given}", "give each value once")


# --------------------------------------------------------------------------- command line


def build_parser(prog: str = "accum-kit bench") -> ArgumentParser:
    """The argparse parser of ``accum-kit bench``."""
    d = BenchConfig()
    p = ArgumentParser(prog=prog, description=(
        "Step time, communication and peak memory of sync_each_batch, no_sync (accum_kit.train_loop) and a "
        "hand-written raw DDP loop over gradient accumulation steps K, side by side, with the ideal no_sync "
        "speedup. Run under: accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m accum_kit bench"))
    p.add_argument("--accumulation_steps", type=int, nargs="+", default=d.accumulation_steps, metavar="K",
                   help="gradient accumulation steps to sweep (default: 1 2 4 8 16)")
    p.add_argument("--modes", nargs="+", default=d.modes, metavar="MODE", help=f"modes to run (default: {' '.join(MODES)})")
    p.add_argument("--model_presets", nargs="+", default=d.model_presets, metavar="PRESET",
                   help=f"model presets, one of {sorted(PRESETS)} each (default: {' '.join(DEFAULT_PRESETS)})")
    p.add_argument("--per_device_train_batch_size", type=int, default=d.per_device_train_batch_size,
                   help="examples per micro-batch per process (default 1)")
    p.add_argument("--block_size", type=int, default=d.block_size, help="tokens per example (default 64)")
    p.add_argument("--vocab_size", type=int, default=d.vocab_size,
                   help="vocabulary of the synthetic token ids (default 384, the train job's byte tokenizer)")
    p.add_argument("--steps", type=int, default=d.steps, help="measured optimizer steps per run (default 2)")
    p.add_argument("--warmup_steps", type=int, default=d.warmup_steps,
                   help="optimizer steps before measuring, per run (default 1)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="passes over every K and mode, interleaved (default 3)")
    p.add_argument("--learning_rate", type=float, default=d.learning_rate, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the model weights and the data (default 42)")
    p.add_argument("--bucket_cap_mb", type=float, default=None, help="DDP gradient bucket size, MB (default: DDP's 25)")
    p.add_argument("--gradient_as_bucket_view", action="store_true", help="DDP gradient_as_bucket_view=True")
    p.add_argument("--static_graph", action="store_true", help="DDP static_graph=True")
    p.add_argument("--comm_hook", default=d.comm_hook, metavar="{none,fp16,bf16}",
                   help="DDP communication hook: none (plain all-reduce), fp16 or bf16 compression")
    p.add_argument("--output_dir", default=d.output_dir, help="where bench.json, bench.csv, bench.png go (default runs/bench)")
    return p


def parse_bench_args(argv: list[str] | None = None) -> BenchConfig | None:
    """Parse and validate; None after printing an argparse error; raises :class:`UsageError` for bad values."""
    args = parse_args(build_parser(), argv)
    if args is None:
        return None
    cfg = BenchConfig(**vars(args))
    cfg.validate()
    cfg.accumulation_steps = sorted(cfg.accumulation_steps)
    return cfg


# --------------------------------------------------------------------------- peak memory


def _proc_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory of one run: VmHWM after a clear_refs reset on CPU, max_memory_allocated on CUDA.

    ``method`` says which; ``None`` values mean this platform offers neither.
    """

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.method = "torch.cuda.max_memory_allocated after reset_peak_memory_stats"
        elif self._clear_refs():
            self.method = "VmHWM of /proc/self/status after `echo 5 > /proc/self/clear_refs`"
        else:
            self.method = None
        self.start_mb = None

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            return _proc_status_kb("VmHWM") is not None
        except OSError:
            return False

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)
            self.start_mb = self.torch.cuda.memory_allocated(self.device) / 2**20
        elif self.method:
            self._clear_refs()
            self.start_mb = _proc_status_kb("VmRSS") / 1024

    def peak(self) -> tuple[float | None, float | None]:
        """(peak MB, peak minus the value at reset, MB)."""
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            peak = self.torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self.method:
            peak = _proc_status_kb("VmHWM") / 1024
        else:
            return None, None
        return peak, peak - self.start_mb


# --------------------------------------------------------------------------- data


class _Rows:
    """Map-style dataset of token rows: ``{"input_ids": row, "labels": row}`` (every position a target)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        row = self.tokens[i]
        return {"input_ids": row, "labels": row}


def synthetic_tokens(n_rows: int, block_size: int, vocab_size: int, seed: int):
    """Uniformly random token ids, (n_rows, block_size) int64, the same on every process."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n_rows, block_size), generator=g, dtype=torch.long)


def raw_batch_indices(n_batches: int, batch_size: int, rank: int, world: int) -> list[list[int]]:
    """The example indices of the micro-batches process ``rank`` gets: global batches rank, rank + W, ...

    The same split as Accelerate's prepared DataLoader (``BatchSamplerShard``, ``split_batches=False``).
    """
    return [list(range(j * batch_size, (j + 1) * batch_size)) for j in range(rank, n_batches, world)]


# --------------------------------------------------------------------------- one run of each mode


class _Label:
    """Callback: tag the profiler's records ``warmup/<label>`` for the warm-up steps, then ``label``."""

    def __init__(self, profiler, warmup_steps: int, label: str):
        self.profiler, self.warmup_steps, self.label = profiler, warmup_steps, label

    def on_train_begin(self, state):
        self.profiler.mode = self.label if self.warmup_steps == 0 else f"warmup/{self.label}"

    def on_step_end(self, state):
        if state.step == self.warmup_steps:
            self.profiler.mode = self.label


def run_toolkit(accelerator, model, optimizer, dataloader, K: int, steps: int, profiler, label: _Label) -> list[float]:
    """``sync_each_batch`` or ``no_sync`` (set by the caller): :func:`accum_kit.train_loop`; returns the losses."""
    from .loop import train_loop

    accelerator.gradient_accumulation_steps = K
    accelerator.step = 0  # windows start at the dataloader's first batch (train_loop may stop mid-dataloader)
    result = train_loop(accelerator, model, optimizer, dataloader, max_train_steps=steps, progress=False,
                        profiler=profiler, callbacks=[label])
    return result.train_loss


def run_raw_ddp(model, optimizer, dataloader, K: int, steps: int, profiler, label: _Label, device) -> list[float]:
    """The baseline a user writes with plain DDP (nanoGPT's toggle), same arithmetic as the toolkit.

    Each micro-batch back-propagates its summed token loss; DDP averages over
    the W processes on the window's last micro-batch, then one all-reduce of
    (loss sum, token count) and a multiplication of the gradients by W / N
    make them the token-mean gradient of the whole window. ``profiler`` and
    ``label`` get the same calls as in :func:`accum_kit.train_loop`.
    """
    import torch
    import torch.distributed as dist

    from .loop import LoopState
    from .loss import causal_lm_loss

    world = dist.get_world_size()
    state, losses = LoopState(), []
    model.train()
    profiler.on_train_begin(state)
    label.on_train_begin(state)
    batches = iter(dataloader)
    for _ in range(steps):
        stats = torch.zeros(2, dtype=torch.float64, device=device)
        for micro in range(K):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
            model.require_backward_grad_sync = micro == K - 1  # all-reduce only on the window's last backward
            state.boundary = state.sync = micro == K - 1
            profiler.on_micro_batch_begin(state)
            summed_loss, n_tokens = causal_lm_loss(model, batch)
            profiler.on_forward_end(state)
            summed_loss.backward()
            profiler.on_backward_end(state)
            state.micro_step += 1
            stats += torch.stack([summed_loss.detach().double(), n_tokens.double()])
        profiler.on_step_begin(state)
        dist.all_reduce(stats)
        loss_sum, tokens = stats.tolist()
        scale = world / max(tokens, 1.0)  # DDP left sum(S) / W: make it sum(S) / N
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        losses.append(loss_sum / max(tokens, 1.0))
        profiler.on_step_end(state)
        label.on_step_end(state)
    profiler.on_train_end(state)
    return losses


def _reset_training_state(model, initial: list, optimizer) -> None:
    """Weights back to ``initial``, AdamW moments and step counts to zero, no gradients."""
    import torch

    with torch.no_grad():
        for p, p0 in zip(model.parameters(), initial):
            p.copy_(p0)
        inner = getattr(optimizer, "optimizer", optimizer)
        for st in inner.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.zero_()
    optimizer.zero_grad(set_to_none=True)


def _comm_hook(name: str):
    if name == "none":
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[name]


# --------------------------------------------------------------------------- statistics


# --------------------------------------------------------------------------- the sweep


def _machine(accelerator) -> dict:
    import torch
    import torch.distributed as dist

    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu_model": cpu, "cpu_count": os.cpu_count(),
            "torch_threads_per_process": torch.get_num_threads(), "world_size": accelerator.num_processes,
            "device": str(accelerator.device), "backend": dist.get_backend() if dist.is_initialized() else None,
            "distributed_type": str(accelerator.distributed_type),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _command(argv: list[str], world: int) -> str:
    procs = "" if world == 2 else f" --num_processes {world}"  # accelerate_configs/cpu_ddp.yaml starts 2
    return (f"accelerate launch --config_file accelerate_configs/cpu_ddp.yaml{procs} -m accum_kit bench"
            + "".join(f" {a}" for a in argv))


def _profiled_records(profiler, label: str) -> dict:
    """What one run recorded under ``label``: step times, phase times, all-reduce counts and spans."""
    steps = [s for s in profiler.step_records if s["mode"] == label]
    mbs = [m for m in profiler.micro_batches if m["mode"] == label]
    s = profiler.local_summary()  # filtered by profiler.mode == label
    phases = {}
    for m in mbs:
        phases[m["step"]] = phases.get(m["step"], 0.0) + m["forward_seconds"] + m["backward_seconds"]
    return {
        "step_seconds": [x["step_seconds"] for x in steps],
        "optimizer_seconds": [x["optimizer_seconds"] for x in steps],
        # the rest of the step: fetching batches and the loop's own code between the timed phases
        "other_seconds": [x["step_seconds"] - phases.get(x["step"], 0.0) - x["optimizer_seconds"] for x in steps],
        "micro_batches": [{"sync": m["sync"], "forward_s": m["forward_seconds"], "backward_s": m["backward_seconds"]} for m in mbs],
        "allreduce_calls": s["allreduce_calls"], "allreduce_bytes": s["allreduce_bytes"], "syncs": s["syncs"],
        "seconds_per_sync": s["seconds_per_sync"], "allreduce_busy_seconds": s["seconds_per_sync"] * s["syncs"] if s["syncs"] else 0.0,
    }


def _bench_preset(cfg: BenchConfig, preset: str, accelerator, bar) -> tuple[dict, list[dict]]:
    """All runs of one preset: build, prepare, then repeats x K x modes (rotated); returns (info, runs)."""
    import copy
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from .models import build_model, count_parameters
    from .profiler import CommProfiler

    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
    want_raw = "raw_ddp" in cfg.modes
    raw_model = copy.deepcopy(model).to(device) if want_raw else None  # a fresh copy of the same weights
    initial = [p.detach().clone() for p in model.parameters()]
    n_params = count_parameters(model)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    acc_model, acc_opt = accelerator.prepare(model, opt)
    ddp_kw = cfg.ddp_kwargs()
    dev_ids = [device.index if device.index is not None else accelerator.local_process_index] if device.type == "cuda" else None
    hook = _comm_hook(cfg.comm_hook)
    prof_acc = CommProfiler(accelerator, acc_model, hook=hook)
    raw_ddp = raw_opt = prof_raw = None
    if want_raw:  # plain DDP, the same constructor arguments as Accelerate's DistributedDataParallelKwargs
        raw_ddp = DistributedDataParallel(raw_model, device_ids=dev_ids, **ddp_kw)
        raw_opt = torch.optim.AdamW(raw_ddp.parameters(), lr=cfg.learning_rate)
        prof_raw = CommProfiler(accelerator, raw_ddp, hook=hook)

    # Data: the K-th dataloader holds exactly (warm-up + measured) x K micro-batches per process.
    run_steps = cfg.warmup_steps + cfg.steps
    B, K_max = cfg.per_device_train_batch_size, max(cfg.accumulation_steps)
    tokens = synthetic_tokens(run_steps * K_max * world * B, cfg.block_size, cfg.vocab_size, cfg.seed + 1)
    loaders = {}
    for K in cfg.accumulation_steps:
        n_batches = run_steps * K * world
        rows = _Rows(tokens[: n_batches * B])
        loaders[K] = {
            "toolkit": accelerator.prepare(DataLoader(rows, batch_size=B, shuffle=False)),
            "raw": DataLoader(rows, batch_sampler=raw_batch_indices(n_batches, B, rank, world)),
        }
    memory = PeakMemory(device)
    info = {"config": PRESETS[preset], "parameters": n_params, "gradient_bytes": grad_bytes,
            "micro_batch": f"{B}x{cfg.block_size} tokens", "memory_method": memory.method,
            "ddp_kwargs": ddp_kw, "comm_hook": cfg.comm_hook}

    def one_run(mode: str, K: int, label: str) -> dict:
        if mode == "raw_ddp":
            model_, opt_, prof = raw_ddp, raw_opt, prof_raw
        else:
            model_, opt_, prof = acc_model, acc_opt, prof_acc
            accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = mode == "sync_each_batch"
        _reset_training_state(model_, initial, opt_)
        prof.enabled = True
        tag = _Label(prof, cfg.warmup_steps, label)
        gc.collect()
        dist.barrier()
        memory.reset()
        t0 = time.perf_counter()
        if mode == "raw_ddp":
            losses = run_raw_ddp(model_, opt_, loaders[K]["raw"], K, run_steps, prof, tag, device)
        else:
            losses = run_toolkit(accelerator, model_, opt_, loaders[K]["toolkit"], K, run_steps, prof, tag)
        wall = time.perf_counter() - t0
        peak, increase = memory.peak()
        mem = torch.tensor([-1.0 if peak is None else peak, -1.0 if increase is None else increase],
                           dtype=torch.float64, device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        prof.mode = label
        return {"preset": preset, "K": K, "mode": mode, "wall_seconds": wall, "losses": losses,
                "peak_rss_mb": None if peak is None else mem[0].item(),
                "peak_increase_mb": None if increase is None else mem[1].item(),
                **_profiled_records(prof, label)}

    # Everything built so far lives until the preset is done: keep the cyclic garbage collector from
    # re-scanning it (a full collection over transformers' objects takes ~0.1-0.5 s, in or out of a timed step).
    gc.collect()
    gc.freeze()

    # One unrecorded run per mode first: a fresh model's first steps pay page faults and allocator
    # growth that the per-run warm-up step does not fully absorb.
    for mode in cfg.modes:
        one_run(mode, cfg.accumulation_steps[0], f"preset_warmup/{mode}")
    runs = []
    rotation = 0
    for rep in range(cfg.repeats):
        for K in cfg.accumulation_steps:
            shift = rotation % len(cfg.modes)
            order = cfg.modes[shift:] + cfg.modes[:shift]  # each mode takes every position in turn
            rotation += 1
            for position, mode in enumerate(order):
                rec = one_run(mode, K, f"{mode}/K{K}/r{rep}")
                rec.update(repeat=rep, position=position)
                runs.append(rec)
                bar.set_postfix_str(f"{preset} K={K} {mode}: {_median(rec['step_seconds']):.3f} s/step")
                bar.update(1)
    accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = False
    del acc_model, acc_opt, raw_ddp, raw_opt, prof_acc, prof_raw, loaders, model, raw_model, opt
    accelerator.free_memory()  # drops the prepared model, optimizer and dataloaders of this preset
    gc.unfreeze()
    gc.collect()
    return info, runs


def run(cfg: BenchConfig, argv: list[str] | None = None) -> dict:
    """Run the sweep described by ``cfg``; return the result (also written to ``cfg.output_dir`` by process 0).

    Raises:
        UsageError: bad input or fewer than 2 processes, before any output is written.
        ProcessCountError: launched and visible process counts differ.
    """
    from accelerate.utils import DistributedDataParallelKwargs
    from tqdm.auto import tqdm

    from .launch import build_accelerator, launcher_world_size

    cfg.validate()
    if launcher_world_size() < 2:
        raise UsageError("--num_processes", f"the bench compares DDP modes and needs >= 2 processes (launched: {launcher_world_size()})",
                         "run it under accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m accum_kit bench")
    handlers = [DistributedDataParallelKwargs(**cfg.ddp_kwargs())] if cfg.ddp_kwargs() else []
    accelerator = build_accelerator(None, kwargs_handlers=handlers)
    world = accelerator.num_processes
    started, load_start, t0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), os.getloadavg(), time.perf_counter()
    total = len(cfg.model_presets) * cfg.repeats * len(cfg.accumulation_steps) * len(cfg.modes)
    bar = tqdm(total=total, desc="bench runs", disable=not accelerator.is_main_process, file=sys.stdout)
    presets, rows, per_k, all_runs, tables = {}, [], [], [], []
    for preset in cfg.model_presets:
        info, runs = _bench_preset(cfg, preset, accelerator, bar)
        p_rows, p_k = summarize_preset(preset, info, runs, cfg, world)
        presets[preset], all_runs = info, all_runs + runs
        rows += p_rows
        per_k += p_k
        tables.append(format_preset_table(preset, info, p_rows, p_k, cfg.modes) + "\n" + format_profile(info["profile"]))
        if accelerator.is_main_process:
            bar.write(tables[-1] + "\n")
    bar.close()
    bars = evaluate_bars(rows, per_k, cfg)
    result = {
        "schema": "accum_kit.bench/1",
        "command": _command(argv if argv is not None else [], world),
        "config": asdict(cfg),
        "machine": _machine(accelerator),
        "versions": library_versions(),
        "data": "synthetic: uniformly random token ids, every position a target; seed --seed + 1",
        "timings_from": "process 0 (step times); peak memory: max over processes",
        "presets": presets,
        "rows": rows,
        "per_k": per_k,
        "bars": bars,
        "runs": all_runs,
        "timing": {"started": started, "total_seconds": time.perf_counter() - t0,
                   "load_average_start": list(load_start), "load_average_end": list(os.getloadavg())},
    }
    if accelerator.is_main_process:
        paths = write_outputs(cfg.output_dir, result)
        print("\n".join(tables))
        print(format_bars(bars))
        print(f"wrote {', '.join(str(p) for p in paths)} ({result['timing']['total_seconds']:.0f} s; "
              f"load average {load_start[0]:.2f} at start, {result['timing']['load_average_end'][0]:.2f} at end)")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


def main(argv: list[str] | None = None) -> int:
    """``accum-kit bench``: 0 on success, 2 on bad input (``error: ...`` on stderr), nothing written then."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg = parse_bench_args(argv)
        if cfg is None:  # argparse error, already printed
            return 2
        run(cfg, argv)
    except AccumKitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
