"""The profiler's part for each engine: which recorder sees the engine's gradient collectives, what the summary says.

:class:`accum_kit.profiler.CommProfiler` is the same under every engine; what
differs is here, one small class per engine, which the run's engine returns
(:meth:`accum_kit.engines.base.Engine.profiler_part`, importing the class
lazily). One process reduces nothing and gets :class:`BucketPart` whatever
its engine (:func:`part_for`). A part knows how to attach its recorder to
the model, attach it again after a detach and detach it; which calls its own
recorder made; the summary's keys (built once: the keys every engine has,
:func:`accum_kit.profiler.report.common_summary`, and its own); and its
figures per optimizer step (the train job's tracker logging).

- :class:`BucketPart`: DDP, through its comm hook (:class:`~accum_kit.profiler.buckets.BucketRecorder`);
  also one process, and a plain model whose loop all-reduces by hand
  (``CommProfiler(..., distributed=True)`` and :meth:`~accum_kit.profiler.CommProfiler.record_allreduce`);
- :class:`CollectivePart`: FSDP2 and HSDP, through every unit's custom all-gather and
  reduce-scatter (:class:`~accum_kit.profiler.collectives.CollectiveRecorder`), with the CPU
  accumulation timer (:class:`~accum_kit.profiler.accumulation.GradAccumulationTimer`);
- :class:`ZeroPart`: DeepSpeed ZeRO, through its communication backend
  (:class:`~accum_kit.profiler.deepspeed_comm.ZeroRecorder`).

The profiler's bucket and collective recorders exist under every engine (a
loop may report its own all-reduces, a test may call the collective
wrappers); a part decides which of them, if any, it registers on the model.
"""

from __future__ import annotations

from .records import of_step
from .report import allreduce_summary, common_summary, figures_of


def part_for(profiler) -> "RecorderPart":
    """The part of ``profiler``'s run: :class:`BucketPart` on one process, else the run's engine's
    (:meth:`accum_kit.engines.base.Engine.profiler_part` of :func:`accum_kit.core.run_plan.run_plan_of`)."""
    if profiler.world_size < 2:  # nothing to reduce: no engine asked (any accelerator-like object works)
        return BucketPart(profiler)
    from ..core.run_plan import run_plan_of

    return run_plan_of(profiler.accelerator).engine.profiler_part(profiler)


class RecorderPart:
    """What every part has; the methods do nothing here and each part overrides what it records.

    Args:
        profiler: the :class:`accum_kit.profiler.CommProfiler` served (its accelerator, model, labels,
            recorders, ``world_size``, ``keep_records``).

    Attributes:
        name: the engine family it serves (``Engine.name``).
        distributed: whether the model synchronises gradients over processes (the profiler's
            ``distributed`` unless it is given).
        hooked: the part registers DDP's comm hook on the model (:class:`BucketPart` of a DDP model).
        replicate_size, shard_size: the mesh the summary's bandwidths use (R and S; 1 and W unsharded).
        accumulation: a :class:`~accum_kit.profiler.accumulation.GradAccumulationTimer` the phase
            timer reads, or None.
    """

    name = "base"

    def __init__(self, profiler):
        self.profiler = profiler
        self.distributed = True
        self.hooked = False
        self.replicate_size, self.shard_size = 1, profiler.world_size
        self.accumulation = None

    def check_hook(self, hook) -> None:
        """Refuse a DDP comm hook (``CommProfiler(hook=...)``) this part has no use for (accepted here)."""

    def attach(self) -> None:
        """Start recording the model's collectives (first :meth:`accum_kit.profiler.CommProfiler.attach`)."""

    def reattach(self) -> None:
        """Record again after :meth:`detach` (a later ``attach``)."""

    def detach(self) -> None:
        """Give back what :meth:`attach` wrapped that must not outlive the profiling."""

    def on_forward_end(self) -> None:
        """After every forward while attached."""

    def calls(self) -> list:
        """The collective records of the part's own recorder (a copy; the profiler's ``collective_calls`` adds them)."""
        return []

    def summary(self, records, tag: str | None) -> dict:
        """This process's summary (see :meth:`accum_kit.profiler.CommProfiler.local_summary`).

        Args:
            records: the profiler's records of its current mode (and ``tag``), raw or aggregated
                (:class:`~accum_kit.profiler.records.ProfileRecords` or :class:`~accum_kit.profiler.figures.Figures`).
            tag: the run label they were selected by (None: every one).
        """
        p = self.profiler
        return common_summary(records, mode=p.mode, world_size=p.world_size, distributed=p.distributed)

    def step_figures(self, step: int) -> dict:
        """The collectives of optimizer step ``step`` (0-based), for a tracker: here the bucket all-reduces
        the profiler recorded, ``{"allreduce_calls": int, "allreduce_bytes": int}`` (bytes of this process)."""
        calls = of_step(self.profiler.calls, step)
        return {"allreduce_calls": len(calls), "allreduce_bytes": sum(c.bytes for c in calls)}


class BucketPart(RecorderPart):
    """DDP: the profiler's :class:`~accum_kit.profiler.buckets.BucketRecorder` as the model's comm hook.

    Its summary is :func:`accum_kit.profiler.report.local_summary`'s (the common keys and DDP's
    all-reduce keys). On one process nothing is registered and the report shows zero
    communication; a plain model whose loop all-reduces by hand reports each call through
    :meth:`~accum_kit.profiler.CommProfiler.record_allreduce` (pass ``distributed=True``).

    Attributes:
        hooked: the model is DDP (``torch.compile(DDP(model))`` too, which forwards its attributes),
            so :meth:`attach` registers the comm hook; ``distributed`` follows it.
    """

    name = "ddp"

    def __init__(self, profiler):
        import torch

        super().__init__(profiler)
        model = profiler.model
        self.hooked = isinstance(getattr(model, "_orig_mod", model), torch.nn.parallel.DistributedDataParallel)
        self.distributed = self.hooked

    def attach(self) -> None:
        """Register the comm hook on a DDP model. DDP cannot unregister one: after :meth:`detach` it stays,
        passing the buckets straight to the wrapped hook while the profiler is disabled.

        Raises:
            RuntimeError: the model has a comm hook already (see :meth:`BucketRecorder.register`).
        """
        if self.hooked:
            self.profiler.buckets.register(self.profiler.model)

    def summary(self, records, tag: str | None) -> dict:
        """The common keys and :func:`accum_kit.profiler.report.allreduce_summary`'s."""
        p = self.profiler
        f = figures_of(records)
        return {**common_summary(f, mode=p.mode, world_size=p.world_size, distributed=p.distributed),
                **allreduce_summary(f, world_size=p.world_size, distributed=p.distributed)}


class CollectivePart(RecorderPart):
    """FSDP2 and HSDP: the profiler's :class:`~accum_kit.profiler.collectives.CollectiveRecorder` wraps every
    unit's all-gather and reduce-scatter (and, on a 2-D mesh, the all-reduce across replicas).

    Its summary is the common keys and :func:`accum_kit.profiler.sharded.sharded_summary`'s (which
    redefines ``syncs``, ``exposed_comm_seconds`` and the saving estimates for reduce-scatters), not
    DDP's all-reduce keys: FSDP2 reduce-scatters, and their "upper" estimate assumes no local work
    around the collective, which FSDP2's copy-in contradicts. On CPU autograd's add into the held
    unsharded gradients is timed too (a term of the ``no_sync`` estimate).

    Args:
        profiler: as :class:`RecorderPart`.
        mesh: the run's :class:`accum_kit.engines.mesh.Mesh` (replicas R x shard group S).

    Raises:
        ValueError: from :meth:`check_hook`, when a DDP comm hook is given.
    """

    name = "fsdp2"

    def __init__(self, profiler, mesh):
        super().__init__(profiler)
        self.replicate_size = mesh.replicate
        self.shard_size = profiler.world_size // self.replicate_size
        if profiler.accelerator.device.type == "cpu":  # measured on CPU only (a CUDA add is asynchronous)
            from .accumulation import GradAccumulationTimer

            self.accumulation = GradAccumulationTimer(lambda: profiler.labels.enabled)

    def check_hook(self, hook) -> None:
        """Raises ValueError when ``hook`` is given: FSDP2 has no comm hook."""
        if hook is not None:
            raise ValueError("hook= wraps a DDP comm hook, and FSDP2 has none; the profiler records FSDP2's "
                             "all-gathers and reduce-scatters through FSDPModule.set_custom_all_gather / "
                             "set_custom_reduce_scatter")

    def attach(self) -> None:
        """Wrap every unit's collectives and post-backward hook (they stay, passing calls through when disabled).

        Raises:
            ValueError: the model has no FSDP2 unit.
        """
        self.profiler.collectives.register(self.profiler.model)

    def reattach(self) -> None:
        """Wrap ``torch.distributed.all_reduce`` again (the replicate group's calls; given back by :meth:`detach`)."""
        self.profiler.collectives.hook_all_reduce()

    def detach(self) -> None:
        """Give ``torch.distributed.all_reduce`` back (the units' wrappers stay)."""
        self.profiler.collectives.unregister()

    def on_forward_end(self) -> None:
        """Hook the accumulation timer on the units' unsharded parameters, which exist from the first forward."""
        if self.accumulation is not None:
            self.accumulation.install(self.profiler.collectives.groups)

    def summary(self, records, tag: str | None) -> dict:
        """The common keys, with those of :func:`accum_kit.profiler.sharded.sharded_summary` over them."""
        from .sharded import sharded_summary

        p = self.profiler
        f = figures_of(records)
        return {**common_summary(f, mode=p.mode, world_size=p.world_size, distributed=p.distributed),
                **sharded_summary(f, shard_size=self.shard_size, replicate_size=self.replicate_size,
                                  units=p.collectives.unit_info())}

    def step_figures(self, step: int) -> dict:
        """``reduce_scatter_calls`` / ``_bytes`` and ``all_gather_calls`` / ``_bytes`` of optimizer step ``step``
        (bytes as the recorder counts them); with replicas (R > 1) also ``all_reduce_calls`` / ``_bytes``
        (gradient shards all-reduced across them) and ``shard_seconds`` / ``replicate_seconds`` (seconds in
        each mesh dimension's collectives)."""
        coll = of_step(self.profiler.collectives.calls, step)
        replicas = self.replicate_size > 1
        out = {}
        for kind in ["reduce_scatter", "all_gather"] + (["all_reduce"] if replicas else []):
            mine = [c for c in coll if c.kind == kind]
            out[f"{kind}_calls"], out[f"{kind}_bytes"] = len(mine), sum(c.bytes for c in mine)
        for group in ["shard", "replicate"] if replicas else []:
            out[f"{group}_seconds"] = sum(c.seconds for c in coll if c.group == group)
        return out


class ZeroPart(RecorderPart):
    """DeepSpeed ZeRO: a :class:`~accum_kit.profiler.deepspeed_comm.ZeroRecorder` on DeepSpeed's communication
    backend, timing the ZeRO optimizer's reduction path too.

    Its summary is the common keys and :func:`accum_kit.profiler.deepspeed_comm.zero_summary`'s, per
    kind from the raw records kept (its records are kept here, not in the running aggregates).
    Per step a tracker gets the base part's bucket figures (the loop's own all-reduces: none).

    Args:
        profiler: as :class:`RecorderPart`; its model is the ``DeepSpeedEngine``.
        stage: the ZeRO stage (reported as ``zero_stage``).
    """

    name = "deepspeed"

    def __init__(self, profiler, stage: int):
        from .deepspeed_comm import ZeroRecorder

        super().__init__(profiler)
        self.stage = stage
        self.recorder = ZeroRecorder(profiler.labels, profiler.keep_records)
        self.recorder.watch(getattr(profiler.model, "optimizer", None))  # the engine's ZeRO optimizer

    def attach(self) -> None:
        """Wrap the communication backend's methods and the optimizer's reduction path.

        Raises:
            RuntimeError: DeepSpeed's communication backend is not initialised (prepare the model first).
        """
        self.recorder.register()

    def reattach(self) -> None:
        """As :meth:`attach` (registering is idempotent)."""
        self.recorder.register()

    def detach(self) -> None:
        """Give the backend and the optimizer their own methods back."""
        self.recorder.unregister()

    def calls(self) -> list:
        return self.recorder.calls

    def summary(self, records, tag: str | None) -> dict:
        """The common keys and :func:`accum_kit.profiler.deepspeed_comm.zero_summary`'s (per optimizer step of
        the raw step records kept, of the profiler's mode and ``tag``)."""
        from .deepspeed_comm import zero_summary

        p = self.profiler

        def mine(records_of_kind: list) -> list:
            return [c for c in records_of_kind if c.mode == p.mode and (tag is None or c.tag == tag)]

        steps = len(p.records(mode=p.mode, tag=tag).steps)
        return {**common_summary(records, mode=p.mode, world_size=p.world_size, distributed=p.distributed),
                **zero_summary(mine(self.recorder.calls), steps=steps, world_size=p.world_size, stage=self.stage,
                               reductions=mine(self.recorder.reductions), inside=mine(self.recorder.inside_reduction))}
