"""Tensor and context parallel inside the FSDP2 engine: what the model gets before ``prepare``, how tokens count.

A mesh ``dp_replicate x dp_shard x cp x tp`` (Accelerate's ``ParallelismConfig``; :class:`accum_kit.engines.mesh.Mesh`):

- tp: the model's own transformers tp plan is applied on the tp dimension before FSDP2 shards it over the
  data-parallel one (:func:`accum_kit.compat.tensor_parallel.apply_tp_plan`), unless the model arrives already
  split (``from_pretrained(..., tp_plan="auto", device_mesh=accelerator.torch_device_mesh["tp"])``). The tp
  ranks of a data-parallel rank read the same micro-batches, so the window's tokens are counted over the
  ranks of one tp coordinate only (the ``dp_cp`` group), and FSDP2 averages gradients over ``R x S x cp``
  processes, not over tp: the normaliser's rescale uses that W.
- cp: each cp rank keeps one slice of every sequence (:func:`accum_kit.engines.sequence_split.split_sequences`)
  and attention exchanges the slices Ulysses-style (:func:`accum_kit.compat.ulysses.install_ulysses_attention`),
  on CPU and GPU alike (torch's ring attention has no CPU kernel). Every cp rank holds different tokens:
  they are counted over all of them, and FSDP2 averages over them too.

Megatron-LM's rule, the same: sum the loss over the tokens of the data-parallel x context-parallel ranks,
divide by their count, never multiply by tp (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053).
"""

from __future__ import annotations

import functools

import torch

from ..errors import UsageError
from .mesh import Mesh
from .sequence_split import check_heads, split_sequences

TP_FLAG = "--parallelism_config_tp_size"
CP_FLAG = "--parallelism_config_cp_size"


def prepare_model(accelerator, mesh: Mesh, model: torch.nn.Module, optimizers=()) -> None:
    """Split ``model`` in place for the mesh's tp and cp dimensions (no-op without them); ``optimizers`` (handed to
    the same ``prepare``) are switched to the split parameters.

    Raises:
        UsageError: tp or cp not dividing the attention heads; tp > 1 for a model without a tp plan (GPT-2).
    """
    from ..compat.tensor_parallel import apply_tp_plan, is_tensor_parallel, tp_plan_of

    if mesh.tp > 1:
        check_heads(model, mesh.tp, TP_FLAG)
        if not is_tensor_parallel(model):
            if not tp_plan_of(model):
                raise UsageError(TP_FLAG, f"is {mesh.tp}, but {type(model).__name__} has no tensor-parallel plan "
                                 "(transformers' tp_plan; GPT-2 has none)", "use a model with one (the Llama "
                                 "presets llama_tiny / llama_small, or a Llama, Mistral, Qwen2 checkpoint), or "
                                 "set tp_size 1")
            apply_tp_plan(model, accelerator.torch_device_mesh["tp"], optimizers)
    if mesh.cp > 1:
        from ..compat.ulysses import install_ulysses_attention

        check_heads(model, mesh.cp, CP_FLAG)
        install_ulysses_attention(model, accelerator.torch_device_mesh["cp"].get_group())


def token_ranks(accelerator, mesh: Mesh):
    """The :class:`accum_kit.core.token_ranks.TokenRanks` of the mesh: the ``dp_cp`` group of this process's tp
    coordinate (every process when there is no tp), and under cp this rank's slice of each sequence."""
    from ..core.token_ranks import TokenRanks

    if mesh.tp == 1 and mesh.cp == 1:
        return TokenRanks(accelerator)
    device_mesh = accelerator.torch_device_mesh
    split = None
    if mesh.cp > 1:
        split = functools.partial(split_sequences, rank=device_mesh["cp"].get_local_rank(), size=mesh.cp)
    return TokenRanks(accelerator, group=device_mesh["dp_cp"].get_group(), size=mesh.token_ranks, cp=mesh.cp,
                      split=split)
