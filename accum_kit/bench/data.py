"""The bench's data: uniformly random token ids, every position a target, split as Accelerate splits it.

Timing does not depend on the token values, so synthetic rows keep the
sweep free of tokenisation and identical on every process.
"""

from __future__ import annotations


class TokenRows:
    """Map-style dataset over a (rows, block_size) tensor: ``{"input_ids": row, "labels": row}``."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        row = self.tokens[i]
        return {"input_ids": row, "labels": row}


def synthetic_tokens(n_rows: int, block_size: int, vocab_size: int, seed: int):
    """Uniformly random token ids, an (n_rows, block_size) int64 tensor, the same on every process."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n_rows, block_size), generator=g, dtype=torch.long)


def raw_batch_indices(n_batches: int, batch_size: int, rank: int, world: int) -> list[list[int]]:
    """The example indices of the micro-batches process ``rank`` gets: global batches rank, rank + W, ...

    The same split as Accelerate's prepared DataLoader (``BatchSamplerShard``
    with ``split_batches=False``), so the raw DDP loop sees the toolkit's data.
    """
    return [list(range(j * batch_size, (j + 1) * batch_size)) for j in range(rank, n_batches, world)]
