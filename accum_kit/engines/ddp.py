"""The DDP engine (:class:`DDPEngine`), and DDP's constructor settings as flags (``accum-kit train`` and ``bench``).

The flag names are transformers' ``TrainingArguments`` names where it has
one (``--ddp_bucket_cap_mb``, ``--ddp_static_graph``,
``--ddp_find_unused_parameters``), and Accelerate's otherwise
(``--gradient_as_bucket_view``); the DDP / Accelerate names
(``--bucket_cap_mb``, ``--static_graph``, ``--find_unused_parameters``) are
accepted as aliases. The values reach DDP as Accelerate's
``DistributedDataParallelKwargs`` (:func:`accum_kit.build_accelerator`'s
``ddp_kwargs``), whose fields carry DDP's own names; see
https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
for what each one does. No torch import here (``--help`` stays fast).
"""

from __future__ import annotations

from dataclasses import field

from .. import checks
from ..core.callbacks import LoopCallback
from .base import Engine

#: flag (dataclass field) -> (DDP / DistributedDataParallelKwargs name, default, help, aliases)
DDP_FLAGS = {
    "ddp_bucket_cap_mb": ("bucket_cap_mb", None, "DDP gradient bucket size in MB (None: DDP's 25). Smaller buckets "
                          "start all-reducing earlier in the backward; one big bucket overlaps nothing.", ["--bucket_cap_mb"]),
    "gradient_as_bucket_view": ("gradient_as_bucket_view", False, "DDP gradient_as_bucket_view: gradients are views "
                                "into the all-reduce buckets (saves one gradient-sized copy of memory).", []),
    "ddp_static_graph": ("static_graph", False, "DDP static_graph: the set of used parameters and the graph do not "
                         "change between iterations (lets DDP skip some per-iteration work).", ["--static_graph"]),
    "ddp_find_unused_parameters": ("find_unused_parameters", False, "DDP find_unused_parameters: traverse the graph "
                                   "after every forward to find parameters without gradients (needed only when some "
                                   "get none; costs time).", ["--find_unused_parameters"]),
}


def ddp_field(name: str):
    """The dataclass ``field`` of DDP flag ``name`` (a key of :data:`DDP_FLAGS`), with its default, help and aliases."""
    _, default, help_text, aliases = DDP_FLAGS[name]
    return field(default=default, metadata={"help": help_text, "aliases": aliases})


def check_ddp_flags(cfg) -> None:
    """Check the DDP flags of a config dataclass that has the :data:`DDP_FLAGS` fields.

    Raises:
        UsageError: ``--ddp_bucket_cap_mb`` not a positive number.
    """
    if cfg.ddp_bucket_cap_mb is not None:
        checks.positive("--ddp_bucket_cap_mb", cfg.ddp_bucket_cap_mb,
                        fix="pass a size in MB, e.g. 25 (DDP's default) to --ddp_bucket_cap_mb (alias --bucket_cap_mb)")


def flag_of(ddp_name: str) -> str:
    """The flag of DDP constructor argument ``ddp_name`` (e.g. ``bucket_cap_mb`` -> ``--ddp_bucket_cap_mb``)."""
    return next((f"--{flag}" for flag, (name, *_) in DDP_FLAGS.items() if name == ddp_name), ddp_name)


def ddp_kwargs(cfg) -> dict:
    """The DDP constructor arguments (DDP's names) whose flag differs from DDP's default; {} when none does."""
    out = {}
    for name, (ddp_name, default, _, _) in DDP_FLAGS.items():
        value = getattr(cfg, name)
        if value != default:
            out[ddp_name] = value
    return out


class StaticGraphFirstSync(LoopCallback):
    """Loop callback: the run's first micro-batch synchronises, so DDP's ``static_graph`` can work with ``no_sync``.

    DDP with ``static_graph=True`` fails if its first backward runs under
    ``no_sync`` (see :func:`accum_kit.compat.ddp_static_graph_unprimed`).
    This puts ``sync_each_batch`` in force at train begin (through the run plan,
    :meth:`accum_kit.core.run_plan.RunPlan.use_policy`) and the previous policy
    back after the first micro-batch's backward. The update
    stays exact: that all-reduce averages the first micro-batch's gradients
    over the processes, and the window's boundary all-reduce averages the sum
    again, which leaves an already averaged term unchanged. Cost: one extra
    gradient all-reduce per run. Put it after every callback that sets
    ``sync_each_batch`` at train begin (:func:`accum_kit.train_loop` adds it last).
    ``state.forced_sync`` is True during that micro-batch, so that the
    profiler and :class:`accum_kit.profiler.held_memory.HeldMemory` leave it out: it is no
    sync of the policy in force.
    """

    def __init__(self, accelerator):
        self.accelerator, self._saved = accelerator, None

    def on_train_begin(self, state):
        from ..core.run_plan import run_plan_of

        self._saved = run_plan_of(self.accelerator).use_policy("sync_each_batch")
        state.forced_sync = True

    def on_backward_end(self, state):
        if self._saved is not None:
            from ..core.run_plan import run_plan_of

            run_plan_of(self.accelerator).use_policy(self._saved)
            self._saved = None
            state.forced_sync = False


def check_every_parameter_reduced(model) -> None:
    """After a synchronising backward of DDP ``model`` built without ``find_unused_parameters``: refuse a backward that
    left a parameter without a gradient (:func:`accum_kit.compat.unused_parameters.ddp_unreduced_parameters`), before
    the optimizer steps on unreduced gradients and DDP's next forward fails with "Expected to have finished
    reduction in the prior iteration".

    Raises:
        UsageError (``--ddp_find_unused_parameters``): naming the parameters DDP lists and the fix.
    """
    from ..compat.unused_parameters import ddp_unreduced_parameters
    from ..errors import UsageError

    names = ddp_unreduced_parameters(model)
    if names is None:
        return
    listed = (f"{', '.join(names[:5])}{f', ... {len(names)} in all' if len(names) > 5 else ''}" if names
              else "some parameters")
    raise UsageError("--ddp_find_unused_parameters", f"the model has parameters that received no gradient in a "
                     f"backward that reduces ({listed}): DDP without find_unused_parameters waits for a gradient "
                     "from every parameter, so it reduced only part of the gradients (torch: \"Expected to have "
                     "finished reduction in the prior iteration\")", "pass --ddp_find_unused_parameters true "
                     "(build_accelerator(ddp_kwargs={'find_unused_parameters': True}) in your own script), or make "
                     "the loss use those parameters, or freeze them (requires_grad=False)")


def static_graph_first_sync(accelerator, model) -> StaticGraphFirstSync | None:
    """A :class:`StaticGraphFirstSync` when ``model`` is a static-graph DDP model that never synchronised, else None."""
    from ..compat import ddp_static_graph_unprimed

    return StaticGraphFirstSync(accelerator) if ddp_static_graph_unprimed(model) else None


class DDPEngine(Engine):
    """DistributedDataParallel, and one process (its degenerate case: nothing to reduce).

    Everything is the base behaviour of :class:`accum_kit.engines.base.Engine`:
    gradients live in ``.grad``, DDP all-reduces them on the window's boundary
    (every micro-batch under ``sync_each_batch``), the loop rescales them after
    the window and clips with ``accelerator.clip_grad_norm_``. What DDP adds is
    its constructor settings (:data:`DDP_FLAGS`) and the static-graph first
    sync (:class:`StaticGraphFirstSync`).
    """

    name = "ddp"
    takes_ddp_kwargs = True

    @property
    def label(self) -> str:
        acc = self.accelerator
        return "one process" if acc is not None and acc.num_processes == 1 else "DDP"

    def apply_activation_checkpointing(self, accelerator, model):
        """As the base engine, after refusing the one combination that fails under DDP: reentrant checkpointing
        with ``find_unused_parameters=True``. DDP then finds no use of the checkpointed blocks' parameters in the
        forward (it ran without grad), marks them ready at once, and their gradients in the recompute mark them
        again: "Expected to mark a variable ready only once" (measured, torch 2.13, gloo, under no_sync and
        sync_each_batch). Without it, reentrant runs are exact (tests/test_exactness.py).

        Raises:
            UsageError (``--gradient_checkpointing_kwargs``): ``use_reentrant: true`` with
                ``--ddp_find_unused_parameters``, or on a model with experts (:func:`accum_kit.engines.moe.expert_blocks`).
        """
        from ..compat import ddp_constructor_kwargs
        from ..errors import UsageError

        from .moe import expert_blocks

        reentrant = accelerator.run_plan.gradient_checkpointing_kwargs.get("use_reentrant")
        if reentrant and accelerator.num_processes > 1 and ddp_constructor_kwargs(accelerator).get("find_unused_parameters"):
            raise UsageError("--gradient_checkpointing_kwargs", "use_reentrant: true fails under DDP with "
                             "find_unused_parameters=True (\"Expected to mark a variable ready only once\")",
                             "drop use_reentrant (non-reentrant is the default) or --ddp_find_unused_parameters")
        if reentrant and accelerator.num_processes > 1 and expert_blocks(model):
            raise UsageError("--gradient_checkpointing_kwargs", "use_reentrant: true under DDP cannot give an expert "
                             "without tokens its zero gradient (docs/moe.md), and DDP then fails or hangs",
                             "drop use_reentrant (non-reentrant is the default)")
        return super().apply_activation_checkpointing(accelerator, model)

    def after_prepare(self, accelerator, objects, prepared: list) -> list:
        """Watch the prepared models' forwards, for :meth:`backward` (:func:`accum_kit.engines.moe.watch_prepared`), and
        give each DDP model with per-module experts (:func:`accum_kit.engines.moe.expert_blocks`) built without
        ``find_unused_parameters`` a :class:`accum_kit.engines.reached.ReachedParameters`."""
        import weakref

        import torch

        from ..compat.unused_parameters import ddp_module, ddp_parameter_pairs
        from .moe import expert_blocks, watch_prepared
        from .reached import ReachedParameters

        watch_prepared(self, prepared)
        if getattr(self, "expert_models", None) is None:
            self.expert_models = weakref.WeakKeyDictionary()  # prepared model -> ReachedParameters or None
        for model in prepared:
            if isinstance(model, torch.nn.Module) and expert_blocks(model):
                ddp = ddp_module(model)
                needs_mask = ddp is not None and not getattr(ddp, "find_unused_parameters", False)
                self.expert_models[model] = ReachedParameters(ddp_parameter_pairs(model)) if needs_mask else None
        return prepared

    def backward(self, accelerator, loss, base_backward, **kwargs):
        """``base_backward`` (Accelerate's) for a dense model, then, after a synchronising backward of DDP without
        ``find_unused_parameters``, a check that DDP reduced every parameter: a parameter the loss did not use
        leaves its bucket unreduced, the optimizer would step on unreduced gradients and DDP's next forward fail.

        For a model with per-module experts (:func:`accum_kit.engines.moe.expert_blocks`) under DDP without
        ``find_unused_parameters``: on every synchronising backward (the window's boundary, every micro-batch under
        ``sync_each_batch``) ``loss`` plus :func:`accum_kit.engines.moe.zero_gradient_term` of its parameters, so
        that an expert without tokens, on this rank or all, gets a zero gradient and DDP's reducer reduces every
        bucket on every rank; and on every backward its :class:`accum_kit.engines.reached.ReachedParameters`
        records what the graph reached, so that after the boundary a parameter no micro-batch of the window reached
        on any rank holds no gradient, as in one big batch on one process. DDP with ``find_unused_parameters`` and
        one process leave such a parameter without a gradient themselves. With reentrant checkpointing no term is
        added (:func:`accum_kit.engines.moe.reentrant_checkpointing`; a model with experts is refused then,
        :meth:`apply_activation_checkpointing`).

        Raises:
            UsageError (``--ddp_find_unused_parameters``): DDP did not reduce every parameter (one got no gradient).
        """
        from ..compat.unused_parameters import ddp_needs_every_parameter
        from .moe import reentrant_checkpointing, with_zero_gradients

        watch = getattr(self, "forward_watch", None)
        if watch is None:  # nothing prepared through this engine
            return base_backward(loss, **kwargs)
        ran = watch.ran()
        sync = [m for m in ran if ddp_needs_every_parameter(m)]
        # prepared model -> ReachedParameters, for the models with experts under DDP without find_unused_parameters
        masks = {} if reentrant_checkpointing(accelerator) else getattr(self, "expert_models", None) or {}
        term = [m for m in sync if masks.get(m) is not None]
        for model in ran:
            if masks.get(model) is not None:
                masks[model].observe(loss)  # before the term, which reaches every parameter
        for model in term:
            loss = with_zero_gradients(loss, model.parameters())
        out = base_backward(loss, **kwargs)
        for model in sync:
            if all(model is not m for m in term):
                check_every_parameter_reduced(model)
        boundary = bool(accelerator.sync_gradients)
        if boundary:
            for model in watch.ran(boundary=True):
                if masks.get(model) is not None:
                    masks[model].drop_unreached(accelerator.device)
        watch.backward_done(boundary)
        return out

    def loop_callbacks(self, accelerator, model) -> list:
        """Callbacks the loop adds for this engine: the static-graph first sync when the model needs it."""
        first = static_graph_first_sync(accelerator, model)
        return [first] if first is not None else []
