"""Ulysses sequence parallelism for transformers' attention, on DeepSpeed's ``DistributedAttention``.

With the sequence split over ``cp`` processes, every process holds ``seq / cp`` tokens of each sequence. Before
attention one all-to-all per tensor trades the sequence split for a head split (each process then holds all
tokens of ``heads / cp`` heads), attention runs causal over the whole sequence, and one more all-to-all trades
back (DeepSpeed-Ulysses, Jacobs et al. 2023, https://arxiv.org/abs/2309.14509). DeepSpeed's
``deepspeed.sequence.layer.DistributedAttention`` does the exchanges (forward and backward) over any process
group, gloo included (checked on 2 and 4 CPU processes, DeepSpeed 0.19.8, torch 2.13).

It is wired into a transformers model (5.x) through its attention registry: an attention function registered
under :data:`ATTENTION_NAME` in ``transformers.AttentionInterface`` and set as the model config's
``_attn_implementation``; a mask function under the same name in ``AttentionMaskInterface`` returns None (the
attention is causal by itself; a right-padded batch needs no more, since no real token attends to a later pad).
"""

from __future__ import annotations

import weakref

ATTENTION_NAME = "accum_kit_ulysses"
_groups: dict = {}  # id(config) -> the cp process group of that model (a config cannot hold it: it is saved as JSON)


def _local_attention(scaling: float):
    import torch.nn.functional as F

    def attend(query, key, value, *args, **kwargs):
        # DeepSpeed hands (batch, seq, heads / cp, head_dim); SDPA wants heads before the sequence.
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2)

    return attend


def _ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: q, k, v of shape (batch, heads, seq / cp, head_dim); returns
    ``(output of shape (batch, seq / cp, heads, head_dim), None)``."""
    from deepspeed.sequence.layer import DistributedAttention

    if dropout:
        raise ValueError("Ulysses attention here has no dropout; build the model with attention_dropout=0")
    group = _groups[id(module.config)]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    attention = DistributedAttention(_local_attention(scale), group, scatter_idx=2, gather_idx=1)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # DeepSpeed's layout: (batch, seq, heads, dim)
    return attention(q, k, v, 0), None


def _no_mask(*args, **kwargs):
    return None


def install_ulysses_attention(model, group) -> None:
    """Make every attention layer of ``model`` exchange over ``group`` (the cp process group) Ulysses-style.

    Args:
        model: a transformers 5 model whose attention dispatches through ``AttentionInterface``
            (Llama, Mistral, Qwen2, ...); its attention dropout must be 0.
        group: the ``torch.distributed`` process group of the cp dimension (every process of it holds a
            slice of the same sequences, in rank order).

    Raises:
        ImportError: DeepSpeed is not installed (``pip install "accum-kit[deepspeed]"``).
    """
    import deepspeed
    import torch.distributed as dist
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not deepspeed.comm.is_initialized():  # wraps the existing torch.distributed group, opens nothing new
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    AttentionInterface.register(ATTENTION_NAME, _ulysses_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        if id(config) not in _groups:  # forget the entry with the config: a later object may reuse its id
            weakref.finalize(config, _groups.pop, id(config), None)
        _groups[id(config)] = group
        config._attn_implementation = ATTENTION_NAME
