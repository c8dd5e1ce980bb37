"""Communication profiler: what DDP's all-reduce costs, and what ``no_sync`` saves.

:class:`CommProfiler` registers a DDP communication hook that wraps the
default all-reduce (or a hook you choose, e.g. fp16/bf16 compression) and
records, for every gradient bucket, the optimizer step and micro-batch it
belongs to, its size in bytes and its latency in seconds (from the moment DDP
hands the bucket over to the completion of the all-reduce future). Used as a
:func:`accum_kit.train_loop` callback it also times the forward, backward and
optimizer phases of every micro-batch, tagged sync or no-sync.

Definitions (per process, then min / median / max over processes):

- algorithm bandwidth ``algbw = bytes / seconds`` and bus bandwidth
  ``busbw = algbw * 2 (n - 1) / n`` for an all-reduce over n processes: the
  definitions of nccl-tests (``doc/PERFORMANCE.md``), also used by DeepSpeed's
  communication logger.
- exposed communication: median backward time of sync micro-batches minus that
  of no-sync micro-batches, i.e. the all-reduce time not hidden behind the
  backward computation; overlap = 1 - exposed / all-reduce time per sync.
- estimated saving: skipped syncs x exposed time (and x full all-reduce
  time, an upper bound); the measured saving comes from an A/B run
  (:class:`ABSwitch`) that alternates windows with and without ``no_sync``.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch

GB = 1e9


def _allreduce_mean_hook(process_group, bucket):
    """DDP's default hook: all-reduce the bucket, divide by the world size."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(process_group, bucket)


def _profiled_hook(profiler: "CommProfiler", bucket):
    """The hook DDP calls: times the wrapped hook's future for one bucket."""
    return profiler._on_bucket(bucket)


def _busy_seconds(calls) -> float:
    """Length of the union of the calls' [start, start + seconds] intervals."""
    total, end = 0.0, float("-inf")
    for c in sorted(calls, key=lambda c: c["start"]):
        lo, hi = c["start"], c["start"] + c["seconds"]
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def _median(xs):
    return statistics.median(xs) if xs else None


def _spread(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}


class CommProfiler:
    """Records every DDP gradient all-reduce and the phase times of each micro-batch.

    Use it three ways:

    - ``with CommProfiler(accelerator, model) as prof:`` around any loop
      (all-reduce records only; each sync's buckets form one group);
    - ``train_loop(..., profiler=prof)``: also phase timing, tagged with the
      optimizer step and micro-batch index;
    - the train command's ``--profile_comm`` flag.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the prepared model; without DDP (one process) nothing is
            registered and the report shows zero communication.
        hook: a DDP comm hook ``hook(state, bucket) -> Future`` to wrap, such
            as ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``;
            default: plain all-reduce with mean (DDP's own default).
        hook_state: the state passed to ``hook`` (default: None, the world group).
        trace_dir: if given, a ``torch.profiler`` Chrome trace per process is
            written there on exit (``trace_rank{R}.json``, opens in Perfetto),
            with ranges named ``micro_batch_{i}/{sync|no_sync}``. It covers
            ``trace_steps`` optimizer steps after ``trace_wait`` skipped and one
            warm-up step (a trace of every step grows by megabytes per step).
        trace_steps: optimizer steps recorded in the trace.
        trace_wait: optimizer steps before the trace warms up; keep the trace
            clear of A/B windows, whose timing it would disturb.
        synchronize: call ``torch.cuda.synchronize()`` at phase boundaries on
            CUDA so phase times are real (default: on when the device is CUDA).

    Raises:
        RuntimeError: the model already has a comm hook (DDP allows only one):
            pass that hook as ``hook=`` instead.

    Notes:
        Bytes are the gradient bucket's size (``numel x element size``); a
        compression hook sends fewer bytes over the wire. On CUDA the latency
        is taken when the all-reduce future's callback runs; checked on CPU/gloo only.
    """

    def __init__(self, accelerator, model, *, hook=None, hook_state=None, trace_dir=None, trace_steps=2,
                 trace_wait=1, synchronize=None):
        self.accelerator, self.model = accelerator, model
        self.hook, self.hook_state = hook or _allreduce_mean_hook, hook_state
        self.trace_dir, self.trace_steps, self.trace_wait = trace_dir, trace_steps, trace_wait
        self.world_size = accelerator.num_processes
        self.distributed = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.synchronize = accelerator.device.type == "cuda" if synchronize is None else synchronize
        self.enabled = True
        self.calls: list[dict] = []  # one per bucket all-reduce
        self.micro_batches: list[dict] = []  # one per micro-batch (train_loop callback only)
        self.step_records: list[dict] = []  # one per optimizer step
        self.mode = "sync_each_batch" if accelerator.gradient_state.plugin_kwargs.get("sync_each_batch") else "no_sync"
        self._lock = threading.Lock()
        self._step, self._micro, self._sync_group = 0, 0, 0
        self._t = {}
        self._range = None
        self._torch_profiler = None
        self._attached = False

    # ---- attaching -------------------------------------------------------------------------
    def attach(self) -> "CommProfiler":
        """Register the comm hook (DDP only) and start the trace if requested; idempotent."""
        if self._attached:
            return self
        if self.distributed:
            try:
                self.model.register_comm_hook(state=self, hook=_profiled_hook)
            except RuntimeError as exc:
                raise RuntimeError(
                    "this DDP model already has a comm hook and DDP allows only one; pass that hook to "
                    "CommProfiler(..., hook=<hook>, hook_state=<state>) so the profiler wraps it"
                ) from exc
        if self.trace_dir:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            schedule = torch.profiler.schedule(wait=self.trace_wait, warmup=1, active=self.trace_steps, repeat=1)
            self._torch_profiler = torch.profiler.profile(activities=acts, schedule=schedule)
            self._torch_profiler.__enter__()
        self._attached = True
        return self

    def detach(self) -> None:
        """Stop the trace and write it. (DDP cannot unregister a hook: keep ``enabled`` off to stop recording.)"""
        self.enabled = False
        if self._torch_profiler is not None:
            self._torch_profiler.__exit__(None, None, None)
            self._write_trace()
            self._torch_profiler = None

    def __enter__(self):
        return self.attach()

    def __exit__(self, *exc):
        self.detach()
        return False

    # ---- the comm hook ---------------------------------------------------------------------
    def _on_bucket(self, bucket):
        if not self.enabled:
            return self.hook(self.hook_state, bucket)
        buf = bucket.buffer()
        start = time.perf_counter()
        fut = self.hook(self.hook_state, bucket)
        rec = {
            "step": self._step,
            "micro_batch": self._micro,
            "sync": self._sync_group,
            "mode": self.mode,
            "bucket": bucket.index(),
            "bytes": buf.numel() * buf.element_size(),
            "start": start,
        }
        if bucket.is_last():
            self._sync_group += 1

        def done(f):
            rec["seconds"] = time.perf_counter() - start
            with self._lock:
                self.calls.append(rec)
            return f.value()

        return fut.then(done)

    # ---- train_loop callbacks --------------------------------------------------------------
    def _now(self):
        if self.synchronize:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self, state):
        self.attach()
        self._t["step_start"] = self._now()

    def on_micro_batch_begin(self, state):
        self._step, self._micro = state.step, state.micro_step
        if not self.enabled:
            return
        if self._torch_profiler is not None:
            name = f"micro_batch_{state.micro_step}/{'sync' if state.sync else 'no_sync'}"
            self._range = torch.profiler.record_function(name)
            self._range.__enter__()
        self._t["begin"] = self._now()

    def on_forward_end(self, state):
        if self.enabled:
            self._t["forward"] = self._now()

    def on_backward_end(self, state):
        if not self.enabled:
            return
        end = self._now()
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self.micro_batches.append({
            "step": state.step, "micro_batch": state.micro_step, "sync": state.sync, "mode": self.mode,
            "forward_seconds": self._t["forward"] - self._t["begin"],
            "backward_seconds": end - self._t["forward"],
        })

    def on_step_begin(self, state):
        if self.enabled:
            self._t["optimizer"] = self._now()

    def on_step_end(self, state):
        now = self._now() if self.enabled else None
        if self._torch_profiler is not None:
            self._torch_profiler.step()  # advances the trace schedule by one optimizer step, enabled or not
        if not self.enabled:
            self._t["step_start"] = time.perf_counter()
            return
        self.step_records.append({
            "step": state.step - 1, "mode": self.mode,
            "optimizer_seconds": now - self._t["optimizer"],
            "step_seconds": now - self._t["step_start"],
        })
        self._t["step_start"] = self._now()  # after the trace step, whose cost belongs to no window

    def on_train_end(self, state):
        self.detach()

    # ---- results ---------------------------------------------------------------------------
    def local_summary(self) -> dict:
        """This process's figures (seconds, bytes, GB/s) for windows in the run's own mode.

        Keys: ``allreduce_calls``, ``allreduce_bytes``, ``allreduce_seconds``
        (sum of bucket latencies), ``syncs`` (backward passes that all-reduced),
        ``allreduce_calls_per_step``, ``allreduce_bytes_per_step``,
        ``allreduce_calls_per_sync`` (median buckets per sync: DDP rebuilds its
        buckets after the first iteration, so the first sync may differ),
        ``seconds_per_sync`` (time with at least one bucket all-reduce in
        flight, median over syncs; the union of the bucket intervals, so
        queued buckets are not counted twice and the gaps between buckets are
        left out), ``algbw_GBps`` = bytes / that time summed over syncs, ``busbw_GBps``, ``skipped_syncs``, ``exposed_comm_seconds``
        (per sync), ``overlap_fraction``, ``estimated_seconds_saved`` (whole run,
        exposed-time estimate), ``estimated_seconds_saved_upper`` (full latency),
        ``forward_seconds``, ``backward_seconds_sync``, ``backward_seconds_no_sync``,
        ``optimizer_seconds`` (medians per micro-batch / step).
        """
        with self._lock:
            calls = [c for c in self.calls if c["mode"] == self.mode and "seconds" in c]
        mbs = [m for m in self.micro_batches if m["mode"] == self.mode]
        steps = [s for s in self.step_records if s["mode"] == self.mode]
        by_sync: dict[int, list] = {}
        for c in calls:
            by_sync.setdefault(c["sync"], []).append(c)
        busy = [_busy_seconds(g) for g in by_sync.values()]
        n_bytes, seconds = sum(c["bytes"] for c in calls), sum(c["seconds"] for c in calls)
        busy_total = sum(busy)
        algbw = n_bytes / busy_total / GB if busy_total > 0 else 0.0
        n = self.world_size
        bwd_sync = _median([m["backward_seconds"] for m in mbs if m["sync"]])
        bwd_nosync = _median([m["backward_seconds"] for m in mbs if not m["sync"]])
        per_sync = _median(busy)
        exposed = max(bwd_sync - bwd_nosync, 0.0) if (bwd_sync is not None and bwd_nosync is not None and calls) else None
        skipped = sum(1 for m in mbs if not m["sync"]) if self.distributed else 0
        n_steps = len(steps) or len({c["step"] for c in calls}) or 1
        return {
            "world_size": n,
            "mode": self.mode,
            "optimizer_steps": len(steps),
            "micro_batches": len(mbs),
            "allreduce_calls": len(calls),
            "allreduce_bytes": n_bytes,
            "allreduce_seconds": seconds,
            "syncs": len(by_sync),
            "allreduce_calls_per_step": len(calls) / n_steps,
            "allreduce_bytes_per_step": n_bytes / n_steps,
            "allreduce_calls_per_sync": _median([len(g) for g in by_sync.values()]) or 0,
            "seconds_per_sync": per_sync or 0.0,
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * 2 * (n - 1) / n if n > 1 else 0.0,
            "skipped_syncs": skipped,
            "exposed_comm_seconds": exposed if self.distributed else 0.0,
            # Exposed time can exceed the all-reduce's own span: it also holds the wait for slower
            # processes to reach the sync. Overlap is then 0, not negative.
            "overlap_fraction": max(0.0, 1 - exposed / per_sync) if (exposed is not None and per_sync) else None,
            "estimated_seconds_saved": skipped * exposed if exposed is not None else (0.0 if not self.distributed else None),
            "estimated_seconds_saved_upper": skipped * (per_sync or 0.0),
            "estimated_seconds_saved_per_step": (skipped / n_steps * exposed) if exposed is not None else
            (0.0 if not self.distributed else None),
            "forward_seconds": _median([m["forward_seconds"] for m in mbs]),
            "backward_seconds_sync": bwd_sync,
            "backward_seconds_no_sync": bwd_nosync,
            "optimizer_seconds": _median([s["optimizer_seconds"] for s in steps]),
            "seconds_per_step": _median([s["step_seconds"] for s in steps]),
        }

    def summary(self) -> dict:
        """The ``comm`` block: this process's figures plus min/median/max over processes.

        Collective: every process must call it. Top-level values are the main
        process's; ``per_process`` lists each process and ``spread`` the
        min / median / max of every numeric field, so a straggler shows.
        """
        from accelerate.utils import gather_object

        local = self.local_summary()
        everyone = gather_object([local]) if self.world_size > 1 else [local]
        numeric = [k for k, v in local.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out = dict(everyone[0])
        out["per_process"] = everyone
        out["spread"] = {k: _spread([p.get(k) for p in everyone]) for k in numeric}
        return out

    def _write_trace(self) -> None:
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"trace_rank{self.accelerator.process_index}.json")
        tmp = path + ".tmp"
        self._torch_profiler.export_chrome_trace(tmp)
        os.replace(tmp, path)
        self.trace_path = path


class _AlternatingWindows:
    """Callback: after ``warmup_steps`` steps, ``2 * n`` windows alternate a boolean setting.

    Window ``i`` of the alternation runs with the setting at its home value
    when ``i`` is even and flipped when odd, so machine drift hits both sides
    equally. The setting is applied between windows (in ``on_step_end``),
    before the next window's first ``accelerator.accumulate`` reads it.
    ``times[label]`` collects the seconds of each window by side.
    """

    labels = ("off", "on")  # names of the setting's False / True sides

    def __init__(self, n: int, home: bool, warmup_steps: int = 1):
        self.n, self.home, self.warmup = n, home, warmup_steps
        self.times = {label: [] for label in self.labels}
        self._start = None

    def _apply(self, value: bool) -> None:
        raise NotImplementedError

    def _value_for(self, step: int):
        i = step - self.warmup
        if i < 0 or i >= 2 * self.n:
            return None
        return self.home if i % 2 == 0 else not self.home

    def on_train_begin(self, state):
        self._start = time.perf_counter()
        value = self._value_for(0)
        self._apply(self.home if value is None else value)

    def on_step_end(self, state):
        now = time.perf_counter()
        value = self._value_for(state.step - 1)
        if value is not None:
            self.times[self.labels[value]].append(now - self._start)
        nxt = self._value_for(state.step)
        self._apply(self.home if nxt is None else nxt)
        self._start = time.perf_counter()


class ABSwitch(_AlternatingWindows):
    """Callback: alternate windows with and without ``no_sync`` to measure the saving.

    After ``warmup_steps`` optimizer steps, the next ``2 * ab_steps`` windows
    alternate between the run's own mode and the other one (Accelerate's
    ``sync_each_batch`` flag). The update is the same either way (only the
    moment of the all-reduce changes), so these are real training steps.

    Args:
        accelerator: the Accelerator of the run.
        ab_steps: windows measured in each mode.
        profiler: a :class:`CommProfiler`, told the current mode so that its
            records of the other mode are kept apart.
        warmup_steps: steps to run before measuring (first steps are slower).
    """

    labels = ("no_sync", "sync_each_batch")

    def __init__(self, accelerator, ab_steps: int, profiler: CommProfiler | None = None, warmup_steps: int = 1):
        self.kwargs = accelerator.gradient_state.plugin_kwargs
        self.profiler = profiler
        super().__init__(ab_steps, bool(self.kwargs.get("sync_each_batch", False)), warmup_steps)

    def _apply(self, sync_each_batch: bool) -> None:
        self.kwargs["sync_each_batch"] = sync_each_batch
        if self.profiler is not None:
            self.profiler.mode = self.labels[sync_each_batch]

    def summary(self, steps_per_epoch: int | None = None) -> dict:
        """Median seconds per optimizer step each way, the saving and the speedup."""
        sync_each, no_sync = _median(self.times["sync_each_batch"]), _median(self.times["no_sync"])
        out = {"ab_steps_each": min(len(v) for v in self.times.values()),
               "seconds_per_step_sync_each_batch": sync_each, "seconds_per_step_no_sync": no_sync}
        if sync_each is not None and no_sync is not None:
            saved = sync_each - no_sync
            out["measured_seconds_saved_per_step"] = saved
            out["speedup"] = sync_each / no_sync if no_sync > 0 else None
            if steps_per_epoch:
                out["measured_seconds_saved_per_epoch"] = saved * steps_per_epoch
            if self.profiler is not None:
                # Estimated vs measured saving per step, from the no-sync windows' own records.
                est = self.profiler.local_summary().get("estimated_seconds_saved_per_step")
                out["estimated_over_measured"] = est / saved if (est is not None and saved) else None
        return out


class OverheadSwitch(_AlternatingWindows):
    """Callback: alternate windows with the profiler recording and not, to measure its overhead.

    "Off" windows skip every record and timer; the comm hook stays registered
    (DDP cannot unregister one) and passes buckets straight to the wrapped
    all-reduce, so "off" still pays one Python call per bucket.

    Args:
        profiler: the :class:`CommProfiler` to switch.
        n: windows measured each way.
    """

    labels = ("profiler_off", "profiler_on")

    def __init__(self, profiler: CommProfiler, n: int, warmup_steps: int = 1):
        self.profiler = profiler
        super().__init__(n, True, warmup_steps)

    def _apply(self, enabled: bool) -> None:
        self.profiler.enabled = enabled

    def summary(self) -> dict:
        """Median seconds per optimizer step with the profiler on and off, and their ratio."""
        on, off = _median(self.times["profiler_on"]), _median(self.times["profiler_off"])
        return {"overhead_steps_each": min(len(v) for v in self.times.values()),
                "seconds_per_step_profiler_on": on, "seconds_per_step_profiler_off": off,
                "profiler_overhead_ratio": on / off if on and off else None}


def format_table(comm: dict) -> str:
    """A readable table of a ``comm`` block (main-process figures, spread over processes)."""
    def fmt(v, unit=""):
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:.4g}{unit}"
        return f"{v}{unit}"

    rows = [
        ("all-reduce calls", "allreduce_calls", ""), ("all-reduce calls / step", "allreduce_calls_per_step", ""),
        ("all-reduce calls / sync (buckets)", "allreduce_calls_per_sync", ""),
        ("all-reduce bytes", "allreduce_bytes", " B"), ("all-reduce seconds (sum of buckets)", "allreduce_seconds", " s"),
        ("seconds per sync", "seconds_per_sync", " s"), ("algbw", "algbw_GBps", " GB/s"), ("busbw", "busbw_GBps", " GB/s"),
        ("skipped syncs", "skipped_syncs", ""), ("forward / micro-batch", "forward_seconds", " s"),
        ("backward, sync micro-batch", "backward_seconds_sync", " s"), ("backward, no-sync micro-batch", "backward_seconds_no_sync", " s"),
        ("exposed comm / sync", "exposed_comm_seconds", " s"), ("overlap fraction", "overlap_fraction", ""),
        ("optimizer step", "optimizer_seconds", " s"), ("estimated saved (exposed)", "estimated_seconds_saved", " s"),
        ("estimated saved (full latency)", "estimated_seconds_saved_upper", " s"),
        ("estimated saved / step (exposed)", "estimated_seconds_saved_per_step", " s"),
        ("s/step, sync_each_batch (A/B)", "seconds_per_step_sync_each_batch", " s"),
        ("s/step, no_sync (A/B)", "seconds_per_step_no_sync", " s"),
        ("measured saved / step (A/B)", "measured_seconds_saved_per_step", " s"), ("speedup (A/B)", "speedup", "x"),
        ("estimated / measured saving", "estimated_over_measured", ""),
        ("s/step, profiler on", "seconds_per_step_profiler_on", " s"), ("s/step, profiler off", "seconds_per_step_profiler_off", " s"),
        ("profiler overhead ratio (on / off)", "profiler_overhead_ratio", ""),
    ]
    spread = comm.get("spread", {})
    lines = [f"{'communication (' + str(comm.get('world_size')) + ' processes)':40s} {'main':>12s}  {'min / median / max over processes'}"]
    for label, key, unit in rows:
        if key not in comm:
            continue
        s = spread.get(key)
        spread_txt = f"{fmt(s['min'])} / {fmt(s['median'])} / {fmt(s['max'])}" if s else ""
        lines.append(f"{label:40s} {fmt(comm[key], unit):>12s}  {spread_txt}")
    return "\n".join(lines)

