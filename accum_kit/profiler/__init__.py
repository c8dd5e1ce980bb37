"""Communication profiler: what DDP's all-reduce and FSDP2's collectives cost, and what ``no_sync`` saves.

:class:`CommProfiler` is the front: it records, for every gradient bucket
DDP all-reduces (or, under FSDP2, every all-gather and reduce-scatter of
every unit; under DeepSpeed, every collective of its communication backend),
the optimizer step and micro-batch it belongs to, its size in bytes and its
latency in seconds; used as a :func:`accum_kit.train_loop` callback it also
times the forward, backward and optimizer phases of every micro-batch,
tagged sync or no-sync. What differs by engine is the engine's part
(:mod:`.parts`, returned by :meth:`accum_kit.engines.base.Engine.profiler_part`).
The pieces, each usable on its own:

- :mod:`.parts`: one part per engine (which recorder it attaches, its summary keys);
- :mod:`.buckets`: :class:`BucketRecorder`, the DDP comm hook;
- :mod:`.collectives`: :class:`CollectiveRecorder`, FSDP2's custom all-gather
  and reduce-scatter objects; :mod:`.sharded`: their report;
- :mod:`.deepspeed_comm`: :class:`~accum_kit.profiler.deepspeed_comm.ZeroRecorder`, DeepSpeed's
  communication backend, and its report;
- :mod:`.phases`: :class:`PhaseTimer`, the phase timing loop callback;
- :mod:`.trace`: :class:`StepTrace`, a ``torch.profiler`` Chrome trace through
  Accelerate's ``ProfileKwargs`` / ``accelerator.profile()``;
- :mod:`.records`: the plain records and :class:`Labels` (mode, tag);
- :mod:`.aggregates`: the whole run's running aggregates (bounded memory),
  with :mod:`.quantiles` (count / sum / min / max and quantile estimates);
  :mod:`.figures`: what the summaries are computed from, from either;
- :mod:`.report`: summaries from records (definitions of algbw, busbw,
  exposed time, estimated saving there) and :func:`format_table`;
- :mod:`.switches`: :class:`ABSwitch` and :class:`OverheadSwitch`;
- :mod:`.mesh_collectives`: :class:`~accum_kit.profiler.mesh_collectives.MeshCollectiveCounter`, every
  collective (DTensor's included) by device-mesh dimension, per micro-batch and window; :mod:`.mesh_report`: its report.
"""

from __future__ import annotations

from .. import checks
from ..core.callbacks import LoopCallback
from ..compat import sync_each_batch
from .aggregates import RunningAggregates
from .buckets import BucketRecorder, allreduce_mean_hook
from .collectives import CollectiveRecorder
from .mesh_collectives import MeshCollectiveCounter, mesh_collective_counter, wants_mesh_counter
from .parts import part_for
from .phases import PhaseTimer
from .records import COLLECTIVES, KEEP_RECORDS, MODES, BucketCall, CollectiveCall, Labels, MicroBatchTimes, PostBackwardTime, ProfileRecords, StepTimes
from .report import format_table, local_summary, summarize_processes
from .sharded import sharded_summary
from .switches import ABSwitch, AlternatingWindows, OverheadSwitch
from .trace import StepTrace

__all__ = [
    "ABSwitch", "AlternatingWindows", "BucketCall", "BucketRecorder", "COLLECTIVES", "CollectiveCall",
    "CollectiveRecorder", "CommProfiler", "KEEP_RECORDS", "Labels", "MODES", "MeshCollectiveCounter", "MicroBatchTimes",
    "OverheadSwitch", "PhaseTimer", "ProfileRecords", "RunningAggregates", "StepTimes", "StepTrace",
    "allreduce_mean_hook", "format_table", "local_summary", "mesh_collective_counter", "sharded_summary",
    "summarize_processes",
]


class CommProfiler(LoopCallback):
    """Records every DDP gradient all-reduce (FSDP2: all-gather and reduce-scatter; DeepSpeed: its collectives)
    and the phase times.

    Memory stays bounded whatever the run's length: every record is folded
    into running aggregates (:class:`RunningAggregates`), from which the
    summaries come, and only the most recent ``keep_records`` raw records of
    each kind are kept (:meth:`records`).

    Use it three ways:

    - ``with CommProfiler(accelerator, model) as prof:`` around any loop
      (all-reduce records only; each sync's buckets form one group);
    - ``train_loop(..., profiler=prof)``: also phase timing, tagged with the
      optimizer step and micro-batch index;
    - the train command's ``--profile_comm`` flag.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the prepared model. The run's engine says what is recorded of it
            (its part, :mod:`.parts`): a DDP model's buckets through the comm hook;
            under FSDP2 every unit's all-gather and reduce-scatter objects
            (:class:`CollectiveRecorder`), the summary then having the keys of
            :func:`accum_kit.profiler.sharded.sharded_summary` instead of DDP's
            all-reduce ones; under DeepSpeed its communication backend (those of
            :func:`accum_kit.profiler.deepspeed_comm.zero_summary`). One process, or
            a model that is not DDP: nothing is registered and the report shows zero
            communication.
        hook: a DDP comm hook ``hook(state, bucket) -> Future`` to wrap, such
            as ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``;
            default: plain all-reduce with mean (DDP's own default). Not for FSDP2.
        hook_state: the state passed to ``hook`` (default: None, the world group).
        trace_dir: if given, a ``torch.profiler`` Chrome trace per process is
            written there at the end (``trace_rank{R}.json``, opens in
            Perfetto), with ranges named ``micro_batch_{i}/{sync|no_sync}``;
            see :class:`StepTrace`.
        trace_steps: optimizer steps recorded in the trace.
        trace_wait: optimizer steps before the trace's one warm-up step; keep
            the trace clear of A/B windows, whose timing it would disturb.
        synchronize: call ``torch.cuda.synchronize()`` at phase boundaries on
            CUDA so phase times are real (default: on when the device is CUDA).
        distributed: whether the loop synchronises gradients over processes;
            default: the engine's part says (True for a DDP, FSDP2 or DeepSpeed model
            on several processes). Pass True for a plain model whose
            loop all-reduces the gradients itself, and report each of those
            all-reduces with :meth:`record_allreduce`.
        keep_records: raw records of each kind kept, the most recent
            (default :data:`KEEP_RECORDS`; None: every one, for short runs that
            read them all, such as the bench).
        by_mesh_dim: count every collective by device-mesh dimension
            (:func:`accum_kit.profiler.mesh_collectives.mesh_collective_counter`, the mesh being
            ``accelerator.torch_device_mesh``): the summary then has a ``by_mesh_dim`` block and
            ``no_sync_saving_scope``. Default (None): on when the mesh has a ``tp``, ``cp`` or ``sp``
            dimension; True: on (without a mesh every collective counts as ``"dp"``); False: off.

    Attributes:
        part: the engine's :class:`accum_kit.profiler.parts.RecorderPart`.
        is_ddp: the part registers DDP's comm hook on the model (the model is DDP).
        replicate_size, shard_size: the mesh of the summary's bandwidths (HSDP's R and S; 1 and W otherwise).
        accumulation: the part's gradient accumulation timer (FSDP2 on CPU), or None.
        mode: ``"no_sync"`` or ``"sync_each_batch"``, stamped on new records
            (initially the accelerator's ``sync_each_batch`` setting; the
            :class:`ABSwitch` changes it). Summaries cover the current mode.
        tag: a free-form run label stamped on new records (default None), for
            one profiler that serves several runs; see :meth:`records`.
        enabled: False makes the recorders skip everything (the hook stays).
        trace_path: the trace file written, or None.
        aggregates: the :class:`RunningAggregates` of every record.
        mesh: the :class:`~accum_kit.profiler.mesh_collectives.MeshCollectiveCounter`, or None (``by_mesh_dim``).

    Raises:
        RuntimeError: the model already has a comm hook (DDP allows only one):
            pass that hook as ``hook=`` instead.
        ValueError: ``hook`` given for an FSDP2 model (FSDP2 has no comm hook).
    """

    def __init__(self, accelerator, model, *, hook=None, hook_state=None, trace_dir=None, trace_steps=2,
                 trace_wait=1, synchronize=None, distributed=None, keep_records: int | None = KEEP_RECORDS,
                 by_mesh_dim: bool | None = None):
        self.accelerator, self.model = accelerator, model
        self.world_size = accelerator.num_processes
        self.keep_records = keep_records
        self.labels = Labels(mode=MODES[sync_each_batch(accelerator)])
        self.aggregates = RunningAggregates()
        sink = self.aggregates.add
        self.buckets = BucketRecorder(self.labels, hook, hook_state, keep_records=keep_records, sink=sink)
        self.collectives = CollectiveRecorder(self.labels, keep_records=keep_records, sink=sink)
        self.part = part_for(self)  # the engine's: what is attached to the model, what the summary says
        self.part.check_hook(hook)
        self.distributed = self.part.distributed if distributed is None else bool(distributed)
        if synchronize is None:
            synchronize = accelerator.device.type == "cuda"
        self.accumulation = self.part.accumulation
        self.phases = PhaseTimer(self.labels, synchronize=synchronize, keep_records=keep_records, sink=sink,
                                 accumulation=self.accumulation)
        self.trace = StepTrace(accelerator, trace_dir, trace_steps, trace_wait) if trace_dir else None
        self.mesh = (mesh_collective_counter(accelerator, labels=self.labels, keep_records=keep_records)
                     if wants_mesh_counter(accelerator, by_mesh_dim) else None)
        self._attached = False
        self._paused = False  # recording paused for a static-graph DDP model's priming sync

    @property
    def is_ddp(self) -> bool:
        """Whether the part registers DDP's comm hook on the model (the model is DDP)."""
        return self.part.hooked

    @property
    def replicate_size(self) -> int:
        """R, processes holding the same shard (HSDP's replicas; 1 otherwise)."""
        return self.part.replicate_size

    @property
    def shard_size(self) -> int:
        """S, processes in each all-gather and reduce-scatter (the world unless HSDP)."""
        return self.part.shard_size

    # ---- labels --------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.labels.mode

    @mode.setter
    def mode(self, value: str) -> None:
        checks.one_of("mode", value, MODES)  # a run label goes to ``tag``
        self.labels.mode = value

    @property
    def tag(self) -> str | None:
        return self.labels.tag

    @tag.setter
    def tag(self, value: str | None) -> None:
        self.labels.tag = value

    @property
    def enabled(self) -> bool:
        return self.labels.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.labels.enabled = value

    @property
    def trace_path(self) -> str | None:
        return self.trace.path if self.trace is not None else None

    # ---- attaching -------------------------------------------------------------------------
    def attach(self) -> "CommProfiler":
        """Attach the engine's part (DDP: the comm hook; FSDP2: the collective recorders; DeepSpeed: its
        communication backend) and start the trace if asked; idempotent (a later call re-attaches what
        :meth:`detach` gave back)."""
        if self._attached:
            self.part.reattach()
            return self
        self.part.attach()
        if self.trace is not None:
            self.trace.start()
        self._attached = True
        return self

    def detach(self) -> None:
        """Stop recording and write the trace; the part gives back what must not outlive the profiling (the DDP
        hook and FSDP2 recorders stay, passing calls through; HSDP's wrapped ``torch.distributed.all_reduce``
        and DeepSpeed's backend methods are given back)."""
        self.enabled = False
        self.part.detach()
        if self.mesh is not None:
            self.mesh.stop()
        if self.trace is not None:
            self.trace.stop()

    def __enter__(self):
        return self.attach()

    def __exit__(self, *exc):
        self.detach()
        return False

    def record_allreduce(self, nbytes: int, start: float, seconds: float, last: bool) -> None:
        """Record a gradient all-reduce the loop made itself (no DDP); the signature of
        :data:`accum_kit.reference.manual_allreduce.OnCall`. See :meth:`BucketRecorder.record_call`."""
        self.buckets.record_call(nbytes, start, seconds, last)

    # ---- loop hooks: the phase timer, with the trace's ranges and steps around it ----------
    def on_train_begin(self, state):
        self.attach()
        self.phases.on_train_begin(state)

    def on_micro_batch_begin(self, state):
        if getattr(state, "forced_sync", False) and self.enabled:  # a static-graph DDP model's priming sync: no sync of the mode
            self.enabled, self._paused = False, True
        if self.trace is not None and self.enabled:
            self.trace.on_micro_batch_begin(state)
        self.phases.on_micro_batch_begin(state)
        if self.mesh is not None:  # last: the forward's collectives from here
            self.mesh.on_micro_batch_begin(state)

    def on_forward_end(self, state):
        if self.mesh is not None:
            self.mesh.on_forward_end(state)
        if self._attached:
            self.part.on_forward_end()
        self.phases.on_forward_end(state)

    def on_backward_end(self, state):
        if self.mesh is not None:
            self.mesh.on_backward_end(state)
        self.phases.on_backward_end(state)  # timed before the range closes
        if self.trace is not None:
            self.trace.close_range()
        if self._paused:
            self.enabled, self._paused = True, False

    def on_step_begin(self, state):
        self.phases.on_step_begin(state)
        if self.mesh is not None:
            self.mesh.on_step_begin(state)

    def on_step_end(self, state):
        if self.mesh is not None:  # before the switches change the labels for the next window
            self.mesh.on_step_end(state)
        self.collectives.flush()  # CUDA: the step's collectives into the aggregates (bounded pending events)
        self.phases.on_step_end(state)
        if self.trace is not None:
            self.trace.on_step_end(state)  # advances the trace schedule, enabled or not
            self.phases.restart_step_clock()  # the trace step's cost belongs to no window

    def on_train_end(self, state):
        self.detach()

    # ---- results ---------------------------------------------------------------------------
    @property
    def calls(self) -> list[BucketCall]:
        return self.buckets.calls

    @property
    def collective_calls(self) -> list[CollectiveCall]:
        """The collectives recorded: the collective recorder's (FSDP2's all-gathers and reduce-scatters) and the
        part's own recorder's (DeepSpeed's); empty under DDP."""
        return self.collectives.calls + self.part.calls()

    @property
    def micro_batches(self) -> list[MicroBatchTimes]:
        """The most recent micro-batch records (a copy)."""
        return list(self.phases.micro_batches)

    @property
    def step_records(self) -> list[StepTimes]:
        """The most recent optimizer-step records (a copy)."""
        return list(self.phases.steps)

    def records(self, *, mode: str | None = None, tag: str | None = None) -> ProfileRecords:
        """The raw records kept (the last ``keep_records`` of each kind), or those of one ``mode`` and / or ``tag``."""
        return ProfileRecords(self.calls, self.micro_batches, self.step_records, self.collective_calls,
                              self.collectives.post_backwards).select(mode=mode, tag=tag)

    def local_summary(self, tag: str | None = None, *, from_records: bool = False) -> dict:
        """This process's figures for the records of the current ``mode`` (and of ``tag``, if given), whole run.

        The engine's part builds it (:meth:`accum_kit.profiler.parts.RecorderPart.summary`): the keys of
        :func:`accum_kit.profiler.report.common_summary`, and DDP's all-reduce ones
        (:func:`accum_kit.profiler.report.allreduce_summary`), or under FSDP2 those of
        :func:`accum_kit.profiler.sharded.sharded_summary` (``syncs`` are then backward passes that
        reduce-scattered), or under DeepSpeed those of :func:`accum_kit.profiler.deepspeed_comm.zero_summary`
        (from its raw records kept). Computed from the running
        aggregates (medians exact up to 2,048 samples, then within 1 %: see :mod:`.quantiles`);
        ``from_records=True`` computes them from the raw records kept instead, which cover the
        whole run only while it made fewer than ``keep_records`` of each kind.
        """
        self.collectives.flush()  # CUDA-timed collectives reach the aggregates only when flushed
        records = (self.records(mode=self.mode, tag=tag) if from_records
                   else self.aggregates.figures(mode=self.mode, tag=tag))
        out = self.part.summary(records, tag)
        if self.mesh is not None:  # the counter's own running totals (no raw-record variant)
            out["by_mesh_dim"] = self.mesh.summary(mode=self.mode, tag=tag)
            out["no_sync_saving_scope"] = out["by_mesh_dim"]["no_sync_scope"]["note"]
        return out

    def step_figures(self, step: int) -> dict:
        """The collectives of optimizer step ``step`` (0-based) as the engine's part counts them, for a tracker:
        DDP ``allreduce_calls`` / ``allreduce_bytes``; FSDP2 ``reduce_scatter_*`` and ``all_gather_*`` (and
        under HSDP ``all_reduce_*``, ``shard_seconds``, ``replicate_seconds``); see
        :meth:`accum_kit.profiler.parts.RecorderPart.step_figures`; with ``by_mesh_dim`` also ``mesh_<dim>_calls`` /
        ``mesh_<dim>_bytes`` (:meth:`~accum_kit.profiler.mesh_collectives.MeshCollectiveCounter.step_figures`).
        Reads the recent records from the newest back."""
        out = self.part.step_figures(step)
        if self.mesh is not None:
            out.update(self.mesh.step_figures(step))
        return out

    def summary(self, tag: str | None = None) -> dict:
        """The ``comm`` block: :meth:`local_summary` of every process, min / median / max over them.

        Collective: every process must call it. See :func:`summarize_processes`.
        """
        return summarize_processes(self.local_summary(tag), self.world_size)
