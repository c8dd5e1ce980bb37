"""The bench's data: uniformly random token ids, every position a target, split as Accelerate splits it.

Timing does not depend on the token values, so synthetic rows keep the
sweep free of tokenisation and identical on every process.
"""

from __future__ import annotations


class TokenRows:
    """Map-style dataset over a (rows, block_size) tensor: ``{"input_ids": row, "labels": labels row}``.

    ``labels`` (same shape; -100 = no target) defaults to the tokens themselves (every position a target).
    """

    def __init__(self, tokens, labels=None):
        self.tokens = tokens
        self.labels = tokens if labels is None else labels

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.labels[i]}


def synthetic_tokens(n_rows: int, block_size: int, vocab_size: int, seed: int):
    """Uniformly random token ids, an (n_rows, block_size) int64 tensor, the same on every process."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n_rows, block_size), generator=g, dtype=torch.long)


def variable_target_labels(tokens, seed: int):
    """Labels with a random number of targets per row: row i keeps its first L_i labels, L_i uniform in 2..block.

    The rest are -100 (as right padding would be), so after the shift row i
    has L_i - 1 >= 1 targets. Inputs and shapes are unchanged, so the
    compute per micro-batch is the same as with every position a target.
    Returns an int64 tensor shaped like ``tokens``.
    """
    import torch

    rows, block = tokens.shape
    g = torch.Generator().manual_seed(seed)
    keep = torch.randint(2, block + 1, (rows, 1), generator=g)
    return tokens.masked_fill(torch.arange(block).unsqueeze(0) >= keep, -100)


def synthetic_rows(cfg, n_rows: int):
    """``(tokens, labels)``: ``n_rows`` rows of ``cfg.block_size`` synthetic token ids (seed ``cfg.seed + 1``) and
    their labels (the tokens themselves, or with ``cfg.variable_targets`` a random number of targets per row,
    seed ``cfg.seed + 2``); ``cfg``: a ``BenchConfig``. Every part of the sweep takes its data from here."""
    tokens = synthetic_tokens(n_rows, cfg.block_size, cfg.vocab_size, cfg.seed + 1)
    return tokens, variable_target_labels(tokens, cfg.seed + 2) if cfg.variable_targets else tokens


def data_description(cfg) -> str:
    """One line for bench.json's ``data``: what the synthetic rows hold under ``cfg`` (a ``BenchConfig``)."""
    targets = ("a random number of targets per row (--variable_targets), seed --seed + 2" if cfg.variable_targets
               else "every position a target")
    return f"synthetic: uniformly random token ids (seed --seed + 1), {targets}"


def raw_batch_indices(n_batches: int, batch_size: int, rank: int, world: int) -> list[list[int]]:
    """The example indices of the micro-batches process ``rank`` gets: global batches rank, rank + W, ...

    The same split as Accelerate's prepared DataLoader (``BatchSamplerShard``
    with ``split_batches=False``), so the raw DDP loop sees the toolkit's data.
    """
    return [list(range(j * batch_size, (j + 1) * batch_size)) for j in range(rank, n_batches, world)]
