"""Evaluation loss over a validation dataloader, weighted by target tokens."""

from __future__ import annotations

import math

import torch

from ..compat import at_end_of_dataloader
from ..core.loss import LossFn, causal_lm_loss


@torch.no_grad()
def evaluate_loss(accelerator, model, eval_dataloader, loss_fn: LossFn | None = None,
                  ranks=None) -> tuple[float, float]:
    """Token-mean loss (nats) and perplexity of ``model`` on ``eval_dataloader``.

    Every process evaluates its shard; summed losses and target-token counts are
    all-reduced once, so the result is the token mean over the whole split
    (not a mean of per-batch means). On several processes Accelerate's
    ``even_batches`` repeats a few examples in the last batch to keep the
    processes in step; that batch is evaluated example by example and passed
    through ``accelerator.gather_for_metrics``, which drops the repeats, so
    every example of the split counts exactly once (as in transformers'
    run_clm_no_trainer.py).

    Args:
        accelerator: the Accelerator that prepared ``model`` and ``eval_dataloader``.
        loss_fn: ``(model, batch) -> (summed_loss, num_items)``; default causal LM.
        ranks: the :class:`accum_kit.core.token_ranks.TokenRanks` to sum over (None: the run's engine's, i.e. every
            process, or under tensor / context parallel the ranks holding different tokens, each batch cut
            for context parallel).

    Returns:
        ``(loss, perplexity)``; ``(nan, nan)`` when there is no target token.
    """
    loss_fn = loss_fn or causal_lm_loss
    if ranks is None:
        from ..engines import engine_of

        ranks = engine_of(accelerator).token_ranks(accelerator)
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    last = torch.zeros_like(totals)  # the last batch's (loss, tokens) over all processes, repeats dropped

    def row(summed, n):
        return torch.stack([summed.double(), torch.as_tensor(n, device=totals.device).double()])

    for batch in eval_dataloader:
        if accelerator.num_processes > 1 and at_end_of_dataloader(accelerator):
            size = len(next(iter(batch.values())))
            rows = torch.stack([row(*loss_fn(model, ranks.part({k: v[i : i + 1] for k, v in batch.items()})))
                                for i in range(size)])
            last += ranks.gather_rows(rows).sum(dim=0)
        else:
            totals += row(*loss_fn(model, ranks.part(batch)))
    totals = ranks.sum(totals) + last
    model.train(was_training)
    loss_sum, tokens = totals.tolist()
    if tokens == 0:
        return float("nan"), float("nan")
    loss = loss_sum / tokens
    return loss, math.exp(min(loss, 700.0))
