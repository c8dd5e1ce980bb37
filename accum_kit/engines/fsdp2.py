"""The FSDP2 engine (HSDP is its 2-D mesh): the policy's switches inside ``no_sync`` (the plugin a policy needs is
:mod:`accum_kit.engines.fsdp2_plugin`).

The policies themselves (what each skips and keeps, and why) are described in
:mod:`accum_kit.engines.policies`; what each costs per window and per process is
:func:`accum_kit.engines.costs.policy_costs` and docs/fsdp.md.
"""

from __future__ import annotations

import contextlib

from ..errors import UsageError
from .base import Engine
from .fsdp2_plugin import checked_plugin, with_mixed_precision


#: the ``torch.utils.checkpoint`` arguments of Accelerate's FSDP2 activation checkpointing (accelerate 1.15's
#: ``fsdp2_apply_ac``: ``checkpoint_wrapper(layer, preserve_rng_state=False)``, torch's non-reentrant default)
ACCELERATE_CHECKPOINT_KWARGS = {"use_reentrant": False, "preserve_rng_state": False}


class FSDP2Engine(Engine):
    """FSDP2 (``fully_shard``), on a 1-D mesh or HSDP's 2-D mesh (replicas x shard group).

    What differs from DDP: the accumulation policies that keep gathered
    parameters (:mod:`accum_kit.engines.policies`) are applied inside
    ``no_sync``; under HSDP ``reduce_scatter_each_batch`` defers only the
    all-reduce across replicas; gradients and gathered parameters are held in
    FSDP2's own tensors (:func:`accum_kit.compat.fsdp_held_tensors`); memory is
    predicted from the cost table per unit and mesh; on CPU Accelerate's state
    is switched to FSDP2 after construction (:func:`accum_kit.compat.enable_fsdp_on_cpu`).

    Args:
        fsdp_plugin: the caller's ``FullyShardedDataParallelPlugin``, or None (the launcher's ``FSDP_*`` variables).
        parallelism_config: the run's ``ParallelismConfig`` (HSDP), or None (a 1-D mesh).
    """

    name = "fsdp2"

    def __init__(self, fsdp_plugin=None, parallelism_config=None):
        super().__init__()
        self.plugin, self.parallelism = fsdp_plugin, parallelism_config

    @classmethod
    def requested(cls, fsdp_plugin=None, parallelism_config=None, *, world_size: int) -> "FSDP2Engine":
        """The engine a launch (or the plugins passed) asks for, its mesh checked against ``world_size``.

        Raises:
            UsageError: see :func:`accum_kit.engines.mesh.resolve_parallelism_config`.
        """
        from .mesh import resolve_parallelism_config

        return cls(fsdp_plugin, resolve_parallelism_config(parallelism_config, world_size=world_size, fsdp=True))

    @property
    def label(self) -> str:
        pc = self.parallelism
        base = f"HSDP {pc.dp_replicate_size} x {pc.dp_shard_size}" if self.hybrid else "FSDP2"
        extra = [f"{n} {getattr(pc, n + '_size')}" for n in ("cp", "tp") if pc is not None and getattr(pc, n + "_size") > 1]
        return " x ".join([base + (f" {pc.dp_shard_size}" if extra and not self.hybrid else ""), *extra])

    @property
    def hybrid(self) -> bool:
        """True under HSDP: a replicate group of two or more."""
        return self.parallelism is not None and self.parallelism.dp_replicate_size > 1

    def check_policy(self, policy) -> None:
        """Every policy applies, but ``reduce_scatter_each_batch`` only under HSDP (it needs a replicate group)."""
        if policy.hsdp_only and not self.hybrid:
            raise UsageError("--accumulation_policy", f"{policy.name} defers the all-reduce across replicas, but this "
                             "run has no replicate group (it is not HSDP)", "launch with accelerate_configs/"
                             "cpu_hsdp.yaml (or gpu_hsdp.yaml) with dp_replicate_size > 1, or use no_sync")

    def check_request(self, policy, *, ddp_kwargs, compile_requested, world_size, on_cpu) -> None:
        """The policy, the plugin (:func:`accum_kit.engines.fsdp2_plugin.checked_plugin`, kept), DDP settings, and
        one process on CPU, in that order."""
        self.check_policy(policy)
        self.plugin = checked_plugin(policy, self.plugin)
        if ddp_kwargs:
            from .ddp import flag_of

            raise UsageError(flag_of(next(iter(ddp_kwargs))), "is a DDP setting and has no effect under FSDP2",
                             "drop it, or launch with a DDP config (accelerate_configs/cpu_ddp.yaml)")
        if world_size < 2 and on_cpu:
            raise UsageError("--num_processes", "FSDP on CPU needs at least 2 processes (one process has nothing "
                             "to shard with, and Accelerate would run it unsharded)",
                             "launch 2 or more processes, or use accelerate_configs/cpu_single.yaml")

    def accelerator_kwargs(self, kwargs, *, accumulation_steps, policy, max_grad_norm, mixed_precision):
        """The plugin checked by :meth:`check_request`, with the mixed-precision policy, into ``kwargs``."""
        kwargs["fsdp_plugin"] = self.plugin = with_mixed_precision(self.plugin, mixed_precision)
        return kwargs

    def parallelism_config(self, on_cpu: bool):
        return None if on_cpu else self.parallelism  # on CPU it is applied after construction (bind)

    def constructing(self, on_cpu: bool):
        from ..compat import parallelism_config_from_env_off

        return parallelism_config_from_env_off() if on_cpu else contextlib.nullcontext()

    def compile_per_block(self) -> bool:
        return True

    def resolve_activation_checkpointing(self, enabled: bool, kwargs) -> tuple[bool, dict]:
        """On when asked for or when the launch's plugin has it (``fsdp_activation_checkpointing: true``), then
        set on the plugin: Accelerate wraps each block that becomes an FSDP unit in torch's checkpoint wrapper
        before ``fully_shard`` (``fsdp2_apply_ac``, accelerate 1.15), non-reentrant with
        ``preserve_rng_state=False`` (:data:`ACCELERATE_CHECKPOINT_KWARGS`, what the plan records).

        Raises:
            UsageError (``--gradient_checkpointing_kwargs``): any other argument, ``use_reentrant: true``
                among them (Accelerate's wrapper takes none).
        """
        on, kwargs = super().resolve_activation_checkpointing(enabled, kwargs)
        if not (on or getattr(self.plugin, "activation_checkpointing", False)):
            return False, {}
        other = {k: v for k, v in kwargs.items() if ACCELERATE_CHECKPOINT_KWARGS.get(k, not v) != v}
        if other:
            raise UsageError("--gradient_checkpointing_kwargs", f"{other} cannot apply under FSDP2: Accelerate's "
                             f"activation checkpointing wraps each FSDP unit with {ACCELERATE_CHECKPOINT_KWARGS} "
                             "and takes no other argument", "drop --gradient_checkpointing_kwargs under FSDP2 (the "
                             "run is non-reentrant; docs/memory.md), or launch with a DDP config")
        self.plugin.activation_checkpointing = True
        return True, dict(ACCELERATE_CHECKPOINT_KWARGS)

    def apply_activation_checkpointing(self, accelerator, model):
        """``model`` with its key/value cache off (:func:`accum_kit.engines.activation_checkpointing.turn_cache_off`):
        Accelerate's ``prepare`` applies the checkpoint wrapper (the plugin's switch). Warns when ``model`` has
        dropout: without the RNG state the recompute draws other masks (docs/memory.md)."""
        from .activation_checkpointing import active_dropout, turn_cache_off

        turn_cache_off(model)

        dropout = active_dropout(model)
        if dropout:
            import warnings

            warnings.warn(f"--gradient_checkpointing under FSDP2 recomputes without the RNG state (Accelerate's "
                          f"preserve_rng_state=False): the {len(dropout)} dropout layers with p > 0 ({dropout[0]}, "
                          "...) draw other masks in backward, so the gradient is not the forward's. Set the dropout "
                          "to 0 for an exact gradient (docs/memory.md).", stacklevel=3)
        return model

    def bind(self, accelerator, on_cpu: bool) -> "FSDP2Engine":
        from ..compat import enable_fsdp_on_cpu, enable_hsdp_on_cpu

        super().bind(accelerator, on_cpu)
        if on_cpu:  # on GPUs Accelerate switches FSDP2 (and its mesh) on itself
            enable_fsdp_on_cpu(accelerator, self.plugin)
            if self.parallelism is not None:
                enable_hsdp_on_cpu(accelerator, self.parallelism)
        return self

    def before_prepare(self, accelerator, objects) -> None:
        """Split each model for the mesh's tp and cp dimensions (:func:`accum_kit.engines.model_parallel.prepare_model`)."""
        import torch

        from .model_parallel import prepare_model

        mesh = self.mesh(accelerator)
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        for obj in objects:
            if isinstance(obj, torch.nn.Module):
                prepare_model(accelerator, mesh, obj, optimizers)

    def preparing(self, accelerator):
        """Accelerate's own tp / cp preparation skipped (:func:`accum_kit.compat.tensor_parallel.accelerate_tp_cp_prepare_off`)."""
        from ..compat.tensor_parallel import accelerate_tp_cp_prepare_off

        mesh = self.mesh(accelerator)
        return accelerate_tp_cp_prepare_off(accelerator, tp=mesh.tp > 1, cp=mesh.cp > 1)

    def data_parallel_size(self, accelerator) -> int:
        """R x S: the tp and cp ranks of a data-parallel rank read its examples too."""
        return self.mesh(accelerator).data_parallel_size

    def token_ranks(self, accelerator):
        """The data-parallel x cp ranks (:func:`accum_kit.engines.model_parallel.token_ranks`)."""
        from .model_parallel import token_ranks

        return token_ranks(accelerator, self.mesh(accelerator))

    def window_normalizer(self, accelerator, mode: str, loss_fn):
        """The normaliser counting tokens over :meth:`token_ranks`; FSDP2 averages over ``R x S x cp`` (never tp)."""
        from ..core.loss import WindowNormalizer

        return WindowNormalizer(accelerator, mode, ranks=self.token_ranks(accelerator),
                                gradient_mean_size=self.mesh(accelerator).fsdp_size)

    def after_prepare(self, accelerator, objects, prepared: list) -> list:
        """For a model with per-module experts (:func:`accum_kit.engines.moe.expert_blocks`): make every unit reduce a
        zero gradient for a parameter without one
        (:func:`accum_kit.compat.unused_parameters.fsdp_reduce_unused_parameters`: an expert without tokens on some
        rank), and record what each window reaches for :meth:`backward`
        (:class:`accum_kit.engines.reached.ReachedParameters`); a dense model is left as Accelerate prepared it.
        Then refuse a model in which Accelerate's checkpointing wrapped nothing: its auto-wrap policy matches only the
        classes of ``_no_split_modules`` or the config's ``fsdp_transformer_layer_cls_to_wrap``, and checkpoints no
        other module, silently (accelerate 1.15).

        Raises:
            UsageError (``--gradient_checkpointing``): no checkpoint wrapper in a prepared model.
            UsageError (``fsdp_transformer_layer_cls_to_wrap``): an expert made an FSDP2 unit of its own
                (:func:`accum_kit.engines.moe.check_fsdp_expert_units`).
        """
        import torch

        from ..compat.torch_checkpoint import is_checkpoint_wrapper
        from ..compat.unused_parameters import fsdp_parameter_pairs, fsdp_reduce_unused_parameters
        from .moe import check_fsdp_expert_units, expert_blocks, watch_prepared
        from .reached import ReachedParameters

        if getattr(self, "expert_models", None) is None:
            import weakref

            self.expert_models = weakref.WeakKeyDictionary()  # prepared model -> ReachedParameters
        for model in prepared:  # experts without tokens: a zero gradient reduced, never a missing one (engines/moe.py)
            if isinstance(model, torch.nn.Module) and expert_blocks(model):
                check_fsdp_expert_units(model)
                fsdp_reduce_unused_parameters(model)
                self.expert_models[model] = ReachedParameters(fsdp_parameter_pairs(model))
                watch_prepared(self, [model])
        if not accelerator.run_plan.gradient_checkpointing:
            return prepared
        for given, model in zip(objects, prepared):
            if isinstance(model, torch.nn.Module) and not any(is_checkpoint_wrapper(m) for m in model.modules()):
                name = next(c.__name__ for c in type(given).__mro__ if not c.__name__.startswith("FSDP"))  # FSDP<Model>
                raise UsageError("--gradient_checkpointing", f"no transformer blocks found in {name}: "
                                 "Accelerate's FSDP2 checkpointing wraps only the classes named in the model's "
                                 "_no_split_modules or the config's fsdp_transformer_layer_cls_to_wrap", "name the "
                                 "block class there, or drop --gradient_checkpointing")
        return prepared

    @contextlib.contextmanager
    def no_sync(self, accelerator, model, policy, base_no_sync):
        """``Accelerator.no_sync``, plus the policy's reshard switch.

        Under ``reduce_scatter_each_batch`` (HSDP) only the all-reduce across
        replicas is skipped (``model.set_requires_all_reduce(False)``): the
        reduce-scatter inside the shard group runs. Under the policies that keep
        parameters gathered, ``model.set_reshard_after_backward(False)`` holds
        while the micro-batch runs and ``True`` is restored after, so the
        boundary backward reshards before the optimizer step. After the
        micro-batch of a model with per-module experts, a parameter it gave no gradient (an expert without tokens)
        gets a zero one in the reduce dtype
        (:func:`accum_kit.compat.unused_parameters.fsdp_zero_fill_accumulated_grads`).
        """
        if policy.hsdp_only:
            model.set_requires_all_reduce(False)
            try:
                yield
            finally:
                model.set_requires_all_reduce(True)
            return
        from ..compat.unused_parameters import fsdp_zero_fill_accumulated_grads

        keep = policy.keep_params_after_backward
        if keep:
            model.set_reshard_after_backward(False)
        try:
            with base_no_sync(model):
                yield
            if model in (getattr(self, "expert_models", None) or {}):
                fsdp_zero_fill_accumulated_grads(model)  # one reduce dtype at the boundary (engines/moe.py)
        finally:
            if keep:
                model.set_reshard_after_backward(True)

    def backward(self, accelerator, loss, base_backward, **kwargs):
        """``base_backward`` (Accelerate's); for a model with per-module experts, first record what ``loss``'s graph
        reaches, and after the window's boundary set ``.grad = None`` on each sharded parameter no micro-batch of the
        window reached on any rank (:class:`accum_kit.engines.reached.ReachedParameters`), which FSDP2 gave a zero
        gradient (:meth:`after_prepare`): the optimizer then skips it, as one big batch on one process does."""
        watch = getattr(self, "forward_watch", None)
        if watch is None:  # no model with experts
            return base_backward(loss, **kwargs)
        experts = self.expert_models
        for model in watch.ran():
            if model in experts:
                experts[model].observe(loss)
        out = base_backward(loss, **kwargs)
        boundary = bool(accelerator.sync_gradients)
        if boundary:
            for model in watch.ran(boundary=True):
                if model in experts:
                    experts[model].drop_unreached(accelerator.device)
        watch.backward_done(boundary)
        return out

    def reduces_each_micro_batch(self, accelerator, policy) -> bool:
        """True under ``sync_each_batch`` and HSDP's ``reduce_scatter_each_batch`` (its reduce-scatter runs every
        micro-batch; only the all-reduce across replicas waits for the boundary)."""
        return accelerator.num_processes > 1 and (policy.sync_each_batch or policy.hsdp_only)

    def held_tensors(self, model):
        from ..compat import fsdp_held_tensors, fsdp_units

        units = fsdp_units(model)
        if not units:  # not prepared (yet): plain parameters
            yield from super().held_tensors(model)
            return
        for _, group in units:
            yield from fsdp_held_tensors(group)

    def mesh(self, accelerator):
        from .mesh import run_mesh

        return run_mesh(accelerator)

    def window_costs(self, accelerator, model, accumulation_steps, policy):
        """:func:`accum_kit.engines.costs.policy_costs` with the prepared model's units, the mixed-precision
        policy's element sizes and the run's mesh (HSDP: its replicas)."""
        from .costs import policy_costs

        b_p, b_c, b_r = element_bytes(accelerator, model)
        return policy_costs(policy, sharded_model(model), world_size=accelerator.num_processes,
                            accumulation_steps=accumulation_steps, param_bytes=b_p, compute_bytes=b_c,
                            reduce_bytes=b_r, replicate_size=self.mesh(accelerator).replicate)

    def communication_buffer_bytes(self, accelerator, model, policy: str) -> int:
        """FSDP2's buffers in flight during a backward: :func:`accum_kit.engines.activation_memory.sharded_buffer_bytes`
        of the largest unit, the policy and the mixed-precision policy's element sizes."""
        from .activation_memory import sharded_buffer_bytes
        from .policies import POLICIES

        units = sharded_model(model)
        if units is None:
            return 0
        _, b_c, b_r = element_bytes(accelerator, model)
        p = POLICIES[policy]
        return int(sharded_buffer_bytes(max((*units.resharded, *units.kept), default=0), b_c, b_r,
                                        keeps_gathered=p.reshard_after_forward is False,
                                        reduces_each_micro_batch=self.reduces_each_micro_batch(accelerator, p),
                                        largest_trainable_unit=units.largest_trainable_unit))

    def predicted_memory(self, accelerator, model, accumulation_steps, policies) -> dict:
        """:meth:`window_costs` per policy (before the model is sharded: as under DDP)."""
        if sharded_model(model) is None:
            return super().predicted_memory(accelerator, model, accumulation_steps, policies)
        return {n: self.window_costs(accelerator, model, accumulation_steps, n).to_dict() for n in policies}

    def summary_blocks(self, accelerator) -> dict:
        """``{"fsdp": {"version": 2, "mesh": {"dp_replicate_size", "dp_shard_size"}, "accumulation_policy": str,
        "reshard_after_forward": bool, "state_dict_type": str, "mixed_precision_policy": {param_dtype,
        reduce_dtype} | None}, "deepspeed": None}``."""
        plugin = accelerator.state.fsdp_plugin
        mp = plugin.mixed_precision_policy
        return {"deepspeed": None, "fsdp": {
            "version": 2,
            "mesh": self.mesh(accelerator).to_dict(),
            "accumulation_policy": accelerator.run_plan.policy.name,
            "reshard_after_forward": bool(plugin.reshard_after_forward),
            "state_dict_type": str(getattr(plugin.state_dict_type, "name", plugin.state_dict_type)),
            "mixed_precision_policy": None if mp is None else {
                "param_dtype": str(mp.param_dtype).replace("torch.", "") if mp.param_dtype else None,
                "reduce_dtype": str(mp.reduce_dtype).replace("torch.", "") if mp.reduce_dtype else None},
        }}

    def profiler_part(self, profiler):
        """:class:`accum_kit.profiler.parts.CollectivePart`: every unit's all-gather and reduce-scatter (and HSDP's
        all-reduce across replicas) on the run's mesh."""
        from ..profiler.parts import CollectivePart

        return CollectivePart(profiler, self.mesh(profiler.accelerator))


def sharded_model(model):
    """The :class:`accum_kit.engines.costs.ShardedModel` of a prepared FSDP2 model (None if it is not one).

    Each unit is put under ``resharded`` or ``kept`` by its reshard-after-forward
    setting now; FSDP2 settles the root's at the first forward, so read after one
    for the split (the total P is right at any time).
    """
    from ..compat import fsdp_reshards_after_forward, fsdp_unit_parameters, fsdp_unit_trainable_parameters, fsdp_units
    from .model_units import ShardedModel

    units = fsdp_units(model)
    if not units:
        return None
    return ShardedModel.from_units([{"parameters": fsdp_unit_parameters(g),
                                     "trainable_parameters": fsdp_unit_trainable_parameters(g),
                                     "reshard_after_forward": fsdp_reshards_after_forward(g)} for _, g in units],
                                   source="the prepared model's FSDP2 units")


def element_bytes(accelerator, model) -> tuple[int, int, int]:
    """(b_p, b_c, b_r): bytes per stored parameter, per gathered parameter, per reduced gradient element.

    b_p from the parameters themselves; under FSDP2, b_c and b_r from the
    plugin's ``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``; FSDP2
    reduces in ``param_dtype`` when ``reduce_dtype`` is unset); otherwise both b_p.
    """
    b_p = next((p.element_size() for p in model.parameters()), 4)
    plugin = getattr(accelerator.state, "fsdp_plugin", None) if getattr(accelerator, "is_fsdp2", False) else None
    mp = getattr(plugin, "mixed_precision_policy", None)
    if mp is None:
        return b_p, b_p, b_p
    b_c = mp.param_dtype.itemsize if mp.param_dtype is not None else b_p
    b_r = mp.reduce_dtype.itemsize if mp.reduce_dtype is not None else b_c
    return b_p, b_c, b_r
