"""The Accelerator :func:`accum_kit.build_accelerator` returns: Accelerate's, with the run's engine inside two calls."""

from __future__ import annotations

import contextlib

import torch
from accelerate import Accelerator


class AccumulationAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose ``prepare`` and ``no_sync`` let the run's engine act.

    It keeps Accelerate's contract (``accumulate``, ``no_sync``,
    ``sync_gradients``, ``gradient_state``, the plugins' arguments); the run's
    :class:`accum_kit.core.run_plan.RunPlan` (``run_plan``) says which engine
    and policy apply:

    - ``prepare``: the engine checks the objects first (DeepSpeed: the
      config's batch sizes against the dataloader) and may complete what
      Accelerate returns (DeepSpeed: a scheduler prepared without the model is
      wrapped as everywhere else, so it steps once per process per optimizer
      step and ``save_state`` saves it);
    - ``prepare`` with ``run_plan.gradient_checkpointing``: the engine checkpoints each model's
      transformer blocks first (:meth:`accum_kit.engines.base.Engine.apply_activation_checkpointing`);
    - ``no_sync(model)`` (which ``accumulate(model)`` enters on every
      non-boundary micro-batch): the engine adds the policy's switches (FSDP2:
      keep parameters gathered after backward; HSDP: skip only the all-reduce
      across replicas) and, after the backward, zero gradients where FSDP2 needs them;
    - ``backward(loss)``: the engine may add a zero-valued term that gives every parameter a gradient
      (DDP, DeepSpeed; :mod:`accum_kit.engines.moe`).

    Attributes:
        run_plan: the run's :class:`~accum_kit.core.run_plan.RunPlan`.
    """

    run_plan = None

    @property
    def accumulation_policy(self):
        """The accumulation policy in force (:attr:`RunPlan.policy <accum_kit.core.run_plan.RunPlan.policy>`)."""
        return self.run_plan.policy

    def prepare(self, *args, **kwargs):
        """``Accelerator.prepare``, with the engine's checks before and its completion after (see the class docstring)."""
        engine = self.run_plan.engine
        if self.run_plan.gradient_checkpointing:  # on the bare model, before any wrapper (DDP, FSDP2, compile)
            args = tuple(engine.apply_activation_checkpointing(self, a) if isinstance(a, torch.nn.Module) else a
                         for a in args)
        from .model_parallel import refuse_expert_parallel

        for a in args:
            if isinstance(a, torch.nn.Module):
                refuse_expert_parallel(a)  # every engine: expert parallel is out of scope
        engine.before_prepare(self, args)
        with engine.preparing(self):
            out = super().prepare(*args, **kwargs)
        single = len(args) == 1
        prepared = engine.after_prepare(self, args, [out] if single else list(out))
        return prepared[0] if single else tuple(prepared)

    def backward(self, loss, **kwargs):
        """``Accelerator.backward``, through the run's engine (:meth:`accum_kit.engines.base.Engine.backward`: DDP and
        DeepSpeed give every parameter a gradient where the backward reduces, see :mod:`accum_kit.engines.moe`)."""
        return self.run_plan.engine.backward(self, loss, super().backward, **kwargs)

    @contextlib.contextmanager
    def no_sync(self, model):
        """``Accelerator.no_sync``, plus the policy's switches of the run's engine."""
        with self.run_plan.no_sync(model, super().no_sync):
            yield
