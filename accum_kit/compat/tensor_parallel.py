"""Tensor and context parallel: the transformers and Accelerate internals the FSDP2 engine uses for them.

Checked with transformers 5.24, accelerate 1.15, torch 2.13 (CPU, gloo):

- transformers keeps a model's tensor-parallel plan on the model (``model.tp_plan``: ``colwise`` q, k, v, gate,
  up; ``rowwise`` o, down; a vocabulary-parallel embedding; ``lm_head`` column-parallel with its output
  gathered) and applies it while loading (``from_pretrained(..., tp_plan="auto")``). A model built from a config
  gets the same plan from ``transformers.distributed.tensor_parallel.apply_tensor_parallelism`` with the plan
  expanded to concrete module names by ``PreTrainedModel._expand_parallel_plan`` (private). Each weight becomes a
  ``DTensor`` on the tp mesh, cut from the process's own full tensor (no broadcast: every process must hold the
  same initial weights, which a seeded build gives); the RMSNorm weights stay plain tensors, identical on every
  tp rank, with identical gradients.
- ``Accelerator.prepare`` under ``tp_size > 1`` calls ``Accelerator._prepare_tp``, which imports
  ``transformers.integrations.tensor_parallel.ReplicateParallel``: transformers 5 removed it (ImportError).
  Its job was to turn the plain parameters into tp-replicated ``DTensor``s; the engine does not need that (FSDP2
  shards the plain ones over the data-parallel dimension, Accelerate's ``clip_grad_norm_`` takes the norm per
  mesh, so each counts once), so :func:`accelerate_tp_cp_prepare_off` skips it for the call.
- ``Accelerator.prepare`` under ``cp_size > 1`` calls ``Accelerator._prepare_cp``, which sets up torch's ring
  attention (``context_parallel``); on CPU it has no kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
  has no sharding strategy), and the engine splits sequences with Ulysses instead
  (:mod:`accum_kit.compat.ulysses`), so it is skipped there too; on GPUs it runs.
"""

from __future__ import annotations

import contextlib


def tp_plan_of(model) -> dict:
    """The model's tensor-parallel plan by concrete module / parameter name (empty: the model has none).

    Args:
        model: a transformers ``PreTrainedModel`` (or anything else: then ``{}``).
    """
    plan = dict(getattr(model, "tp_plan", None) or {})
    expand = getattr(model, "_expand_parallel_plan", None)
    if not plan or expand is None:
        return {}
    return expand(plan)


def is_tensor_parallel(model) -> bool:
    """True when some parameter of ``model`` is already a ``DTensor`` (a plan applied, e.g. by ``from_pretrained``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def apply_tp_plan(model, tp_mesh, optimizers=()) -> None:
    """Shard ``model`` over ``tp_mesh`` with its own transformers tp plan (in place), and point ``optimizers`` at it.

    The plan replaces each split weight by a new ``Parameter`` holding a ``DTensor``; an optimizer built
    before (the usual order: model, optimizer, then ``prepare``) still holds the old ones, so its parameter
    groups are switched by parameter name, as Accelerate does for FSDP2's sharded parameters.

    Args:
        model: a transformers model with a ``tp_plan`` whose weights are identical on every process.
        tp_mesh: the 1-D ``DeviceMesh`` of the tp dimension.
        optimizers: optimizers over ``model``'s parameters, with no state yet.

    Raises:
        ValueError: an optimizer that already holds state (it would keep the unsplit tensors).
    """
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    for opt in optimizers:
        if opt.state:
            raise ValueError("the optimizer has state already: build it (or load its state) after prepare")
    before = dict(model.named_parameters())
    apply_tensor_parallelism(model, tp_mesh, tp_plan_of(model))
    after = dict(model.named_parameters())
    switched = {id(p): after[name] for name, p in before.items() if after[name] is not p}
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [switched.get(id(p), p) for p in group["params"]]


@contextlib.contextmanager
def accelerate_tp_cp_prepare_off(accelerator, *, tp: bool, cp: bool):
    """Inside: ``accelerator.prepare`` skips ``_prepare_tp`` (``tp``) and ``_prepare_cp`` (``cp``); see the module docstring.

    Both are instance attributes for the call's duration (the class's methods are untouched).
    """
    skipped = [name for name, on in (("_prepare_tp", tp), ("_prepare_cp", cp)) if on]
    for name in skipped:
        setattr(accelerator, name, lambda *args: list(args) if name == "_prepare_tp" else args)
    try:
        yield
    finally:
        for name in skipped:
            accelerator.__dict__.pop(name, None)
