"""Activation ("gradient") checkpointing: the flags, and how the base engine applies it to a model.

``--gradient_checkpointing`` recomputes each transformer block's forward in
backward instead of keeping its activations (transformers' ``TrainingArguments``
name); ``--gradient_checkpointing_kwargs`` is a JSON object of arguments for
``torch.utils.checkpoint.checkpoint`` (transformers' spelling, e.g.
``'{"use_reentrant": false}'``). :func:`accum_kit.build_accelerator` resolves
them once per run (:meth:`accum_kit.engines.base.Engine.resolve_activation_checkpointing`),
keeps them on the run plan (``RunPlan.gradient_checkpointing``,
``RunPlan.gradient_checkpointing_kwargs``) and applies them inside
``accelerator.prepare`` (:meth:`accum_kit.engines.base.Engine.apply_activation_checkpointing`),
so a user's loop runs unchanged.

How each engine applies it (one checkpoint per transformer block, non-reentrant by default):

- DDP, one process, DeepSpeed ZeRO (:func:`apply_to_model`): a transformers ``PreTrainedModel``
  through its own ``activation_checkpointing_enable(activation_checkpointing_kwargs=...)``
  (transformers 5; ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` on
  transformers 4); any other ``nn.Module`` gets torch's checkpoint wrapper around each block
  (:func:`transformer_blocks`). torch's default ``preserve_rng_state=True`` holds, so a dropout
  layer draws the same mask in the recompute as in the forward.
- FSDP2 / HSDP: Accelerate's own ``fsdp_plugin.activation_checkpointing`` (the checkpoint
  wrapper around each block that becomes an FSDP unit, before ``fully_shard``, as torchtitan
  does): non-reentrant and ``preserve_rng_state=False``, fixed; see :mod:`accum_kit.engines.fsdp2`.

No torch import at module level (the train job's ``--help`` stays fast).
"""

from __future__ import annotations

import json
from dataclasses import field

from ..errors import UsageError

FLAG = "--gradient_checkpointing"
KWARGS_FLAG = "--gradient_checkpointing_kwargs"
#: the arguments of ``torch.utils.checkpoint.checkpoint`` a JSON object can carry, and their types
#: (torch 2.13; ``context_fn`` is a callable and cannot come from JSON)
CHECKPOINT_KWARGS = {"use_reentrant": bool, "preserve_rng_state": bool, "determinism_check": str, "debug": bool,
                     "early_stop": bool}
#: what a run gets when it names no argument: transformers' and torch's recommended default
DEFAULT_KWARGS = {"use_reentrant": False}


def gradient_checkpointing_field():
    """The dataclass ``field`` of ``--gradient_checkpointing`` (a flag of train, verify and bench)."""
    return field(default=False, metadata={"help": "Activation checkpointing: recompute each transformer block's "
                 "forward in backward instead of keeping its activations (less memory, about one more forward of "
                 "compute); exact under every engine (docs/memory.md)."})


def gradient_checkpointing_kwargs_field():
    """The dataclass ``field`` of ``--gradient_checkpointing_kwargs`` (a JSON object, parsed to a dict)."""
    return field(default=None, metadata={"help": "With --gradient_checkpointing: arguments of torch.utils.checkpoint."
                 "checkpoint as a JSON object, e.g. '{\"use_reentrant\": false}' (the default); keys: "
                 f"{sorted(CHECKPOINT_KWARGS)}."})


def parse_checkpointing_kwargs(value) -> dict | None:
    """``--gradient_checkpointing_kwargs`` as a dict: a JSON object string, a dict, or None / ``""`` (None).

    Raises:
        UsageError (``--gradient_checkpointing_kwargs``): not JSON, not an object, a key that
            ``torch.utils.checkpoint.checkpoint`` does not take from JSON, or a value of the wrong type.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    example = 'pass a JSON object, e.g. \'{"use_reentrant": false}\''
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise UsageError(KWARGS_FLAG, f"is not valid JSON ({err.msg} at character {err.pos})", example) from None
    if not isinstance(value, dict):
        raise UsageError(KWARGS_FLAG, f"must be a JSON object, got {type(value).__name__}", example)
    for key, v in value.items():
        if key not in CHECKPOINT_KWARGS:
            raise UsageError(KWARGS_FLAG, f"{key!r} is not an argument of torch.utils.checkpoint.checkpoint that "
                             "JSON can carry", f"use only {sorted(CHECKPOINT_KWARGS)}")
        if not isinstance(v, CHECKPOINT_KWARGS[key]):
            kind = {"bool": "bool", "str": "string"}[CHECKPOINT_KWARGS[key].__name__]
            raise UsageError(KWARGS_FLAG, f"{key} must be a JSON {kind}, got {v!r}", example)
    return dict(value)


def resolve_checkpointing(enabled: bool, kwargs) -> tuple[bool, dict]:
    """``(enabled, kwargs in force)``: ``{}`` when off, else :data:`DEFAULT_KWARGS` updated with the given ones.

    Arguments without the switch are refused, not ignored (transformers ignores them silently):
    they say the user meant to checkpoint.

    Raises:
        UsageError: bad ``kwargs`` (:func:`parse_checkpointing_kwargs`), or ``kwargs`` without ``enabled``
            (``--gradient_checkpointing_kwargs``).
    """
    parsed = parse_checkpointing_kwargs(kwargs)
    if not enabled:
        if parsed is not None:
            raise UsageError(KWARGS_FLAG, "given without --gradient_checkpointing (it would do nothing)",
                             "add --gradient_checkpointing, or drop --gradient_checkpointing_kwargs")
        return False, {}
    return True, {**DEFAULT_KWARGS, **(parsed or {})}


def transformer_blocks(model) -> list[str]:
    """Qualified names of ``model``'s transformer blocks, outermost first, none inside another.

    Found as transformers finds them: instances of ``GradientCheckpointingLayer`` (transformers 5's
    base class of every decoder layer); else modules whose class is named in ``model._no_split_modules``
    (the blocks transformers and Accelerate never split); else the children of an ``nn.ModuleList``
    of two or more modules of one class (a stack of layers). ``[]`` when none is found.
    """
    import torch

    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers 4 before the base class, or no transformers
        GradientCheckpointingLayer = ()
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    tests = [lambda m: isinstance(m, GradientCheckpointingLayer), lambda m: type(m).__name__ in no_split]
    named = list(model.named_modules())
    for test in tests:
        found = _outermost([n for n, m in named if n and test(m)])
        if found:
            return found
    stacks = [f"{n}.{i}" if n else str(i) for n, m in named if isinstance(m, torch.nn.ModuleList) and len(m) >= 2
              and len({type(c) for c in m}) == 1 for i in range(len(m))]
    return _outermost(stacks)


def _outermost(names: list[str]) -> list[str]:
    kept = []
    for n in sorted(names, key=lambda s: s.count(".")):
        if not any(n.startswith(k + ".") for k in kept):
            kept.append(n)
    return sorted(kept, key=names.index)


def apply_to_model(model, kwargs: dict):
    """Checkpoint every transformer block of ``model`` with ``torch.utils.checkpoint`` arguments ``kwargs``.

    A transformers model that supports it: its own method (see the module docstring); it also makes the
    input embeddings' output require grad, which the reentrant implementation needs. Any other module:
    torch's checkpoint wrapper (:func:`accum_kit.compat.torch_checkpoint.checkpoint_wrapper`) around each
    of :func:`transformer_blocks`. A model checkpointed already is returned as it is. A peft ``PeftModel``: its
    base model is checkpointed so (with frozen embeddings, the reentrant implementation would otherwise pass no
    gradient to the adapters in the blocks).

    Returns:
        ``model`` (changed in place).

    Raises:
        UsageError (``--gradient_checkpointing``): no transformer block found.
    """
    from ..compat.torch_checkpoint import checkpoint_wrapper, is_checkpoint_wrapper

    if callable(getattr(type(model), "get_base_model", None)):  # a peft PeftModel: its transformers model checkpoints
        apply_to_model(model.get_base_model(), kwargs)  # (and makes the frozen embeddings' output require grad)
        return model
    on = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # transformers 5 / 4
    if getattr(model, on, False) or any(is_checkpoint_wrapper(m) for m in model.modules()):
        return model
    if getattr(model, "supports_gradient_checkpointing", False):
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers 5
            enable(activation_checkpointing_kwargs=dict(kwargs))
        else:  # transformers 4
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(kwargs))
        return model
    blocks = transformer_blocks(model)
    if not blocks:
        raise UsageError(FLAG, f"no transformer blocks found in {type(model).__name__} (no GradientCheckpointingLayer, "
                         "no class named in _no_split_modules, no nn.ModuleList of repeated layers)",
                         "drop --gradient_checkpointing, keep the model's layers in an nn.ModuleList, or name the "
                         "block class in the model's _no_split_modules")
    options = dict(kwargs)
    reentrant = options.pop("use_reentrant", False)
    for name in blocks:
        model.set_submodule(name, checkpoint_wrapper(model.get_submodule(name), use_reentrant=reentrant, **options))
    return model


def turn_cache_off(model) -> bool:
    """Set ``model.config.use_cache = False`` (a transformers model); True if it was on.

    A block wrapped by torch's checkpoint wrapper (Accelerate's FSDP2 checkpointing) runs its whole forward
    again in backward, and a transformers 5 model with ``use_cache=True`` (GPT-2's default) builds a key/value
    cache in training too: the recompute appends to it a second time and backward fails (measured, GPT-2,
    transformers 5.24: "The size of tensor a (48) must match the size of tensor b (24)"). transformers' own
    checkpointing turns the cache off in each layer for the same reason.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return False
    config.use_cache = False
    return True


def active_dropout(model) -> list[str]:
    """Names of ``model``'s dropout modules with ``p > 0`` (what a recompute without the RNG state changes)."""
    import torch

    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
