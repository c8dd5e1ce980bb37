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

from ..core.token_ranks import TokenRanks
from ..errors import UsageError
from .mesh import Mesh
from .sequence_split import check_heads, split_sequences

TP_FLAG = "--parallelism_config_tp_size"
CP_FLAG = "--parallelism_config_cp_size"


EP_FLAG = "ep_size"


def refuse_expert_parallel(model: torch.nn.Module) -> None:
    """Refuse a model split over an expert-parallel mesh dimension (out of scope: experts are data here).

    transformers splits a mixture of experts' experts over processes when the model is loaded with
    ``DistributedConfig(ep_size > 1)`` (or the removed ``enable_expert_parallel``); it keeps that config as
    ``model.config.distributed_config``. Each process would then hold other experts and the window's token
    counts per expert would need an all-to-all of their own.

    Raises:
        UsageError (``ep_size``): such a model.
    """
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    ep = getattr(config, "ep_size", None) or (2 if getattr(config, "enable_expert_parallel", False) else 1)
    if ep > 1:
        raise UsageError(EP_FLAG, f"the model was loaded with expert parallelism (ep_size {ep}): accum-kit "
                         "accumulates over data, tensor and context parallel meshes only",
                         "load it without distributed_config's ep_size / enable_expert_parallel (every process "
                         "holds every expert; FSDP2 shards them), or train it outside accum-kit")


def prepare_model(accelerator, mesh: Mesh, model: torch.nn.Module, optimizers=()) -> None:
    """Split ``model`` in place for the mesh's tp and cp dimensions (no-op without them); ``optimizers`` (handed to
    the same ``prepare``) are switched to the split parameters.

    Raises:
        UsageError: tp or cp not dividing the attention heads; tp > 1 for a model without a tp plan (GPT-2), or for
            a model carrying peft adapters (LoRA).
    """
    from ..compat.tensor_parallel import apply_tp_plan, is_tensor_parallel, tp_plan_of

    if mesh.tp > 1:
        refuse_adapters_under_tp(model, mesh.tp)
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


def refuse_adapters_under_tp(model: torch.nn.Module, tp: int) -> None:
    """Refuse tensor parallel for a model with peft adapters (a ``PeftModel``, or LoRA layers inside it).

    transformers' tp plan names the model's own linear layers (``...self_attn.q_proj``: colwise), and peft has
    replaced those by its LoRA wrappers, whose base layer then sits one level deeper and whose ``lora_A`` / ``lora_B``
    no plan names: the split would leave the adapters replicated beside a sharded base weight, and the adapters'
    output would be added to a shard of the projection. No exactness check covers it, so it is refused.

    Raises:
        UsageError (``--parallelism_config_tp_size``).
    """
    from ..compat.peft_adapters import is_adapted

    if is_adapted(model):
        raise UsageError(TP_FLAG, f"is {tp}, but the model carries peft adapters (LoRA): tensor parallel of an "
                         "adapted model is not supported", "train the adapters with data parallel only (DDP, FSDP2 "
                         "or HSDP: the adapters are small, the frozen weights shard under FSDP2), or set tp_size 1")


def token_ranks(accelerator, mesh: Mesh):
    """The :class:`accum_kit.core.token_ranks.TokenRanks` of the mesh: the ``dp_cp`` group of this process's tp
    coordinate (every process when there is no tp), and under cp this rank's slice of each sequence."""
    if mesh.tp == 1 and mesh.cp == 1:
        return TokenRanks(accelerator)
    device_mesh = accelerator.torch_device_mesh
    split = None
    if mesh.cp > 1:
        split = functools.partial(split_sequences, rank=device_mesh["cp"].get_local_rank(), size=mesh.cp)
    return TokenRanks(accelerator, group=device_mesh["dp_cp"].get_group(), size=mesh.token_ranks, cp=mesh.cp,
                      split=split)


#: The two public miscounts of a window's tokens under tp / cp, by the name of ``accum-kit verify``'s informational
#: row that runs each for real: the bug it reproduces.
WORLD_COUNT = "tokens counted over every process"
CP_SLICE_COUNT = "tokens of the local cp slice only"
MISCOUNT_BUGS = {
    WORLD_COUNT: "count over the world x tp: the tokens summed over every process, tp duplicates included, so "
                 "each token is counted tp_size times and the update is 1/tp of the exact one",
    CP_SLICE_COUNT: "count of the local cp slice: each rank divides by its own slice's tokens summed over the "
                    "data-parallel ranks only (its cp peers' slices left out), undercounting by a factor of about "
                    "cp, by a different factor on each rank",
}


def miscounts(accelerator, mesh: Mesh | None) -> dict:
    """The :class:`accum_kit.core.token_ranks.TokenRanks` of the public miscounts on this mesh, by
    :data:`MISCOUNT_BUGS` row name; empty without tp and cp (or without a mesh).

    - tp > 1: :data:`WORLD_COUNT`, every process (``accelerator.reduce``), tp ranks included;
    - cp > 1: :data:`CP_SLICE_COUNT`, this rank's slice summed over the data-parallel ranks of its cp (and tp)
      coordinate (Accelerate's flattened ``dp`` mesh dimension) only.

    Both keep the run's own sequence split, so only the count differs from :func:`token_ranks`. For measuring
    (``accum-kit verify``), never for training.
    """
    if mesh is None or (mesh.tp == 1 and mesh.cp == 1):
        return {}
    split = token_ranks(accelerator, mesh).split
    out = {}
    if mesh.tp > 1:
        out[WORLD_COUNT] = TokenRanks(accelerator, split=split)
    if mesh.cp > 1:
        if mesh.data_parallel_size > 1:
            dp = accelerator.torch_device_mesh["dp"]  # (dp_replicate, dp_shard) flattened by Accelerate
            out[CP_SLICE_COUNT] = TokenRanks(accelerator, group=dp.get_group(), size=dp.size(), split=split)
        else:
            out[CP_SLICE_COUNT] = _OwnRank(accelerator, size=1, split=split)
    return out


class _OwnRank(TokenRanks):
    """Token ranks of one process only (a mesh whose data-parallel size is 1): a sum is this rank's own value."""

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.accelerator.device).clone()
