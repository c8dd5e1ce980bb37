"""The oracle: the gradient of one big batch on one process, in plain PyTorch.

On the main process, from the examples the processes actually ran (gathered
with ``gather_object``), a copy of the initial model in float64 runs *one*
forward and backward per window over all processes' examples padded together:
plain PyTorch, no DDP, no Accelerate. It yields the gradient of the summed
token loss ``sum_{r,i} S_{r,i}`` (``sum`` row) and of the token mean
``sum_{r,i} S_{r,i} / N`` with ``N`` the window's target tokens over all
processes (``tokens`` and ``mean-of-means`` rows). Being float64, its own
rounding is negligible next to the float32 tolerance.

DDP semantics: ``DistributedDataParallel`` averages gradients over processes
(the all-reduce sums and divides by the world size; PyTorch DDP notes,
https://pytorch.org/docs/stable/notes/ddp.html, and the
``torch.nn.parallel.DistributedDataParallel`` docs). So the ``sum`` row equals
the big-batch sum gradient x 1/W. ``torch.nn.DataParallel`` instead sums the
replicas' gradients of one loss, like the single-device big batch
(:func:`dataparallel_sum_gradient`); it is measured only where
``torch.cuda.device_count() >= 2`` (on fewer devices DataParallel runs the
module unchanged and would prove nothing).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX, pad_collate


def summed_token_loss(model, input_ids, attention_mask, labels):
    """Summed next-token cross-entropy (nats) and target-token count of one padded batch.

    Written independently of :func:`accum_kit.loss.causal_lm_loss` for the
    oracle: logits (batch, seq, vocab) at position t predict labels at t+1;
    labels -100 are ignored. Inputs are (batch, seq) int64 tensors.

    Returns:
        ``(summed loss, a 0-dim tensor in nats; N, target tokens as int)``.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1, :]
    target = labels[:, 1:]
    summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="sum")
    return summed, int((target != IGNORE_INDEX).sum())


def _grads(model) -> dict:
    """``{name: float64 CPU copy of .grad}`` (zeros where a parameter got no gradient)."""
    return {n: (p.grad.detach().to("cpu", torch.float64, copy=True) if p.grad is not None
                else torch.zeros(p.shape, dtype=torch.float64)) for n, p in model.named_parameters()}


def big_batch_gradient(model64, examples: list[dict], device) -> tuple[dict, int]:
    """Gradient of the summed token loss of ONE forward/backward over all ``examples``.

    Args:
        model64: a float64 copy of the initial model (eval mode), on ``device``.
        examples: every process's examples of one window.
        device: where the forward/backward runs.

    Returns:
        ``({name: float64 CPU gradient of sum_{r,i} S_{r,i}}, N)`` with ``N``
        the target tokens of the window; the token-mean gradient is that / N.
    """
    batch = {k: v.to(device) for k, v in pad_collate(examples).items()}
    model64.zero_grad(set_to_none=True)
    summed, n = summed_token_loss(model64, **batch)
    summed.backward()
    return _grads(model64), n


class _SummedLoss(torch.nn.Module):
    """Wraps a causal LM so that its forward returns the summed token loss, shape (1,), for DataParallel."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, labels):
        return summed_token_loss(self.inner, input_ids, attention_mask, labels)[0].reshape(1)


def dataparallel_sum_gradient(model, examples: list[dict], device_ids=None) -> dict:
    """Gradient of the summed loss under ``torch.nn.DataParallel`` over all ``examples`` at once.

    DataParallel scatters the batch over ``device_ids`` (default: all GPUs),
    each replica returns its summed loss, the vector is gathered on the first
    device and summed, and backward reduces the replicas' gradients into the
    original parameters by summation (``torch.nn.DataParallel`` docs). Returns
    float64 CPU gradients by name, shaped like the parameters. The model is
    deep-copied to float32, so the caller's is not modified. Without GPUs
    DataParallel calls the module directly.
    """
    inner = copy.deepcopy(model).float().eval()
    device = torch.device("cuda", (device_ids or [0])[0]) if torch.cuda.is_available() else torch.device("cpu")
    inner.to(device)
    dp = torch.nn.DataParallel(_SummedLoss(inner), device_ids=device_ids)
    batch = {k: v.to(device) for k, v in pad_collate(examples).items()}
    dp(**batch).sum().backward()
    return _grads(inner)
