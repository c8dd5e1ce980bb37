"""Evaluation loss over a validation dataloader, weighted by target tokens."""

from __future__ import annotations

import math

import torch

from .loss import LossFn, causal_lm_loss


@torch.no_grad()
def evaluate_loss(accelerator, model, eval_dataloader, loss_fn: LossFn | None = None) -> tuple[float, float]:
    """Token-mean loss (nats) and perplexity of ``model`` on ``eval_dataloader``.

    Every process evaluates its shard; summed losses and target-token counts are
    all-reduced once, so the result is the token mean over the whole split
    (not a mean of per-batch means). Accelerate's ``even_batches`` may repeat
    a few examples on the last batch to keep processes in step.

    Args:
        accelerator: the Accelerator that prepared ``model`` and ``eval_dataloader``.
        loss_fn: ``(model, batch) -> (summed_loss, num_items)``; default causal LM.

    Returns:
        ``(loss, perplexity)``; ``(nan, nan)`` when there is no target token.
    """
    loss_fn = loss_fn or causal_lm_loss
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for batch in eval_dataloader:
        summed, n = loss_fn(model, batch)
        totals += torch.stack([summed.double(), torch.as_tensor(n, device=totals.device).double()])
    totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    loss_sum, tokens = totals.tolist()
    if tokens == 0:
        return float("nan"), float("nan")
    loss = loss_sum / tokens
    return loss, math.exp(min(loss, 700.0))
