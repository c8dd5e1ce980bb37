"""The window normalisation under DeepSpeed: count the window's items first, scale each micro-batch's loss.

DeepSpeed's engine divides each loss by its own K, averages the gradients
over the processes and owns them (under ZeRO-2/3 in its own partitions), so
the loop's "rescale the gradients after the window" has nothing to act on.
:class:`LookaheadNormalizer` takes the window's target-token count N first
(the transformers Trainer's way, ``num_items_in_batch``) and back-propagates
``S x K x W / N`` per micro-batch: the engine's ``1/K`` and ``1/W`` cancel.
"""

from __future__ import annotations

import torch

from ..core.loss import WindowNormalizer
from ..core.window_figures import WindowFigures
from ..core.read_ahead import read_ahead
from ..errors import UsageError

def count_items(loss_fn, batch) -> torch.Tensor:
    """The items (target tokens) ``loss_fn`` will count in ``batch``, before running the model.

    Uses ``loss_fn.count_items(batch)``; :func:`accum_kit.core.loss.causal_lm_loss`,
    ``classification_loss`` and ``seq2seq_loss`` have one.

    Raises:
        UsageError (``loss_fn``): the function has no ``count_items``.
    """
    counter = getattr(loss_fn, "count_items", None)
    if counter is None:
        raise UsageError("loss_fn", "under DeepSpeed the window's items are counted before its forward passes, "
                         f"and {getattr(loss_fn, '__name__', loss_fn)!r} has no count_items", "give the function "
                         "a count_items(batch) -> int attribute (see accum_kit.core.loss.causal_lm_loss), or use "
                         "--loss_normalization mean")
    return torch.as_tensor(counter(batch))


class LookaheadNormalizer(WindowNormalizer):
    """``tokens`` normalisation under DeepSpeed: count the window first, scale each micro-batch's loss.

    Use as :class:`accum_kit.core.loss.WindowNormalizer`, and iterate the epoch's
    batches through :meth:`batches` (the loop does). Each micro-batch's loss is
    ``S x K x W / N``, with K the engine's ``gradient_accumulation_steps``, W
    the processes and N the window's target tokens over all processes; the
    engine divides by K and averages over W, so the update is ``sum S / N``.
    :meth:`finish` leaves the gradients alone, and checks that the tokens the
    loss function counted equal the look-ahead count.

    Raises:
        RuntimeError (in :meth:`finish`): the look-ahead count and the loss
            function's count differ (``count_items`` disagrees with the loss).
    """

    def __init__(self, accelerator, loss_fn):
        super().__init__(accelerator, "tokens")
        self.loss_fn = loss_fn
        self.window_items: float | None = None  # N of the window being run, summed over processes

    def batches(self, iterable, loss_fn=None):
        """Yield ``iterable``'s batches, reading each window ahead to count its items (one all-reduce per window).

        A window is K batches or fewer when the dataloader ends (Accelerate's
        end-of-dataloader flag, set when the last batch is fetched, is put back
        per batch so that only the window's last batch closes it).
        """
        acc, loss_fn = self.accelerator, loss_fn or self.loss_fn

        def count(window):
            local = sum(count_items(loss_fn, b).double() for b in window).reshape(1).to(acc.device)
            self.window_items = float(acc.reduce(local, reduction="sum"))

        return read_ahead(acc, iterable, count)

    def backward_loss(self, summed_loss: torch.Tensor, num_items) -> torch.Tensor:
        """``summed_loss x K x W / N`` for ``accelerator.backward`` (see the class docstring)."""
        if self.window_items is None:
            raise RuntimeError("LookaheadNormalizer.backward_loss before its window was counted: iterate the "
                               "batches through LookaheadNormalizer.batches")
        n = torch.as_tensor(num_items, device=summed_loss.device)
        acc = self.accelerator
        scale = acc.gradient_accumulation_steps * acc.num_processes / max(self.window_items, 1.0)
        step = torch.stack([summed_loss.detach().double(), n.double(), torch.ones_like(n, dtype=torch.float64)])
        self._stats = step if self._stats is None else self._stats + step
        return summed_loss * scale

    @torch.no_grad()
    def finish(self, model: torch.nn.Module) -> WindowFigures:
        """Close the window (the engine has stepped already): return its loss and tokens, read on the host here
        (one read per window, to check them against the look-ahead count)."""
        acc = self.accelerator
        stats = self._stats if self._stats is not None else torch.zeros(3, dtype=torch.float64, device=acc.device)
        loss_sum, tokens, _ = acc.reduce(stats.to(acc.device), reduction="sum").cpu().tolist()
        if tokens != self.window_items:
            raise RuntimeError(f"the window's items counted ahead ({self.window_items:g}) differ from those the "
                               f"loss function returned ({tokens:g}): its count_items must count what it averages")
        self._reset()
        return WindowFigures.of(loss_sum / max(tokens, 1.0), int(tokens))
