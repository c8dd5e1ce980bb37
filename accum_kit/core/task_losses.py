"""Losses for models that are not causal LMs: classifiers and encoder-decoders (``loss_fn`` of
:func:`accum_kit.train_loop`).

Each returns the micro-batch's summed loss and its item count, as :mod:`accum_kit.core.loss`'s causal-LM loss
does, and has a ``count_items`` the DeepSpeed look-ahead reads before the forward.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from .loss import IGNORE_INDEX, _at_least_float32


def _labelled_items(batch) -> torch.Tensor:
    return (batch["labels"] != IGNORE_INDEX).sum()


def classification_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of one micro-batch of classified examples, and the number of labelled examples.

    The ``loss_fn`` of :func:`accum_kit.train_loop` for classifiers: the
    window's exact loss is then the mean over every labelled example of the
    window on all processes (items = examples).

    Args:
        model: returns logits of shape (batch, classes), or an object with
            ``.logits`` (transformers' sequence / image classification models).
        batch: ``labels`` of shape (batch,) (int64 class ids, -100 = not
            counted) and the model's inputs as the other keys, passed by name.

    Returns:
        ``(summed_loss, num_examples)``: a scalar in nats (float32, or float64
        for a float64 model) and an int64 scalar.
    """
    out = model(**{k: v for k, v in batch.items() if k != "labels"})
    logits = _at_least_float32(getattr(out, "logits", out))
    labels = batch["labels"]
    summed = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return summed, (labels != IGNORE_INDEX).sum()


def seq2seq_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token cross-entropy of an encoder-decoder model (labels NOT shifted), and its target tokens.

    transformers' encoder-decoder models (T5, BART, ...) build
    ``decoder_input_ids`` by shifting ``labels`` right inside ``forward``, so
    logit t already predicts label t: unlike :func:`causal_lm_loss` nothing
    is shifted here. Items are the labels that are not -100.

    Args:
        model: returns ``.logits`` of shape (batch, target length, vocab) when called with ``labels``.
        batch: ``input_ids``, ``attention_mask`` (batch, source length) and
            ``labels`` (batch, target length), -100 on padding.

    Returns:
        ``(summed_loss, num_tokens)``: a scalar in nats (float32, or float64
        for a float64 model) and an int64 scalar.
    """
    logits = _at_least_float32(model(**batch).logits)
    labels = batch["labels"]
    summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="sum")
    return summed, (labels != IGNORE_INDEX).sum()


# What each loss counts, readable before the forward (DeepSpeed counts a window ahead: accum_kit.engines.deepspeed).
classification_loss.count_items = _labelled_items
seq2seq_loss.count_items = _labelled_items
