"""Sums over the processes that hold different tokens: every process, or a mesh's data-parallel x cp ranks.

Under plain data parallelism every process reads its own micro-batches, so a window's loss and token count
are summed over all of them. Under tensor parallel the tp ranks of a data-parallel rank read the *same*
micro-batches: summing over all processes would count each token tp times (the miscount of several public
trainers). Under context parallel every cp rank holds one slice of each sequence: the slices are different
tokens and are all summed. :class:`TokenRanks` is the one place the loop, the normaliser and the evaluation
ask for that sum; the engine builds it (:meth:`accum_kit.engines.base.Engine.token_ranks`).
"""

from __future__ import annotations

import torch


class TokenRanks:
    """The ranks holding different tokens, and how to sum or gather over them.

    Args:
        accelerator: the run's Accelerator.
        group: the ``torch.distributed`` process group of those ranks (this process's data-parallel x cp
            group: one per tp coordinate); None: every process (``accelerator.reduce``).
        size: the number of those ranks (None: ``accelerator.num_processes``).
        cp: context-parallel ranks inside ``group`` (innermost in its rank order), whose rows are slices of
            the same examples (1: none).
        split: ``split(batch) -> batch``, this rank's part of a micro-batch (context parallel), or None.
    """

    def __init__(self, accelerator, group=None, size: int | None = None, cp: int = 1, split=None):
        self.accelerator, self.group, self.cp, self.split = accelerator, group, cp, split
        self.size = size or accelerator.num_processes

    def part(self, batch):
        """This rank's part of ``batch`` (the whole batch unless context parallel splits it)."""
        return batch if self.split is None else self.split(batch)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (any shape, on any device) summed over the token ranks; the result is on the accelerator's device."""
        acc = self.accelerator
        t = t.to(acc.device)
        if self.group is None:
            return acc.reduce(t, reduction="sum")
        import torch.distributed as dist

        t = t.clone()
        dist.all_reduce(t, group=self.group)
        return t

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-example rows of the last evaluation batch, from every data-parallel rank, repeats dropped.

        Args:
            rows: shape (examples of this rank's batch, columns), float.

        Returns:
            Shape (examples, columns): rows summed over the cp slices of each example, concatenated in
            data-parallel rank order, cut to the dataset's remainder as ``accelerator.gather_for_metrics`` does.
        """
        acc = self.accelerator
        if self.group is None and self.cp == 1:
            return acc.gather_for_metrics(rows)
        import torch.distributed as dist

        parts = [torch.empty_like(rows) for _ in range(self.size)]
        dist.all_gather(parts, rows.contiguous(), group=self.group)
        stacked = torch.stack(parts).reshape(self.size // self.cp, self.cp, *rows.shape).sum(dim=1)
        out = stacked.reshape(-1, *rows.shape[1:])
        remainder = acc.gradient_state.remainder
        return out[:remainder] if acc.gradient_state.end_of_dataloader and remainder > 0 else out
