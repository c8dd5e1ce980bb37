"""Context parallel: one micro-batch's sequences cut into ``cp`` slices, one per process of the cp group.

Every process of a cp group reads the same micro-batch (Accelerate's dataloader gives the ranks of a
data-parallel rank the same batch) and keeps slice ``r`` of every sequence: tokens ``[r T / cp, (r + 1) T / cp)``.
The labels are shifted *before* the cut (position t predicts token t + 1, as transformers' ``shift_labels``),
so the pair that straddles a boundary is counted once, on the slice holding position t; the last position of
a sequence has no target (-100). ``position_ids`` carry the global positions (rotary embeddings need them).
The attention mask is dropped: attention is causal, and a right-padded batch needs nothing more (no real token
attends to a later pad); a left-padded one is refused. A length that ``cp`` does not divide is padded on the
right to the next multiple (inputs with the pad id 0, labels with -100), which changes no loss or gradient.

So the window's target tokens summed over the data-parallel x cp ranks are exactly the single-process count
(``accum_kit.core.loss``), and never counted per tp rank.
"""

from __future__ import annotations

import torch

from ..errors import UsageError

IGNORE_INDEX = -100


def split_sequences(batch: dict, rank: int, size: int) -> dict:
    """Slice ``rank`` of ``size`` of a causal-LM micro-batch, with labels shifted before the cut.

    Args:
        batch: ``input_ids`` and ``labels`` of shape (batch, T) (labels not shifted, -100 = no target),
            optionally ``attention_mask`` (batch, T) and ``position_ids``; other keys are kept as they are.
        rank: this process's index in the cp group, 0 <= rank < size.
        size: cp, processes sharing each sequence.

    Returns:
        A new dict: ``input_ids``, ``position_ids`` and ``shift_labels`` of shape (batch, T' / size), where T' is
        T rounded up to a multiple of ``size``; no ``labels`` and no ``attention_mask``.

    Raises:
        UsageError: a left-padded batch (``attention_mask`` with a 0 before a 1), named as ``--parallelism_config_cp_size``.
    """
    ids, labels = batch["input_ids"], batch["labels"]
    mask = batch.get("attention_mask")
    if mask is not None and bool((mask[:, :-1] < mask[:, 1:]).any()):
        raise UsageError("--parallelism_config_cp_size", "a batch is padded on the left, and the context-parallel "
                         "split drops the attention mask (causal attention covers right padding only)",
                         "pad on the right (tokenizer.padding_side = 'right'), or set cp_size 1")
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    pad = (-ids.shape[1]) % size
    if pad:
        ids = torch.nn.functional.pad(ids, (0, pad), value=0)
        shifted = torch.nn.functional.pad(shifted, (0, pad), value=IGNORE_INDEX)
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=ids.device)], dim=1)
    step = ids.shape[1] // size
    cut = slice(rank * step, (rank + 1) * step)
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "attention_mask", "position_ids")}
    out.update(input_ids=ids[:, cut].contiguous(), shift_labels=shifted[:, cut].contiguous(),
               position_ids=positions[:, cut].contiguous())
    return out


def check_heads(model, size: int, flag: str) -> None:
    """Refuse a model whose attention heads (and key/value heads) ``size`` does not divide.

    Args:
        model: a transformers model (its config's ``num_attention_heads`` / ``num_key_value_heads``).
        size: tp or cp processes splitting the heads.
        flag: the flag to name (``--parallelism_config_tp_size`` or ``--parallelism_config_cp_size``).

    Raises:
        UsageError: ``size`` does not divide a head count.
    """
    config = getattr(model, "config", None)
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads is not None and heads % size:
            raise UsageError(flag, f"is {size}, which does not divide the model's {name} ({heads}): each process "
                             "must hold whole heads", f"choose a size that divides {heads}, or a model preset "
                             "with more heads (llama_small)")
