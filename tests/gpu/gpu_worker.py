"""Worker of tests/gpu (not a test module): runs accum_kit on the GPU and writes what it saw; checks nothing.

One launch per engine, one process on the one GPU (NCCL at world size 1), started by
tests/gpu/conftest.py, all at once::

    python3 -m accelerate.commands.launch --config_file accelerate_configs/gpu_ddp.yaml --num_processes 1 \
        tests/gpu/gpu_worker.py ddp OUT_DIR

Tasks (``ddp``, ``compile``, ``fsdp``, ``zero``; ``auto_batch`` runs without the launcher and starts train jobs
of its own, tests/gpu/auto_batch_runs.py) run their parts one after another in the same process,
Accelerate's state reset between them (the process group stays); each part's figures, or its traceback,
go into ``OUT_DIR/result.json``, rewritten after every part, so one failure loses nothing else. Parameters
go into ``.pt`` files beside it (float64, CPU). Expected values are computed by the tests, from plain
PyTorch (tests/gpu/gpu_common.py), never here.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import gpu_common as common  # this script's folder is on sys.path

import accum_kit
from accum_kit.compat import reset_accelerate_state


# ---------------------------------------------------------------- plumbing


def env_info() -> dict:
    """Versions and the settings that change fp32 results (TF32), as the process started (each run records the TF32
    switch at every step: ``tf32_matmul_per_step``); never raises."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "cuda_available": torch.cuda.is_available()}
    for key, get in (("accelerate", lambda: __import__("accelerate").__version__),
                     ("transformers", lambda: __import__("transformers").__version__),
                     ("device_name", lambda: torch.cuda.get_device_name(0)),
                     ("tf32_matmul", lambda: bool(torch.backends.cuda.matmul.allow_tf32)),
                     ("float32_matmul_precision", torch.get_float32_matmul_precision)):
        try:
            info[key] = get()
        except Exception as exc:  # e.g. no GPU, or torch refusing the legacy TF32 flag
            info[key] = f"unavailable: {type(exc).__name__}: {exc}"
    return info


def run_parts(out: Path, parts) -> int:
    result = {"env": env_info()}
    path = out / "result.json"

    def write():
        tmp = out / "result.json.tmp"
        tmp.write_text(json.dumps(result, indent=1, default=str))
        os.replace(tmp, path)

    write()
    failed = 0
    for key, fn in parts:
        t0 = time.perf_counter()
        print(f"[gpu_worker] {key} ...", flush=True)
        try:
            entry = fn(out)
        except Exception:
            failed += 1
            entry = {"error": traceback.format_exc()[-8000:]}
            print(entry["error"], flush=True)
        entry["part_seconds"] = round(time.perf_counter() - t0, 3)
        result[key] = entry
        print(f"[gpu_worker] {key} done in {entry['part_seconds']}s", flush=True)
        write()
    return failed


def tf32_matmul() -> bool:
    """Whether cuBLAS may round fp32 matmul inputs to TF32 (10-bit mantissa) now: torch's process-wide switch."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


#: the switch as this process started (torch's default: off); every part starts from it again (:func:`fresh_state`)
TF32_AT_START = tf32_matmul()


def restore_tf32() -> None:
    """Put the switch back as the process started, through the flag Accelerate sets (torch >= 2.9 refuses a mix of
    its legacy and new TF32 settings), and only when it changed (the legacy setter warns of its deprecation)."""
    if tf32_matmul() != TF32_AT_START:
        torch.backends.cuda.matmul.allow_tf32 = TF32_AT_START


def fresh_state() -> None:
    """Forget Accelerate's singletons (a new mixed precision or plugin needs it); the process group stays.

    Also puts the TF32 switch back as the process started: Accelerate turns it on when it builds the state of a
    compiled fp32 run on CUDA (``AcceleratorState.__init__``: a dynamo backend, mixed precision "no", a CUDA
    device) and never off again, so without this a compiled part would leave every later fp32 part in TF32.
    """
    reset_accelerate_state()
    restore_tf32()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cpu_params(model, dtype=torch.float64) -> dict:
    """Full parameters (FSDP2's DTensors gathered) as CPU copies."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu", dtype, copy=True)
            for n, p in model.named_parameters()}


def new_model(config: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(common.SEED)
    return GPT2LMHeadModel(GPT2Config(**config))


class StepParams(accum_kit.LoopCallback):
    """Parameters (float64, CPU) after every optimizer step, the optimizer's skip flag and the scaler's scale, and
    the TF32 switch at every step's end (an fp32 run's figures mean fp32 only if it stayed off)."""

    def __init__(self, read, optimizer=None, scaler=None):
        self.read, self.optimizer, self.scaler = read, optimizer, scaler
        self.after, self.skipped, self.scales, self.tf32 = [], [], [], []

    def on_step_end(self, state):
        self.after.append(self.read())
        self.tf32.append(tf32_matmul())
        if self.scaler is not None:
            self.skipped.append(bool(self.optimizer.step_was_skipped))
            self.scales.append(float(self.scaler.get_scale()))


def train(acc, config, examples, k, b, lr, *, mode="tokens", loss_fn=None, pad_to=None, epochs=1, max_steps=None,
          optimizer="sgd", extra=None, profiler_factory=None, read=None):
    """Build the model (seeded), prepare, run ``accum_kit.train_loop``; returns a dict of what happened."""
    model = new_model(config)
    init = cpu_params(model)
    opt = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=lr))
    loader = DataLoader(examples, batch_size=b, shuffle=False, collate_fn=common.pad_collate(width=pad_to))
    pmodel, popt, ploader = acc.prepare(model, opt, loader)
    steps = StepParams(read or (lambda: cpu_params(model)), popt, acc.scaler)
    callbacks = [steps, *(extra(acc, pmodel) if extra else [])]
    initial = read() if read else None  # e.g. DeepSpeed's fp32 master weights, made from the bf16 module under bf16
    profiler = profiler_factory(acc, pmodel) if profiler_factory else None
    sync()
    t0 = time.perf_counter()
    result = accum_kit.train_loop(acc, pmodel, popt, ploader, loss_normalization=mode, loss_fn=loss_fn,
                                  callbacks=callbacks, profiler=profiler, progress=False, num_train_epochs=epochs,
                                  max_train_steps=max_steps)
    sync()
    wall = time.perf_counter() - t0
    return {"model": model, "pmodel": pmodel, "optimizer": popt, "init": initial or init, "steps": steps,
            "result": result, "wall": wall, "callbacks": callbacks, "profiler": profiler}


def run_info(acc, run) -> dict:
    r = run["result"]
    secs = r.step_seconds
    return {"device": str(acc.device), "distributed_type": str(acc.distributed_type),
            "num_processes": acc.num_processes, "mixed_precision": acc.mixed_precision,
            "native_amp": bool(getattr(acc, "native_amp", False)), "prepared_class": type(run["pmodel"]).__name__,
            "optimizer_steps": r.optimizer_steps, "micro_batches": r.micro_batches, "train_loss": r.train_loss,
            "step_tokens": r.step_tokens, "step_seconds": secs,
            "s_per_step_after_first": statistics.median(secs[1:]) if len(secs) > 1 else (secs[0] if secs else None),
            "loop_wall_seconds": run["wall"], "tf32_matmul_per_step": run["steps"].tf32}


def save_params(out: Path, key: str, run) -> str:
    path = out / f"{key}.pt"
    torch.save({"init": run["init"], "after": run["steps"].after}, path)
    return path.name


# ---------------------------------------------------------------- GPU time of known length


def cuda_sleep(cycles: int) -> None:
    """Keep the current CUDA stream busy for ``cycles`` GPU clock cycles (torch's own spin kernel)."""
    torch.cuda._sleep(int(cycles))


def event_seconds(fn, stream=None) -> float:
    """GPU seconds between two CUDA events recorded around ``fn()`` on ``stream`` (default: the current one)."""
    stream = stream or torch.cuda.current_stream()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        begin.record()
        fn()
        end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000


def calibrate_sleep(target_s: float) -> tuple[int, float]:
    """(cycles, seconds): a spin of about ``target_s`` GPU seconds, and its shortest measured length."""
    probe = 2_000_000
    per_cycle = min(event_seconds(lambda: cuda_sleep(probe)) for _ in range(3)) / probe
    cycles = max(1, int(target_s / per_cycle))
    return cycles, min(event_seconds(lambda: cuda_sleep(cycles)) for _ in range(3))


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward first spins the GPU: backward time that only a synchronising timer sees."""

    @staticmethod
    def forward(ctx, x, cycles):
        ctx.cycles = cycles
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        cuda_sleep(ctx.cycles)
        return grad, None


def sleeping_loss(cycles: int):
    def loss_fn(model, batch):
        summed, n = accum_kit.causal_lm_loss(model, batch)
        return _SleepInBackward.apply(summed, cycles), n

    return loss_fn


class EventSpans(accum_kit.LoopCallback):
    """CUDA events of our own at each micro-batch's begin and backward end (the profiler's phases' span)."""

    def __init__(self):
        self.pairs = []

    def on_micro_batch_begin(self, state):
        self._begin = torch.cuda.Event(enable_timing=True)
        self._begin.record()

    def on_backward_end(self, state):
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pairs.append((state.step, self._begin, end))

    def seconds(self) -> list:
        out = []
        for step, b, e in self.pairs:
            e.synchronize()
            out.append({"step": step, "seconds": b.elapsed_time(e) / 1000})
        return out


# ---------------------------------------------------------------- ddp: bf16, fp16, verify, profiler


def bf16_part(out: Path, mode: str) -> dict:
    fresh_state()
    acc = accum_kit.build_accelerator(common.K, mixed_precision="bf16")
    run = train(acc, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR, mode=mode)
    return {**run_info(acc, run), "params": save_params(out, f"bf16_{mode}", run)}


def fp16_part(out: Path, divisor: bool) -> dict:
    fresh_state()
    acc = accum_kit.build_accelerator(common.FP16_K, mixed_precision="fp16")
    scaler = acc.scaler
    info = {"scaler": type(scaler).__name__ if scaler is not None else None,
            "init_scale": float(scaler.get_scale()) if scaler is not None else None}
    import accum_kit.core.loss as loss_mod
    saved = loss_mod.power_of_two
    if not divisor:  # c = 1: the summed losses back-propagated as they are (the arithmetic before the divisor)
        loss_mod.power_of_two = lambda x: 1.0
    try:
        run = train(acc, common.FP16_MODEL, common.FP16_EXAMPLES, common.FP16_K, common.FP16_B, common.FP16_LR)
    finally:
        loss_mod.power_of_two = saved
    steps = run["steps"]
    info.update(run_info(acc, run), skipped=steps.skipped, scales=steps.scales)
    if divisor:
        info["params"] = save_params(out, "fp16", run)
    return info


def verify_part(out: Path) -> dict:
    fresh_state()
    from accum_kit.verify import verify_accumulation

    report = verify_accumulation(gradient_accumulation_steps=common.K, mixed_precision="bf16", trainer_row=False)
    d = report.to_dict()
    (out / "verify_bf16.json").write_text(json.dumps(d, default=str))
    return {"report": "verify_bf16.json", "passed": d.get("passed"), "seconds": d.get("seconds")}


def profiler_part(out: Path) -> dict:
    """fp32, 2 epochs (8 steps), a known GPU spin in every backward; CommProfiler as the loop's profiler."""
    fresh_state()
    from accum_kit.profiler import CommProfiler

    acc = accum_kit.build_accelerator(common.K, mixed_precision="no")
    cycles, sleep_s = calibrate_sleep(0.010)
    spans = EventSpans()
    run = train(acc, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR, epochs=2,
                loss_fn=sleeping_loss(cycles), extra=lambda a, m: [spans],
                profiler_factory=lambda a, m: CommProfiler(a, m))
    prof = run["profiler"]
    info = run_info(acc, run)
    info.update(
        sleep_cycles=cycles, sleep_seconds=sleep_s, synchronize=bool(prof.phases.synchronize),
        is_ddp=bool(prof.is_ddp), distributed=bool(prof.distributed),
        grad_bytes=sum(p.numel() * p.element_size() for p in run["model"].parameters() if p.requires_grad),
        micro=[{"step": m.step, "micro_batch": m.micro_batch, "sync": m.sync, "forward": m.forward_seconds,
                "backward": m.backward_seconds} for m in prof.micro_batches],
        steps=[{"step": s.step, "optimizer": s.optimizer_seconds, "step_seconds": s.step_seconds}
               for s in prof.step_records],
        buckets=[{"step": c.step, "micro_batch": c.micro_batch, "sync": c.sync, "bucket": c.bucket,
                  "bytes": c.bytes, "seconds": c.seconds} for c in prof.calls],
        event_spans=spans.seconds(),
        summary=prof.local_summary())
    return info


class _SleepingComm:
    """A stand-in for FSDP2's all-gather / reduce-scatter objects: allocates like torch's, runs a known GPU spin."""

    def __init__(self, cycles):
        self.cycles = cycles

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        cuda_sleep(self.cycles)
        return None


def collective_events_part(out: Path) -> dict:
    """accum_kit's FSDP2 collective recorder on CUDA (its CUDA-event path), around a spin of known length.

    With one GPU FSDP2 calls no collective (world size 1 copies instead), so the recorder's wrappers are
    called directly, on a side stream as FSDP2 does; the profiler's own aggregates are read through its summary.
    """
    fresh_state()
    from accum_kit.profiler import CommProfiler
    from accum_kit.profiler.collectives import recording_all_gather, recording_reduce_scatter

    acc = accum_kit.build_accelerator(common.K, mixed_precision="no")
    model = new_model(common.MODEL)
    pmodel = acc.prepare(model)
    prof = CommProfiler(acc, pmodel)  # not attached: only its collective recorder and aggregates are used
    cycles, sleep_s = calibrate_sleep(0.005)
    stream = torch.cuda.Stream()
    ag = recording_all_gather(_SleepingComm(cycles), prof.collectives, 0)
    rs = recording_reduce_scatter(_SleepingComm(cycles), prof.collectives, 0)
    inp = torch.zeros(1024, device=acc.device)
    gathered = torch.zeros(1024, device=acc.device)
    n, outer = 3, []  # our own CUDA events around each wrapped call, on the same stream: the recorder's are inside
    for _ in range(n):
        outer.append(event_seconds(lambda: ag(output_tensor=gathered, input_tensor=inp, group=None, async_op=False),
                                   stream))
        outer.append(event_seconds(lambda: rs(output_tensor=inp, input_tensor=gathered, group=None, op=None,
                                              async_op=False), stream))
    sync()
    prof.local_summary()  # a summary must see what was recorded (CUDA records wait for their events)
    figs = prof.aggregates.figures(mode=prof.mode)
    seen_by_summary = {"all_gather": figs.ag_calls, "reduce_scatter": figs.rs_calls}
    calls = prof.collectives.calls
    return {"calls": n, "sleep_seconds": sleep_s, "outer_event_seconds": outer, "seen_by_summary": seen_by_summary,
            "records": [{"kind": c.kind, "bytes": c.bytes, "seconds": c.seconds} for c in calls]}


def delayed_allreduce_part(out: Path) -> dict:
    """DDP's comm hook, wrapped by the profiler, behind a GPU spin: what the recorded all-reduce seconds cover."""
    fresh_state()
    from accum_kit.profiler import CommProfiler
    from accum_kit.profiler.buckets import allreduce_mean_hook

    acc = accum_kit.build_accelerator(common.K, mixed_precision="no")
    cycles, sleep_s = calibrate_sleep(0.005)

    def spin_then_allreduce(state, bucket):
        cuda_sleep(cycles)  # the all-reduce cannot finish before this spin: >= sleep_s after the hook is called
        return allreduce_mean_hook(state, bucket)

    run = train(acc, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR,
                profiler_factory=lambda a, m: CommProfiler(a, m, hook=spin_then_allreduce))
    calls = run["profiler"].calls
    return {"sleep_seconds": sleep_s, "bucket_seconds": [c.seconds for c in calls], "buckets": len(calls)}


class SyncCount(accum_kit.LoopCallback):
    """torch's own count of synchronising CUDA calls, per micro-batch: ``torch.cuda.set_sync_debug_mode("warn")``
    while the loop runs, each warning credited to the innermost Python frame outside torch (its owner)."""

    def __init__(self):
        self.micro, self.outside = [], {}

    def on_train_begin(self, state):
        import warnings

        self._show, self._filters = warnings.showwarning, list(warnings.filters)
        warnings.showwarning = self._seen
        warnings.simplefilter("always")  # every occurrence, not the first per place
        torch.cuda.set_sync_debug_mode("warn")

    def _seen(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1]  # without this frame and the warnings module's
                  if "/torch/" not in f.filename and not f.filename.endswith("warnings.py")]
        f = frames[-1] if frames else None
        owner = "?" if f is None else f"{'/'.join(Path(f.filename).parts[-3:])}:{f.name}"
        counts = self.micro[-1]["syncs"] if self.micro else self.outside
        counts[owner] = counts.get(owner, 0) + 1

    def on_micro_batch_begin(self, state):
        self.micro.append({"boundary": bool(state.boundary), "syncs": {}})

    def on_train_end(self, state):
        import warnings

        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning, warnings.filters[:] = self._show, self._filters


def sync_debug_part(out: Path) -> dict:
    """train_loop (fp32, K=3, tokens, clipping) under ``set_sync_debug_mode``: the synchronising calls per micro-batch."""
    fresh_state()
    acc = accum_kit.build_accelerator(common.K)
    count = SyncCount()
    run = train(acc, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR, extra=lambda a, m: [count])
    return {**run_info(acc, run), "micro": count.micro, "outside": count.outside}


def ddp_task(out: Path) -> int:
    return run_parts(out, [
        ("bf16_tokens", lambda o: bf16_part(o, "tokens")),
        ("bf16_mean", lambda o: bf16_part(o, "mean")),
        ("fp16", lambda o: fp16_part(o, divisor=True)),
        ("fp16_without_divisor", lambda o: fp16_part(o, divisor=False)),
        ("verify_bf16", verify_part),
        ("profiler", profiler_part),
        ("collective_events", collective_events_part),
        ("delayed_allreduce", delayed_allreduce_part),
        ("sync_debug", sync_debug_part),
    ])


# ---------------------------------------------------------------- compile: inductor, its floor, recompiles


class DynamoCounts(accum_kit.LoopCallback):
    """torch's own dynamo counters after the first optimizer step (the end of warm-up) and at the end."""

    def __init__(self):
        self.after_warmup = None

    @staticmethod
    def snapshot() -> dict:
        from torch._dynamo.utils import counters

        return {"frames": dict(counters["frames"]), "stats": dict(counters["stats"])}

    def on_step_end(self, state):
        if state.step == 1:
            self.after_warmup = self.snapshot()


def sgd_step_from(init: dict, model, call, batch) -> dict:
    """Parameters after one plain SGD step from ``init`` on ``batch``: token-mean loss of ``call``'s logits."""
    import torch.nn.functional as F

    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(init[n])
    model.zero_grad(set_to_none=True)
    logits = call(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=common.IGNORE).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= common.LR * p.grad
    model.zero_grad(set_to_none=True)
    return cpu_params(model)


def compile_floor(run) -> dict:
    """The rounding floor of the compiled code: one SGD step on one micro-batch of the run's shape, from the
    initial parameters, through the run's own compiled model against a fresh eager copy (plain torch, no
    accum_kit arithmetic; the compiled code is reused, nothing is compiled again)."""
    device = next(run["model"].parameters()).device
    batch = {k: v.to(device) for k, v in common.pad_collate(width=common.PAD_TO)(common.EXAMPLES[:common.B]).items()}
    eager = new_model(common.COMPILE_MODEL).to(device)
    frames = DynamoCounts.snapshot()["frames"].get("total", 0)
    compiled = sgd_step_from(run["init"], run["model"], run["pmodel"], batch)
    plain = sgd_step_from(run["init"], eager, eager, batch)
    floor = max(float((compiled[k] - plain[k]).abs().max()) for k in plain)
    return {"floor": floor, "floor_frames_converted": DynamoCounts.snapshot()["frames"].get("total", 0) - frames}


def compiled_part(out: Path) -> dict:
    """The inductor-compiled fp32 run. Accelerate turns TF32 on when it builds this Accelerator on CUDA (see
    :func:`fresh_state`); it is turned off again before anything is compiled, so that the run, its compiled code
    and the floor are fp32 as the test's tolerance assumes (dynamo guards on the switch: no recompile follows)."""
    fresh_state()
    import accum_kit.engines.compiling as compiling
    acc = accum_kit.build_accelerator(common.K, mixed_precision="no", torch_compile=True,
                                      torch_compile_backend="inductor", torch_compile_dynamic=False)
    tf32_by_accelerate = tf32_matmul() and not TF32_AT_START
    restore_tf32()
    watch = compiling.CompileWatch(warmup_steps=1)
    counts = DynamoCounts()
    before = DynamoCounts.snapshot()
    try:
        run = train(acc, common.COMPILE_MODEL, common.EXAMPLES, common.K, common.B, common.LR, pad_to=common.PAD_TO,
                    extra=lambda a, m: [watch, counts])
    finally:
        watch.close()
    info = {**run_info(acc, run), "params": save_params(out, "compiled", run),
            "compile_settings": compiling.compile_settings(acc), "compile_watch": watch.summary(),
            "dynamo_before": before, "dynamo_after_warmup": counts.after_warmup, "dynamo_end": DynamoCounts.snapshot(),
            "tf32_switched_on_by_accelerate": tf32_by_accelerate}
    try:
        info["floor"] = compile_floor(run)
    except Exception:
        info["floor"] = {"error": traceback.format_exc()[-4000:]}
    return info


def eager_part(out: Path) -> dict:
    fresh_state()
    acc = accum_kit.build_accelerator(common.K, mixed_precision="no")
    run = train(acc, common.COMPILE_MODEL, common.EXAMPLES, common.K, common.B, common.LR, pad_to=common.PAD_TO)
    return {**run_info(acc, run), "params": save_params(out, "eager", run)}


def compile_task(out: Path) -> int:
    return run_parts(out, [("compiled", compiled_part), ("eager", eager_part)])


# ---------------------------------------------------------------- fsdp: memory per policy


class MemoryProbe(accum_kit.LoopCallback):
    """The CUDA caching allocator's own figures around window ``window`` (0-based; window 0 is the warm-up).

    ``start``: ``memory_allocated`` when the window's first micro-batch begins (parameter shards, optimizer
    state), relative to ``base`` (before the model existed); ``held``: ``memory_allocated`` after each
    non-boundary backward minus ``start`` (what the window keeps between micro-batches); ``peak``:
    ``max_memory_allocated`` over the window (stats reset at its start), relative to ``base``.
    """

    def __init__(self, base: int, window: int = 1):
        self.base, self.window = base, window
        self.start = self.peak = None
        self.held = []
        self._opening = True

    def on_train_begin(self, state):
        self._opening = True

    def on_micro_batch_begin(self, state):
        if self._opening and state.step == self.window:
            torch.cuda.synchronize()
            self.start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        self._opening = False

    def on_backward_end(self, state):
        if state.step == self.window and not state.boundary:
            self.held.append(torch.cuda.memory_allocated() - self.start)

    def on_step_end(self, state):
        if state.step == self.window + 1:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
            self.max_memory_allocated = torch.cuda.max_memory_allocated()
        self._opening = True


def fsdp_policy_part(out: Path, policy: str) -> dict:
    fresh_state()
    import accum_kit.profiler.held_memory as held_memory
    sync()
    base = torch.cuda.memory_allocated()
    acc = accum_kit.build_accelerator(common.MEMORY_K, accumulation_policy=policy)  # precision: the config's (bf16)
    probe = MemoryProbe(base)
    holder = {}

    def extra(a, m):
        holder["held"] = held_memory.HeldMemory(a, m)
        return [probe, holder["held"]]

    run = train(acc, common.MEMORY_MODEL, common.MEMORY_EXAMPLES, common.MEMORY_K, common.MEMORY_B, 1e-3,
                optimizer="adamw", max_steps=2, extra=extra, read=lambda: {})
    pmodel = run["pmodel"]
    predicted = held_memory.predicted_memory(acc, pmodel, common.MEMORY_K)
    info = {
        "policy": policy, "is_fsdp2": bool(getattr(acc, "is_fsdp2", False)), "num_processes": acc.num_processes,
        "mixed_precision": acc.mixed_precision, "policy_in_force": acc.run_plan.policy.name,
        "parameters": sum(p.numel() for p in pmodel.parameters()),
        "base_bytes": base, "start_bytes": probe.start, "held_bytes": probe.held, "peak_bytes": probe.peak,
        "max_memory_allocated": getattr(probe, "max_memory_allocated", None),
        "predicted": predicted.get(policy), "predicted_all": predicted,
        "held_memory_peaks": holder["held"].peaks, "s_per_step": statistics.median(run["result"].step_seconds),
    }
    acc.free_memory()
    holder.clear()
    del run, pmodel
    return info


def fsdp_checkpointing_part(out: Path, checkpointing: bool) -> dict:
    """FSDP2 in fp32 with or without ``gradient_checkpointing``, AdamW, 2 windows of K = 2 (the second measured):
    ``max_memory_allocated`` over the window since before the model existed, and accum_kit's predicted peak by
    part (``predicted_peak``: the cost table's row, FSDP2's buffers and a micro-batch's activations; baseline 0,
    since the measurement starts before the model)."""
    fresh_state()
    from accum_kit.profiler.held_memory import predicted_peak
    sync()
    base = torch.cuda.memory_allocated()
    acc = accum_kit.build_accelerator(common.CKPT_K, mixed_precision="no", gradient_checkpointing=checkpointing)
    probe = MemoryProbe(base)
    run = train(acc, common.CKPT_MODEL, common.CKPT_EXAMPLES, common.CKPT_K, common.CKPT_B, 1e-3,
                optimizer="adamw", max_steps=2, extra=lambda a, m: [probe], read=lambda: {})
    pmodel = run["pmodel"]
    predict = predicted_peak(acc, pmodel, common.CKPT_K, common.CKPT_B, common.CKPT_SEQ, checkpointing)
    info = {"checkpointing": checkpointing, "in_force": bool(acc.run_plan.gradient_checkpointing),
            "is_fsdp2": bool(getattr(acc, "is_fsdp2", False)), "mixed_precision": acc.mixed_precision,
            "parameters": sum(p.numel() for p in pmodel.parameters()), "peak_bytes": probe.peak,
            "start_bytes": probe.start, "base_bytes": base,
            "predicted_parts": predict(None) if predict is not None else None,
            "s_per_step": statistics.median(run["result"].step_seconds)}
    acc.free_memory()
    del run, pmodel
    return info


def warm_up_cuda(out: Path) -> dict:
    """One bf16-autocast forward and backward of the memory model before anything is measured.

    cuBLAS and cuBLASLt take their workspaces (per handle and stream, and autograd's backward runs on a
    thread of its own, with its own handle) from the caching allocator at their first matmul and keep them:
    allocated during the first policy's run they would count as that policy's parameters.
    """
    fresh_state()
    before = torch.cuda.memory_allocated()
    model = new_model(common.MEMORY_MODEL).cuda()
    batch = {k: v.cuda() for k, v in common.pad_collate()(common.MEMORY_EXAMPLES[:common.MEMORY_B]).items()}
    for dtype in (torch.bfloat16, torch.float32):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float().sum().backward()
    del model, batch
    fresh_state()
    sync()
    return {"kept_after_warm_up_bytes": torch.cuda.memory_allocated() - before}


def fsdp_bf16_part(out: Path) -> dict:
    """FSDP2 as gpu_fsdp.yaml sets it up (bf16 compute, fp32 reduction, parameters loaded by rank 0), SGD."""
    fresh_state()
    acc = accum_kit.build_accelerator(common.K)  # precision: the config's (bf16)
    run = train(acc, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR)
    info = {**run_info(acc, run), "params": save_params(out, "fsdp_bf16", run),
            "is_fsdp2": bool(getattr(acc, "is_fsdp2", False)),
            "tied": run["model"].get_output_embeddings().weight is run["model"].get_input_embeddings().weight}
    acc.free_memory()
    return info


def fsdp_task(out: Path) -> int:
    return run_parts(out, [("warm_up", warm_up_cuda),
                           *[(f"fsdp_{p}", (lambda o, p=p: fsdp_policy_part(o, p))) for p in common.FSDP_POLICIES],
                           *[(f"fsdp_checkpointing_{on}", (lambda o, on=on: fsdp_checkpointing_part(o, on == "on")))
                             for on in ("off", "on")],
                           ("fsdp_bf16", fsdp_bf16_part)])


# ---------------------------------------------------------------- zero: ZeRO-2 against the oracle


def zero_part(out: Path, precision: str) -> dict:
    fresh_state()
    import deepspeed
    import accum_kit.profiler.held_memory as held_memory
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.utils import safe_get_full_fp32_param

    acc = accum_kit.build_accelerator(common.K, deepspeed_plugin=DeepSpeedPlugin(zero_stage=2),
                                      mixed_precision=precision)
    holder, sources = {}, set()

    def master():  # the fp32 master weights the ZeRO optimizer updates (the module's may be bf16 copies)
        engine = holder["engine"]
        got = {}
        for n, p in engine.module.named_parameters():
            full = safe_get_full_fp32_param(p)
            sources.add("safe_get_full_fp32_param" if full is not None else f"module parameter ({p.dtype})")
            got[n] = (full if full is not None else p).detach().to("cpu", torch.float64, copy=True)
        return got

    def extra(a, m):
        holder["engine"] = m
        holder["held"] = held_memory.HeldMemory(a, m)
        return [holder["held"]]

    run = train(acc, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR, extra=extra, read=master)
    engine = run["pmodel"]
    info = {**run_info(acc, run), "params": save_params(out, f"zero2_{precision}", run),
            "held_gradient_bytes": holder["held"].local()["gradient_bytes"],
            "held_by_kind": holder["held"].local()["by_kind"],
            "predicted": held_memory.predicted_memory(acc, engine, common.K).get("zero2"),
            "unique_parameters": sum(p.numel() for p in run["model"].parameters()),
            "deepspeed_version": deepspeed.__version__,
            "model_class": type(engine).__name__, "zero_stage": acc.deepspeed_plugin.zero_stage,
            "engine_gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "module_dtype": str(next(engine.module.parameters()).dtype), "master_weights_from": sorted(sources)}
    acc.free_memory()
    holder.clear()
    del run, engine
    return info


def zero_task(out: Path) -> int:
    return run_parts(out, [("zero2_fp32", lambda o: zero_part(o, "no")),
                           ("zero2_bf16", lambda o: zero_part(o, "bf16"))])


# ---------------------------------------------------------------- auto_batch: --auto_find_batch_size under a cap


def auto_batch_task(out: Path) -> int:
    """tests/gpu/auto_batch_runs.py's train jobs, within what is left of the launches' deadline."""
    import auto_batch_runs

    return run_parts(out, [("auto_batch", lambda o: auto_batch_runs.run(o, common.DEADLINE_S - 15))])


TASKS = {"ddp": ddp_task, "compile": compile_task, "fsdp": fsdp_task, "zero": zero_task, "auto_batch": auto_batch_task}


def main() -> int:
    import signal

    # end on our own if nobody stops us (the pytest that started the launch may have been killed)
    signal.alarm(int(os.environ.get("GPU_TESTS_WORKER_ALARM_S", "0")))
    task, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    failed = TASKS[task](out)
    print(f"[gpu_worker] {task}: {failed} part(s) failed", flush=True)
    return 0  # failures are in result.json; the tests report them


if __name__ == "__main__":
    sys.exit(main())
