"""What ``verify`` runs: the examples, how they are batched, the loss, and the loss of the big-batch oracle.

Two kinds of workload, both a list of examples that every process holds in
the same order:

- :func:`token_workload`: verify's own random token sequences
  (:mod:`accum_kit.verify.data`) for a causal LM. The rows train with
  ``loss_fn`` (default :func:`accum_kit.causal_lm_loss`); the oracle uses
  :func:`accum_kit.verify.oracle.summed_token_loss`, written separately
  (or the given ``loss_fn``, when one is given).
- :func:`user_workload`: the user's own dataset, ``collate_fn`` and
  ``loss_fn(model, batch) -> (summed_loss, num_items)``: classification
  (summed cross-entropy, items = examples), seq2seq (labels not shifted),
  anything whose loss is a sum over items. The oracle applies the same
  ``loss_fn`` to one batch of all processes' examples collated together: what
  verify checks is the accumulation (micro-batches, processes, the window
  normalisation, no_sync), not the loss itself.

Which examples each window ran is recorded by index (:class:`IndexRecorder`):
the DataLoader yields ``{"index": int64 (batch,), "batch": collate_fn(examples)}``
and the recorder hands ``batch`` to the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.data import DataLoader, default_collate

from ..core.callbacks import LoopCallback, LoopState
from ..errors import UsageError
from ..core.loss import LossFn, causal_lm_loss
from .data import MIN_LENGTH, make_examples, pad_collate
from .oracle import token_batch_loss


@dataclass
class Workload:
    """The examples verify runs and how.

    Attributes:
        examples: every example, the same list on every process; an example's
            index is its position.
        collate_fn: list of examples -> batch (what ``loss_fn`` takes).
        loss_fn: ``(model, batch) -> (summed loss, items)``: what the rows train with.
        oracle_loss: the same contract, used by the oracle on one big batch.
        items: what ``num_items`` counts, for the report ("target tokens", "items").
        description: one line for the report.
        token_data: verify's own token sequences (the report lists their ids;
            the Trainer row can run on them).
    """

    examples: list
    collate_fn: Callable
    loss_fn: LossFn
    oracle_loss: LossFn
    items: str
    description: str
    token_data: bool

    def loader(self, batch_size: int) -> DataLoader:
        """In-order DataLoader of ``batch_size`` examples yielding ``{"index": (batch,) int64, "batch": ...}``."""

        def collate(indices):
            return {"index": torch.tensor(indices, dtype=torch.long),
                    "batch": self.collate_fn([self.examples[i] for i in indices])}

        return DataLoader(range(len(self.examples)), batch_size=batch_size, shuffle=False, collate_fn=collate)

    def window(self, indices) -> list:
        """The examples at ``indices``, in that order."""
        return [self.examples[i] for i in indices]


def token_workload(n: int, seed: int, vocab_size: int, max_length: int, loss_fn: LossFn | None = None) -> Workload:
    """``n`` random token sequences of 2..``max_length`` tokens (ids < ``vocab_size``), right-padded per micro-batch."""
    return Workload(
        examples=make_examples(n, seed, vocab_size, max_length), collate_fn=pad_collate,
        loss_fn=loss_fn or causal_lm_loss,
        oracle_loss=token_batch_loss if loss_fn is None else loss_fn,
        items="target tokens",
        description=(f"{n} random token sequences of {MIN_LENGTH}-{max_length} tokens, right-padded per "
                     "micro-batch, labels -100 on padding"
                     + ("" if loss_fn is None else f", loss {_name(loss_fn)}")),
        token_data=True)


def _name(obj) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def user_workload(dataset, n: int, collate_fn: Callable | None, loss_fn: LossFn) -> Workload:
    """The first ``n`` examples of ``dataset`` (anything with ``len`` and ``[i]``), batched by ``collate_fn``.

    Args:
        dataset: a map-style dataset (list, ``torch.utils.data.Dataset``, a
            ``datasets.Dataset``); examples are read once, here.
        n: examples needed: (K + r) micro-batches x B examples x W processes.
        collate_fn: list of examples -> batch; None: ``torch.utils.data.default_collate``.
        loss_fn: ``(model, batch) -> (summed_loss, num_items)``.

    Raises:
        UsageError: ``dataset`` has no length or fewer than ``n`` examples, or ``loss_fn`` is not callable.
    """
    if not callable(loss_fn):
        raise UsageError("loss_fn", f"{loss_fn!r} is not callable", "pass a function (model, batch) -> "
                         "(summed_loss, num_items), e.g. accum_kit.classification_loss")
    try:
        size = len(dataset)
    except TypeError:
        raise UsageError("dataset", f"{type(dataset).__name__} has no len()", "pass a map-style dataset "
                         "(a list, torch Dataset or datasets.Dataset), not an iterable one") from None
    if size < n:
        raise UsageError("dataset", f"has {size} examples; verify needs {n} (K + r micro-batches x "
                         "per_device_train_batch_size x processes)",
                         "pass more examples, a smaller per_device_train_batch_size, or partial_window=False")
    collate_fn = collate_fn or default_collate
    return Workload(
        examples=[dataset[i] for i in range(n)], collate_fn=collate_fn, loss_fn=loss_fn, oracle_loss=loss_fn,
        items="items",
        description=(f"the first {n} examples of the given {type(dataset).__name__}, collated by "
                     f"{_name(collate_fn)}, loss {_name(loss_fn)} (items = its num_items)"),
        token_data=False)


class IndexRecorder(LoopCallback):
    """Loss function and callback of :func:`accum_kit.train_loop`: which examples each window ran here.

    Pass the same instance as ``loss_fn`` and in ``callbacks``. ``windows[w]``
    lists the indices this process ran in window ``w`` (0-based), in order.

    Args:
        loss_fn: the loss applied to each micro-batch's ``batch`` part.
    """

    def __init__(self, loss_fn: LossFn):
        self.loss_fn = loss_fn
        self.window = 0
        self.windows: list[list[int]] = []

    def on_micro_batch_begin(self, state: LoopState) -> None:  # called before loss_fn
        self.window = state.step

    @property
    def count_items(self):
        """The wrapped loss function's item counter on a batch's ``batch`` part (DeepSpeed counts each window
        ahead, :class:`accum_kit.engines.lookahead.LookaheadNormalizer`); None when the loss function has none."""
        counter = getattr(self.loss_fn, "count_items", None)
        return None if counter is None else (lambda batch: counter(batch["batch"]))

    def __call__(self, model, batch):
        """Record ``batch["index"]`` under the current window; return ``loss_fn(model, batch["batch"])``."""
        while len(self.windows) <= self.window:
            self.windows.append([])
        self.windows[self.window] += batch["index"].tolist()
        return self.loss_fn(model, batch["batch"])
