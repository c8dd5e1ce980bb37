"""Every collective of a micro-batch and of a window, by the device-mesh dimension its process group belongs to.

Under data x tensor x context parallelism the collectives of one optimizer step
run on different process groups: FSDP2's all-gathers and reduce-scatters (and
HSDP's all-reduces) on the data-parallel dimensions, DTensor's activation
all-reduces on ``tp``, the sequence all-to-alls on ``cp``. ``no_sync`` defers
only the first kind. :class:`MeshCollectiveCounter` counts, for every micro-batch
and window (optimizer step), the calls and bytes of every collective per mesh
dimension, kind and phase, through one ``TorchDispatchMode``
(:func:`accum_kit.compat.functional_collectives.collective_mode`) active during
each micro-batch's forward and backward and the window's step: it sees DTensor's
functional collectives (``torch.ops._c10d_functional.*``, which never pass through
``torch.distributed.*``) and the c10d operators every ``torch.distributed`` call
reaches (FSDP2, DDP's reducer, DeepSpeed's ``deepspeed.comm``), where they are issued.

Engine-blind: the mesh is ``accelerator.torch_device_mesh`` (:func:`mesh_collective_counter`);
each group is named by the first dimension of :data:`DIM_ORDER` whose process group it is
(Accelerate's dims ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` and its flattened ``dp_shard_cp``,
``dp_cp``, ``dp``; when two of them share one group, as a flattened dimension of one dimension
does, the earlier name is used). A group of no dimension is ``"world"`` when it is the default
group, else ``"other"``. Without a mesh every group is ``"dp"``: everything is data-parallel.

Phases (:data:`PHASES`): ``forward``, ``before_backward``, ``backward`` (inside autograd's
backward), ``step``. Classes (:data:`CLASSES`, :func:`classify`): ``gradient_sync`` (an
all-reduce or reduce-scatter on a data-parallel dimension inside a backward: what ``no_sync``
defers), ``parameter_gather`` (an all-gather on a data-parallel dimension: FSDP2 unsharding
parameters), ``tensor_parallel`` (any collective on ``tp`` in a micro-batch: activations, and
DTensor's reductions of tp-replicated parameters' gradients), ``context_parallel`` (on ``cp`` /
``sp``: the sequence exchange), ``step`` (any collective between the window's last backward and
the end of its optimizer step: norms for clipping, the loss's reduction) and ``other``.

Checked: tests/test_mesh_collectives.py (torch's own tensor-parallel styles against the Megatron
pair of all-reduces and ``CommDebugMode``; DDP's gradient all-reduces against the profiler's comm
hook). On the train job with ``--profile_comm`` (4 gloo processes, ``--model_preset llama_tiny``,
L = 2 layers) it counted, per micro-batch, 17 collectives on ``tp`` under accelerate_configs/cpu_tp.yaml
(forward 2 L + 1 all-reduces and the logits' all-gather, backward 5 L + 1 all-reduces: the formulas
of :mod:`accum_kit.engines.mesh_costs`; the logits' all-gather stays under tp because the loss is then
computed from the gathered logits, not in the vocabulary-split output layer: :mod:`accum_kit.core.fused_head`) and 16 = 8 L all-to-alls on ``cp`` under cpu_cp.yaml.

Cost: one Python call per op dispatched while the mode is on (see :func:`mesh_collective_counter`
for the figures measured); nothing when the profiler is disabled (the mode is not entered),
so :class:`accum_kit.profiler.OverheadSwitch` measures it with the rest of the profiler. Not checked
under ``torch.compile``, whose compiled graphs may issue collectives the mode does not see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.callbacks import LoopCallback
from .mesh_report import MeshAggregates, mesh_summary
from .records import KEEP_RECORDS, Labels, of_step, recent

#: Mesh dimension names, in the order a shared process group is named by (see the module docstring).
DIM_ORDER = ("tp", "cp", "sp", "dp_replicate", "dp_shard", "dp_shard_cp", "dp_cp", "dp")
#: Dimensions whose collectives synchronise gradients (``"dp"`` is also every group of a run without a mesh).
DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard", "dp_shard_cp", "dp_cp", "dp")
#: Dimensions that split the model (tensor parallel) or the sequence (context / sequence parallel).
MODEL_PARALLEL_DIMS = {"tp": "tensor_parallel", "cp": "context_parallel", "sp": "context_parallel"}
#: The classes of :func:`classify`.
CLASSES = ("gradient_sync", "parameter_gather", "tensor_parallel", "context_parallel", "step", "other")
#: The phases a collective is counted in: from the micro-batch's start to the forward's end; after it, outside
#: autograd's backward (the loss's normalisation, e.g. the token count's all-reduce); inside the backward
#: (hooks and autograd's final callbacks: DDP's, FSDP2's gradient reductions); the window's step.
PHASES = ("forward", "before_backward", "backward", "step")


def classify(dim: str, kind: str, phase: str) -> str:
    """The class of a collective of ``kind`` on dimension ``dim`` in ``phase`` (see the module docstring)."""
    if phase == "step":
        return "step"
    if dim in MODEL_PARALLEL_DIMS:
        return MODEL_PARALLEL_DIMS[dim]
    if dim in DATA_PARALLEL_DIMS:
        if kind == "all_gather":
            return "parameter_gather"
        if phase == "backward" and kind in ("all_reduce", "reduce_scatter"):
            return "gradient_sync"
    return "other"


def mesh_groups(device_mesh) -> dict[str, tuple[str, int]]:
    """``{dimension: (process group name, size)}`` for every name of :data:`DIM_ORDER` that ``device_mesh``
    (a ``torch.distributed.device_mesh.DeviceMesh``, or None) has, flattened dimensions included; ``{}`` for None.

    Uses the mesh's public indexing (``mesh[name].get_group().group_name``).
    """
    if device_mesh is None:
        return {}
    out = {}
    for dim in DIM_ORDER:
        try:
            sub = device_mesh if tuple(device_mesh.mesh_dim_names or ()) == (dim,) else device_mesh[dim]
            out[dim] = (sub.get_group().group_name, sub.size())
        except (KeyError, RuntimeError, ValueError, AttributeError):
            continue
    return out


@dataclass
class MeshMicroBatch:
    """The collectives of one micro-batch's forward and backward.

    Attributes:
        step, micro_batch, mode, tag: see :class:`accum_kit.profiler.records.Labels`.
        sync: the loop said its backward synchronises gradients (``LoopState.sync``).
        counts: ``{(dimension, kind, phase): [calls, bytes]}`` (bytes: nccl-tests' S of each call, summed).
    """

    step: int
    micro_batch: int
    mode: str
    tag: str | None
    sync: bool
    counts: dict = field(default_factory=dict)


@dataclass
class MeshWindow:
    """The collectives of one window: its micro-batches' and those of its step phase (``phase == "step"``).

    Attributes:
        step: the optimizer step it ended with (0-based); mode, tag: as :class:`MeshMicroBatch`.
        micro_batches: micro-batches counted in it.
        counts: as :class:`MeshMicroBatch`, summed over the window.
    """

    step: int
    mode: str
    tag: str | None
    micro_batches: int
    counts: dict = field(default_factory=dict)


def _merge(into: dict, counts: dict) -> None:
    for key, (calls, nbytes) in counts.items():
        c = into.get(key)
        if c is None:
            into[key] = [calls, nbytes]
        else:
            c[0] += calls
            c[1] += nbytes


class MeshCollectiveCounter(LoopCallback):
    """Loop callback: every collective of every micro-batch and window, by mesh dimension (calls and bytes).

    Args:
        device_mesh: the run's ``DeviceMesh`` (``accelerator.torch_device_mesh``), or None: no mesh,
            every collective on dimension ``"dp"``.
        labels: the :class:`accum_kit.profiler.records.Labels` stamped on the records (a
            :class:`accum_kit.profiler.CommProfiler` passes its own); with ``enabled`` False
            the dispatch mode is not entered and nothing is counted.
        keep_records: raw :class:`MeshMicroBatch` / :class:`MeshWindow` records kept, the most recent
            (None: all); the summaries come from running totals whatever the run's length.
        groups: more ``{dimension: ProcessGroup or group name}`` to name (e.g. a context-parallel group
            that is no dimension of the mesh); they take precedence over the mesh's.
        every: count the windows whose optimizer step is a multiple of ``every`` (1: every window); the
            others run without the dispatch mode, at no cost. The counts of a window do not change from
            one to the next in a run without data-dependent control flow.

    Attributes:
        dims: ``{dimension: size}`` of the mesh (``{}`` without one).
        micro_batches, windows: the recent records.
        aggregates: the :class:`accum_kit.profiler.mesh_report.MeshAggregates` of every record.

    Raises:
        ImportError: from the first micro-batch, on a torch without ``torch.distributed``.
        ValueError: ``every`` below 1.
    """

    def __init__(self, device_mesh=None, *, labels: Labels | None = None, keep_records: int | None = KEEP_RECORDS,
                 groups: dict | None = None, every: int = 1):
        from ..compat.functional_collectives import group_name_of

        if every < 1:
            raise ValueError(f"every must be a positive integer (got {every!r})")
        self.every = every
        self.labels = labels if labels is not None else Labels()
        found = mesh_groups(device_mesh)
        self.has_mesh = device_mesh is not None
        self.dims = {dim: size for dim, (_, size) in found.items()}
        self._names: dict[str | None, str] = {}
        for dim in reversed(DIM_ORDER):  # the earliest dimension of a shared group wins
            if dim in found:
                self._names[found[dim][0]] = dim
        for dim, group in (groups or {}).items():
            self._names[group_name_of(group)] = dim
            self.dims.setdefault(dim, getattr(group, "size", lambda: None)())
        self.micro_batches, self.windows = recent(keep_records), recent(keep_records)
        self.aggregates = MeshAggregates()
        self._mode, self._active, self._phase = None, False, None
        self._counting, self._micro, self._step, self._window, self._window_micro = False, {}, {}, {}, 0

    # ---- the dispatch mode -----------------------------------------------------------------
    def dimension_of(self, group_name: str | None) -> str:
        """The dimension a process group named ``group_name`` belongs to (see the module docstring)."""
        dim = self._names.get(group_name)
        if dim is None:
            dim = "dp" if not self.has_mesh else ("world" if group_name == _world_name() else "other")
            self._names[group_name] = dim
        return dim

    def count(self, kind: str, group_name: str | None, nbytes: int) -> None:
        """Count one collective of ``kind`` (:data:`accum_kit.compat.functional_collectives.KINDS`) on the group
        named ``group_name``, ``nbytes`` bytes, in the current phase (what the dispatch mode calls)."""
        from ..compat.functional_collectives import in_autograd_backward

        phase = self._phase or "forward"
        if phase == "backward" and not in_autograd_backward():
            phase = "before_backward"
        key = (self.dimension_of(group_name), kind, phase)
        store = self._step if phase == "step" else self._micro
        c = store.get(key)
        if c is None:
            store[key] = [1, nbytes]
        else:
            c[0] += 1
            c[1] += nbytes

    def _start(self, phase: str) -> None:
        from ..compat.functional_collectives import collective_mode, enter_mode

        self._phase = phase
        if self._active:  # still on (a micro-batch that raised): not entered twice
            return
        if self._mode is None:
            self._mode = collective_mode(self.count)
        enter_mode(self._mode)
        self._active = True

    def stop(self) -> None:
        """Leave the dispatch mode if it is on (idempotent; the profiler's ``detach`` calls it)."""
        from ..compat.functional_collectives import exit_mode

        if self._active:
            exit_mode(self._mode)
            self._active = False
        self._phase = None

    # ---- loop hooks ------------------------------------------------------------------------
    def on_micro_batch_begin(self, state):
        self._counting = self.labels.enabled and state.step % self.every == 0
        if self._counting:
            self._micro = {}
            self._start("forward")

    def on_forward_end(self, state):
        if self._counting:
            self._phase = "backward"

    def on_backward_end(self, state):
        if not self._counting:
            return
        self.stop()
        lab = self.labels
        record = MeshMicroBatch(step=state.step, micro_batch=state.micro_step, mode=lab.mode, tag=lab.tag,
                                sync=bool(state.sync), counts=self._micro)
        self.micro_batches.append(record)
        self.aggregates.add_micro_batch(record)
        _merge(self._window, self._micro)
        self._window_micro += 1
        self._counting = False

    def on_step_begin(self, state):
        self._step = {}
        if self._window_micro:  # a counted window
            self._start("step")

    def on_step_end(self, state):
        self.stop()
        if self._window_micro:
            _merge(self._window, self._step)
            lab = self.labels
            record = MeshWindow(step=state.step - 1, mode=lab.mode, tag=lab.tag, micro_batches=self._window_micro,
                                counts=self._window)
            self.windows.append(record)
            self.aggregates.add_window(record)
        self._window, self._step, self._window_micro = {}, {}, 0

    def on_train_end(self, state):
        self.stop()

    # ---- results ---------------------------------------------------------------------------
    def summary(self, mode: str | None = None, tag: str | None = None) -> dict:
        """This process's counts of ``mode`` (and ``tag``; None: every one) per window and micro-batch, by dimension
        and class, and the scope of what ``no_sync`` saves: see :func:`accum_kit.profiler.mesh_report.mesh_summary`."""
        return mesh_summary(self.aggregates.figures(mode=mode, tag=tag), self.dims, has_mesh=self.has_mesh)

    def step_figures(self, step: int) -> dict:
        """``{"mesh_<dim>_calls": int, "mesh_<dim>_bytes": int}`` of window ``step`` (0-based) for a tracker, every
        dimension of the mesh (0 when none ran) and any other seen; ``{}`` when the window was not counted."""
        found = of_step(list(self.windows), step)
        if not found:
            return {}
        out = {}
        for dim in self.dims:
            out[f"mesh_{dim}_calls"] = out[f"mesh_{dim}_bytes"] = 0
        for (dim, _, _), (calls, nbytes) in found[-1].counts.items():
            out[f"mesh_{dim}_calls"] = out.get(f"mesh_{dim}_calls", 0) + calls
            out[f"mesh_{dim}_bytes"] = out.get(f"mesh_{dim}_bytes", 0) + nbytes
        return out


def _world_name() -> str | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD.group_name


def wants_mesh_counter(accelerator, by_mesh_dim: bool | None) -> bool:
    """Whether a profiler counts by mesh dimension: ``by_mesh_dim`` if given, else whether
    ``accelerator.torch_device_mesh`` has a ``tp``, ``cp`` or ``sp`` dimension (a data-parallel-only run's
    collectives are already told apart by the engine's part)."""
    if by_mesh_dim is not None:
        return bool(by_mesh_dim)
    mesh = getattr(accelerator, "torch_device_mesh", None)
    return mesh is not None and any(dim in MODEL_PARALLEL_DIMS for dim in (mesh.mesh_dim_names or ()))


def mesh_collective_counter(accelerator, *, labels: Labels | None = None, keep_records: int | None = KEEP_RECORDS,
                            groups: dict | None = None, every: int = 1) -> MeshCollectiveCounter:
    """The :class:`MeshCollectiveCounter` of a run, its mesh being ``accelerator.torch_device_mesh`` (None: none).

    Add it to the loop's callbacks, or let :class:`accum_kit.profiler.CommProfiler` do it (``by_mesh_dim``; on
    by default when the mesh has a ``tp``, ``cp`` or ``sp`` dimension), whose summary then has the
    ``by_mesh_dim`` block. ``accelerator``: any object with a ``torch_device_mesh`` attribute; the other
    arguments as :class:`MeshCollectiveCounter`.

    Cost, measured on CPU (torch 2.13, 1 thread per process, medians of 30 to 40 passes): any
    ``TorchDispatchMode`` costs about 8 us of CPU per op dispatched while it is on. A 2-layer GPT-2 of width 32
    (400 ops per forward and backward) took 3.5 ms of CPU per pass, 6.8 ms under a pass-through mode, 7.0 ms under
    this counter and 24 ms under torch's ``CommDebugMode`` (which also keeps a record of every DTensor op, a
    list that grows with the run); on 2 gloo processes a 4-block column / row-parallel MLP (width 64 / 256, 8
    all-reduces per pass) took 22.3 ms, 26.0 ms with this counter, 44.9 ms with ``CommDebugMode``. The ratio
    falls as ops grow larger; ``every`` counts one window in N, and :class:`accum_kit.profiler.OverheadSwitch`
    measures the cost within the run.
    """
    return MeshCollectiveCounter(getattr(accelerator, "torch_device_mesh", None), labels=labels,
                                 keep_records=keep_records, groups=groups, every=every)
