"""The DeepSpeed ZeRO engine (:class:`ZeroEngine`): what differs under DeepSpeed, asked of one object.

How DeepSpeed's accumulation differs from DDP's and FSDP2's (DeepSpeed 0.19.8,
accelerate 1.15):

- ``accelerator.backward`` does not divide the loss by K under DeepSpeed; the
  engine's ``backward`` divides it by its own ``gradient_accumulation_steps``
  (the config's K, also in a partial last window), and ZeRO averages the
  gradients over the W data-parallel processes.
- Accelerate's ``DeepSpeedEngineWrapper.backward`` runs ``engine.backward`` and,
  on the boundary (``sync_gradients``), ``engine.step`` in the same call:
  clipping and the optimizer step happen inside the boundary's backward, and
  under ZeRO-2/3 the reduced gradients live in the ZeRO optimizer's own
  partitions, not in ``.grad``. The loop's "rescale the gradients after the
  window" (:mod:`accum_kit.core.loss`) has nothing to act on.
- So the window's target-token count N is taken first (the transformers
  Trainer's way, ``num_items_in_batch``): :class:`LookaheadNormalizer` reads
  the window's micro-batches ahead, counts their target tokens, sums the count
  over processes (one scalar all-reduce), and each micro-batch back-propagates
  ``S x K x W / N``. The engine's ``1/K`` and ``1/W`` cancel, and the update is
  ``sum S / N``: one big batch on one process, partial windows included.
- The engine clips with the config's ``gradient_clipping``, at its step: the
  config must say the run's ``--max_grad_norm`` (0: no clipping).

The plugin from the run's flags and the refusals are :mod:`.deepspeed_config`; the look-ahead
normaliser :mod:`.lookahead`. What each stage sends per window is in docs/deepspeed.md.
"""

from __future__ import annotations

import dataclasses

from ..errors import UsageError
from .base import Engine
from .deepspeed_config import (EXTRA_FIX, check_batch_sizes, check_deepspeed_installed,  # noqa: F401 (their old home)
                               check_model_saving, deepspeed_plugin_for, launched_plugin, refuse_ab_profiling,
                               refuse_changing_k, written_config)
from .lookahead import LookaheadNormalizer, count_items  # noqa: F401 (count_items: its old home)
from .policies import AccumulationPolicy


class ZeroEngine(Engine):
    """DeepSpeed's engine with ZeRO stage 1, 2 or 3 (``deepspeed.initialize`` inside ``accelerator.prepare``).

    What differs from DDP (DeepSpeed 0.19.8, accelerate 1.15): the engine
    divides each loss by its own K and reduces as its stage does (ZeRO-1 on the
    boundary, ZeRO-2 and 3 every micro-batch), and runs the optimizer step,
    clipping included, inside the boundary's ``backward``; so the window's
    tokens are counted ahead (:class:`LookaheadNormalizer`), the clipping norm
    is set on the engine (:meth:`use_clipping`), K cannot change during a run,
    and the policy is the stage (``zero1``...). A scheduler ``prepare`` leaves
    unwrapped is wrapped as Accelerate wraps it elsewhere (:meth:`after_prepare`).

    Args:
        deepspeed_plugin: the caller's ``DeepSpeedPlugin``, or None (the launcher's ``ACCELERATE_DEEPSPEED_*``).
    """

    name = "deepspeed"
    compiles = False

    def __init__(self, deepspeed_plugin=None):
        super().__init__()
        self.plugin = deepspeed_plugin
        self._clipping_pinned = False  # the run's clipping was given when the engine was built

    @property
    def stage(self) -> int:
        """The ZeRO stage (from the plugin, filled from the launch)."""
        if self.plugin is None:  # read the launcher's variables once
            self.plugin = launched_plugin()
        return int(self.plugin.zero_stage)

    @property
    def label(self) -> str:
        return f"DeepSpeed ZeRO-{self.stage}" if self.plugin is not None else "DeepSpeed"

    def check_policy(self, policy) -> None:
        """Only ``no_sync`` (the default, which the stage then restates): the stage decides what a window reduces."""
        if policy.name != "no_sync":
            raise UsageError("--accumulation_policy", f"{policy.name} has no meaning under DeepSpeed: the ZeRO stage "
                             "decides what a window reduces (ZeRO-1 on the boundary only, ZeRO-2 and 3 every "
                             "micro-batch)", "drop --accumulation_policy and pick the stage with accelerate launch "
                             "--zero_stage N (or zero_stage in the accelerate config)")

    def check_request(self, policy, *, ddp_kwargs, compile_requested, world_size, on_cpu) -> None:
        check_deepspeed_installed()
        super().check_request(policy, ddp_kwargs=ddp_kwargs, compile_requested=compile_requested,
                              world_size=world_size, on_cpu=on_cpu)
        if compile_requested:
            raise UsageError("--torch_compile", "is not supported with DeepSpeed by accum-kit (not checked for "
                             "exactness or no_sync)", "drop --torch_compile, or launch with a DDP or FSDP2 config")
        if world_size < 2 and on_cpu:
            raise UsageError("--num_processes", "DeepSpeed on CPU needs at least 2 processes (one process has "
                             "nothing to shard with, and Accelerate would run it unsharded)",
                             "launch 2 or more processes, or use accelerate_configs/cpu_single.yaml")

    def accelerator_kwargs(self, kwargs, *, accumulation_steps, policy, max_grad_norm, mixed_precision):
        kwargs["deepspeed_plugin"] = self.plugin = deepspeed_plugin_for(
            self.plugin, gradient_accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)
        written = written_config().get("gradient_clipping")
        self._clipping_pinned = max_grad_norm is not None or (written is not None and written != "auto")
        return kwargs

    def resolve_policy(self, name: str) -> AccumulationPolicy:
        """``zero<N>`` for the engine's stage N (what the run records), else as for any engine (only ``no_sync``)."""
        from .policies import POLICIES

        if name == f"zero{self.stage}":
            return self.run_policy(POLICIES["no_sync"])
        return super().resolve_policy(name)

    def use_plugin(self, deepspeed_plugin) -> None:
        """Follow the Accelerator to another DeepSpeed plugin (the bench's stage sweep swaps them in one process,
        :func:`accum_kit.compat.use_deepspeed_engine`); the stage and the config are then that plugin's."""
        self.plugin = deepspeed_plugin

    def run_policy(self, policy: AccumulationPolicy) -> AccumulationPolicy:
        """The stage as the run's policy: ``zero1`` reduces on the boundary only, ``zero2``/``zero3`` every micro-batch."""
        stage = self.stage
        return dataclasses.replace(policy, name=f"zero{stage}", sync_each_batch=False, help=f"DeepSpeed ZeRO-{stage}: "
                                   + ("reduces on the boundary only" if stage < 2 else "reduces every micro-batch"))

    def bind(self, accelerator, on_cpu: bool) -> "ZeroEngine":
        super().bind(accelerator, on_cpu)
        if on_cpu:
            from ..compat import enable_deepspeed_on_cpu

            enable_deepspeed_on_cpu(accelerator, self.plugin)
        return self

    def before_prepare(self, accelerator, objects) -> None:
        """Check the batch sizes; then each block of experts (:func:`accum_kit.engines.moe.expert_blocks`): under
        ZeRO-3 a leaf module, under ZeRO-2 its experts' gradients put in one order on every rank
        (:func:`accum_kit.engines.moe.order_expert_gradients`); see :mod:`.moe`."""
        import torch

        from ..compat.deepspeed_internals import make_zero3_leaf_modules
        from .moe import expert_blocks, order_expert_gradients

        check_batch_sizes(accelerator, objects)
        for obj in objects:
            if not isinstance(obj, torch.nn.Module) or self.stage < 2:
                continue
            if self.stage == 3:
                make_zero3_leaf_modules(obj, expert_blocks(obj))
            elif accelerator.num_processes > 1:
                for block in expert_blocks(obj):
                    order_expert_gradients(block)

    def apply_activation_checkpointing(self, accelerator, model):
        """As the base engine, after refusing reentrant checkpointing of a model with experts under ZeRO-1/2 (its
        zero-gradient term cannot be added then: :func:`accum_kit.engines.moe.reentrant_checkpointing`).

        Raises:
            UsageError (``--gradient_checkpointing_kwargs``): ``use_reentrant: true``, ZeRO-1/2, experts.
        """
        from .moe import expert_blocks, reentrant_checkpointing

        if reentrant_checkpointing(accelerator) and self.stage < 3 and accelerator.num_processes > 1 and expert_blocks(model):
            raise UsageError("--gradient_checkpointing_kwargs", f"use_reentrant: true under ZeRO-{self.stage} cannot "
                             "give an expert without tokens its zero gradient (docs/moe.md), and the reduction then "
                             "fails", "drop use_reentrant (non-reentrant is the default), or use ZeRO-3")
        return super().apply_activation_checkpointing(accelerator, model)

    def backward(self, accelerator, loss, base_backward, **kwargs):
        """Under ZeRO-1 and 2 with several processes, for a model with per-module experts
        (:func:`accum_kit.engines.moe.expert_blocks`): ``loss`` plus :func:`accum_kit.engines.moe.zero_gradient_term`
        of the model's parameters, so that a parameter the micro-batch did not reach (an expert without tokens) still
        fills its place in DeepSpeed's reduce buckets (without it: gloo's "Received data size doesn't match expected
        size" on the first backward that reduces, measured with DeepSpeed 0.19.8). ZeRO-3 has its experts' blocks as
        leaf modules instead (:meth:`before_prepare`). A dense model's backward is DeepSpeed's own. DeepSpeed's
        optimizer steps flat partitions, so an expert no token of a window reached steps with a zero gradient
        (weight decay applies to it; docs/moe.md)."""
        from .moe import reentrant_checkpointing, with_zero_gradients

        watch = getattr(self, "forward_watch", None)
        if watch is None:
            return base_backward(loss, **kwargs)
        if self.stage < 3 and accelerator.num_processes > 1 and not reentrant_checkpointing(accelerator):
            for model in watch.ran():  # the engine being trained only (the bench prepares one per stage)
                loss = with_zero_gradients(loss, model.module.parameters())
        out = base_backward(loss, **kwargs)
        watch.backward_done(bool(accelerator.sync_gradients))
        return out

    def after_prepare(self, accelerator, objects, prepared: list) -> list:
        """Watch the forwards of the prepared DeepSpeed engines whose model has per-module experts (for
        :meth:`backward`); wrap a scheduler that ``prepare`` returned as it came (one prepared without the model).

        Accelerate wraps a scheduler in ``AcceleratedScheduler`` (which steps it
        once per process per optimizer step, its convention, and which
        ``save_state`` saves) everywhere but in a DeepSpeed ``prepare`` call
        that holds no model (accelerate 1.15): there it comes back unwrapped,
        steps once per optimizer step and is not checkpointed. Wrapping it the
        same way keeps one convention for every engine.
        """
        from ..compat import wrap_prepared_scheduler
        from .moe import expert_blocks, watch_prepared

        # Only engines whose model has per-module experts need the zero-gradient term (:meth:`backward`).
        watch_prepared(self, [m for m in prepared if self.prepared_engine(m) is not None and expert_blocks(m.module)])
        return [wrap_prepared_scheduler(accelerator, obj) if obj is out else out
                for obj, out in zip(objects, prepared)]

    def reduces_each_micro_batch(self, accelerator, policy) -> bool:
        """True under ZeRO-2 and 3 with several processes: their gradients are partitioned, so every backward reduces."""
        return accelerator.num_processes > 1 and self.stage >= 2

    def window_normalizer(self, accelerator, mode: str, loss_fn):
        """:class:`LookaheadNormalizer` for ``tokens`` (the engine owns the gradients); ``mean`` as under DDP."""
        if mode == "tokens":
            return LookaheadNormalizer(accelerator, loss_fn)
        return super().window_normalizer(accelerator, mode, loss_fn)

    def check_schedule(self, schedule) -> None:
        """Refuse a schedule whose K changes (:func:`accum_kit.engines.deepspeed_config.refuse_changing_k`)."""
        refuse_changing_k(schedule)

    def use_clipping(self, accelerator, max_grad_norm: float | None) -> None:
        """Make the engine clip at the loop's ``max_grad_norm``: DeepSpeed clips inside its own step.

        A value given when the engine was built (``build_accelerator(max_grad_norm=...)``, or a number in the
        DeepSpeed JSON) must agree; otherwise the loop's value is set on the built engine
        (:func:`accum_kit.compat.set_deepspeed_clipping`).

        Raises:
            UsageError (``--max_grad_norm``): the loop's value contradicts the one the engine was built with.
        """
        have = float(self.plugin.deepspeed_config.get("gradient_clipping") or 0.0)
        want = 0.0 if max_grad_norm is None else float(max_grad_norm)
        if have == want:
            return
        if self._clipping_pinned:
            raise UsageError("--max_grad_norm", f"the DeepSpeed engine was built to clip at {have or 'no norm'} "
                             f"(build_accelerator's max_grad_norm or the DeepSpeed config's gradient_clipping) but "
                             f"the loop was given {max_grad_norm}", "give max_grad_norm in one place: to train_loop "
                             "(and leave gradient_clipping \"auto\" in the DeepSpeed config), or the same value to both")
        from ..compat import set_deepspeed_clipping

        engines = [m for m in accelerator._models if self.prepared_engine(m) is not None]
        for engine in engines:
            set_deepspeed_clipping(engine, want)
        self.plugin.deepspeed_config["gradient_clipping"] = want
        self.plugin.gradient_clipping = want

    def held_tensors(self, model):
        from ..compat import deepspeed_held_gradients

        if self.prepared_engine(model) is None:
            yield from super().held_tensors(model)
            return
        yield from deepspeed_held_gradients(model)

    def window_costs(self, accelerator, model, accumulation_steps, policy):
        """:func:`accum_kit.engines.costs.zero_costs` of the engine's stage (``policy`` is its name, ``zero2``...;
        ZeRO-3's ``ds_numel``: the unpartitioned size), b_p the element size of the module's parameters: DeepSpeed
        casts the module to its config's bf16 / fp16, and its gradients, their reduction and the partitions it holds
        between micro-batches are in that dtype (DeepSpeed 0.19.8; 2 bytes under bf16, where 4 predicted twice the
        held gradient bytes)."""
        from .costs import zero_costs

        trainable = [p for p in model.parameters() if p.requires_grad]
        P = sum(getattr(p, "ds_numel", p.numel()) for p in trainable)
        # frozen weights (LoRA's base model): held (ZeRO-3: partitioned), never reduced, no optimizer state
        F = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if not p.requires_grad)
        groups = len(getattr(getattr(model, "optimizer", None), "param_groups", None) or [None])
        return zero_costs(f"zero{self.stage}", P, world_size=accelerator.num_processes,
                          accumulation_steps=accumulation_steps, param_groups=groups,
                          param_bytes=trainable[0].element_size() if trainable else 4, frozen_parameters=F)

    def predicted_memory(self, accelerator, model, accumulation_steps, policies) -> dict:
        """One entry, the stage (``"zero2"``...): :meth:`window_costs`; the stage is the run's only policy."""
        return {f"zero{self.stage}": self.window_costs(accelerator, model, accumulation_steps, None).to_dict()}

    def compute_precision(self, accelerator) -> str:
        """``"bf16"``, ``"fp16"`` or ``"no"``, from the DeepSpeed config (``bf16.enabled`` / ``fp16.enabled``).

        On CPU the Accelerator's own ``mixed_precision`` says ``"no"``
        (:func:`accum_kit.compat.enable_deepspeed_on_cpu`), because DeepSpeed casts
        the model itself (its weights and gradients in that dtype, the optimizer's
        master copy in float32), not Accelerate's autocast.
        """
        config = self.plugin.deepspeed_config
        for name, key in (("bf16", "bf16"), ("fp16", "fp16")):
            if str((config.get(key) or {}).get("enabled", False)).lower() == "true":
                return name
        return "no"

    def casts_model(self) -> bool:
        return True

    def summary_blocks(self, accelerator) -> dict:
        """``{"fsdp": None, "deepspeed": {"zero_stage", "gradient_accumulation_steps", "gradient_clipping",
        "train_micro_batch_size_per_gpu"}}`` from the config the engine was built with."""
        config = self.plugin.deepspeed_config
        return {"fsdp": None, "deepspeed": {"zero_stage": self.stage, **{k: config.get(k) for k in (
            "gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu")}}}

    def checkpoint_tag(self, accelerator) -> str:
        return f"deepspeed_zero{self.stage}"

    def check_job(self, *, profile_ab_steps: int = 0, auto_find_batch_size: bool = False) -> None:
        """Refuse ``--profile_ab_steps`` (the stage fixes when gradients are reduced), ``--auto_find_batch_size`` and
        a ZeRO-3 run whose config cannot save the trained model (:mod:`accum_kit.engines.deepspeed_config`).

        Raises:
            UsageError: ``--auto_find_batch_size``: DeepSpeed's config fixes ``train_micro_batch_size_per_gpu`` and
                ``gradient_accumulation_steps`` (and ``train_batch_size``, their product), and its checkpoints
                record them; resuming one with another split is not something this toolkit has verified.
        """
        if auto_find_batch_size:
            raise UsageError("--auto_find_batch_size", "DeepSpeed's engine fixes the micro-batch and K in its config "
                             "and its checkpoints, and resuming them re-split is not verified here",
                             "find the micro-batch under DDP or FSDP2 (the same model and memory), or set "
                             "--per_device_train_batch_size and --gradient_accumulation_steps by hand")
        refuse_ab_profiling(profile_ab_steps)
        check_model_saving(self.plugin)

    def prepared_engine(self, model):
        return model if type(model).__name__ == "DeepSpeedEngine" else None

    def profiler_part(self, profiler):
        """:class:`accum_kit.profiler.parts.ZeroPart`: DeepSpeed's communication backend and the ZeRO optimizer's
        reduction path, reported for the stage."""
        from ..profiler.parts import ZeroPart

        return ZeroPart(profiler, stage=self.stage)

    def owns_backward(self) -> bool:
        """True: the engine's ``backward`` divides the loss by its K, reduces as its stage does and steps."""
        return True
