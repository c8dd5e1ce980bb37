"""The oracle: the gradient of one big batch on one process, in plain PyTorch.

On the main process, from the examples the processes actually ran (gathered
with ``gather_object``), a copy of the initial model in float64 runs *one*
forward and backward per window over all processes' examples batched together
(padded together for token data, by the user's ``collate_fn`` otherwise):
plain PyTorch, no DDP, no Accelerate. It yields the gradient of the summed
loss ``sum_{r,i} S_{r,i}`` (``sum`` row) and of the item mean
``sum_{r,i} S_{r,i} / N`` with ``N`` the window's items (target tokens) over
all processes (``tokens`` and ``mean-of-means`` rows). Being float64, its own
rounding is negligible next to the float32 tolerance. On verify's own token
data the loss is :func:`summed_token_loss`, written independently of the
loop's :func:`accum_kit.causal_lm_loss`; on a user's workload it is the
user's ``loss_fn`` (see :mod:`accum_kit.verify.workload`).

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
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX, pad_collate


def summed_token_loss(model, input_ids, attention_mask, labels):
    """Summed next-token cross-entropy (nats) and target-token count of one padded batch.

    Written independently of :func:`accum_kit.core.loss.causal_lm_loss` for the
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


def to_oracle(batch, device, dtype=torch.float64):
    """``batch`` (tensors in nested dicts / lists / tuples) on ``device``, floating tensors cast to ``dtype``.

    The oracle's model is float64, so float inputs (images, features) must be too;
    integer tensors (token ids, labels, masks) keep their dtype.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, dtype) if batch.is_floating_point() else batch.to(device)
    if isinstance(batch, Mapping):  # a plain dict also for BatchEncoding-like mappings: loss_fn indexes by key
        return {k: to_oracle(v, device, dtype) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_oracle(v, device, dtype) for v in batch)
    return batch


def token_batch_loss(model, batch: Mapping) -> tuple:
    """:func:`summed_token_loss` of a padded batch dict (``input_ids``, ``attention_mask``, ``labels``)."""
    return summed_token_loss(model, batch["input_ids"], batch["attention_mask"], batch["labels"])


def big_batch_gradient(model64, examples: list, device, collate_fn=pad_collate, loss_fn=None) -> tuple[dict, int]:
    """Gradient of the summed loss of ONE forward/backward over all ``examples``.

    Args:
        model64: a float64 copy of the initial model (eval mode), on ``device``.
        examples: every process's examples of one window.
        device: where the forward/backward runs.
        collate_fn: list of examples -> one batch (default: verify's token padding).
        loss_fn: ``(model, batch) -> (summed loss, items)``; default
            :func:`summed_token_loss` on the padded token batch.

    Returns:
        ``({name: float64 CPU gradient of the summed loss}, N)`` with ``N``
        the items (target tokens) of the window; the mean gradient is that / N.
    """
    batch = to_oracle(collate_fn(examples), device)
    model64.zero_grad(set_to_none=True)
    summed, n = (loss_fn or token_batch_loss)(model64, batch)
    summed.backward()
    return _grads(model64), int(n)


class _SummedLoss(torch.nn.Module):
    """Wraps a model so that its forward returns ``loss_fn``'s summed loss, shape (1,), for DataParallel."""

    def __init__(self, inner, loss_fn):
        super().__init__()
        self.inner, self.loss_fn = inner, loss_fn

    def forward(self, batch):
        return self.loss_fn(self.inner, batch)[0].reshape(1)


def dataparallel_sum_gradient(model, examples: list, device_ids=None, collate_fn=pad_collate, loss_fn=None) -> dict:
    """Gradient of the summed loss under ``torch.nn.DataParallel`` over all ``examples`` at once.

    DataParallel scatters the batch over ``device_ids`` (default: all GPUs),
    each replica returns its summed loss, the vector is gathered on the first
    device and summed, and backward reduces the replicas' gradients into the
    original parameters by summation (``torch.nn.DataParallel`` docs). Returns
    float64 CPU gradients by name, shaped like the parameters. The model is
    deep-copied to float32, so the caller's is not modified. Without GPUs
    DataParallel calls the module directly. ``collate_fn`` and ``loss_fn`` as
    in :func:`big_batch_gradient`.
    """
    inner = copy.deepcopy(model).float().eval()
    device = torch.device("cuda", (device_ids or [0])[0]) if torch.cuda.is_available() else torch.device("cpu")
    inner.to(device)
    dp = torch.nn.DataParallel(_SummedLoss(inner, loss_fn or token_batch_loss), device_ids=device_ids)
    dp(to_oracle(collate_fn(examples), device, torch.float32)).sum().backward()
    return _grads(inner)
