"""Reading an accumulation window ahead: its batches first, then the batches one by one.

Two things need a whole window before its first backward: DeepSpeed's window normaliser (the window's
target tokens, :mod:`accum_kit.engines.lookahead`) and the router's load-balancing loss over the window
(the experts' token counts, :mod:`accum_kit.core.router_loss`). Both read it with :func:`read_ahead`.
"""

from __future__ import annotations

from ..compat import at_end_of_dataloader, set_end_of_dataloader


def read_ahead(accelerator, iterable, on_window):
    """Yield ``iterable``'s batches, calling ``on_window(batches)`` with each window's batches before its first.

    A window is ``accelerator.gradient_accumulation_steps`` batches, or fewer when the dataloader ends.
    Accelerate sets its end-of-dataloader flag when the last batch is fetched (it peeks one ahead); the flag
    is put back per batch as it is yielded, so that only the window's last batch closes the window.

    Args:
        accelerator: the run's Accelerator (K, the flag).
        iterable: the epoch's batches (a prepared dataloader, or what wraps it).
        on_window: ``on_window(list of batches) -> None``.
    """
    it = iter(iterable)
    while True:
        window, ends = [], []
        for batch in it:
            window.append(batch)
            ends.append(at_end_of_dataloader(accelerator))
            if len(window) == accelerator.gradient_accumulation_steps or ends[-1]:
                break
        if not window:
            return
        on_window(window)
        for batch, end in zip(window, ends):
            set_end_of_dataloader(accelerator, end)
            yield batch
