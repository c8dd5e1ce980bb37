"""The examples ``accum-kit verify`` runs: random variable-length token sequences.

Every process draws the same deterministic set of examples (random token ids,
lengths uniform in 2..32 tokens, from the seed); the prepared DataLoader
shards them, so each process runs ``K + r`` micro-batches of ``B`` examples
(right-padded per micro-batch, ``labels = -100`` on padding): one full
accumulation window of K micro-batches, then a *partial* window of
``r = ceil(K / 2)`` micro-batches (none when K = 1 or the partial window is
switched off). The partial window is the last window of an epoch, which
Accelerate closes early at the end of the dataloader (``sync_with_dataloader``)
but still divides by K.
"""

from __future__ import annotations

import random

import torch

MIN_LENGTH = 2  # tokens per example: at least one target after the shift
MAX_LENGTH = 32  # tokens per example (capped by the model's positions)
PAD_ID = 0
IGNORE_INDEX = -100  # label of padding; ignored by the loss (PyTorch's cross_entropy default)


def make_examples(n: int, seed: int, vocab_size: int, max_length: int = MAX_LENGTH) -> list[dict]:
    """``n`` examples of random token ids with random lengths (uniform in 2..max_length tokens).

    Deterministic from ``seed`` (Python's ``random.Random``), identical on every
    process. Each example is ``{"input_ids": [int], "labels": [int]}`` with
    ``labels`` equal to ``input_ids`` (the shift happens in the loss).
    """
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        length = rng.randint(MIN_LENGTH, max_length)
        ids = [rng.randrange(vocab_size) for _ in range(length)]
        examples.append({"input_ids": ids, "labels": list(ids)})
    return examples


def pad_collate(examples: list[dict], pad_id: int = PAD_ID) -> dict:
    """Right-pad to the longest example: ``input_ids`` pad id, ``attention_mask`` 0, ``labels`` -100.

    Returns int64 tensors of shape (batch, longest length in tokens).
    """
    width = max(len(e["input_ids"]) for e in examples)
    ids, mask, labels = [], [], []
    for e in examples:
        n = len(e["input_ids"])
        ids.append(list(e["input_ids"]) + [pad_id] * (width - n))
        mask.append([1] * n + [0] * (width - n))
        labels.append(list(e["labels"]) + [IGNORE_INDEX] * (width - n))
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "attention_mask": torch.tensor(mask, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
    }


def partial_micro_batches(gradient_accumulation_steps: int, partial_window: bool) -> int:
    """Micro-batches per process in the partial window: ``ceil(K / 2)``; 0 when off or K = 1."""
    k = gradient_accumulation_steps
    return (k + 1) // 2 if partial_window and k > 1 else 0
