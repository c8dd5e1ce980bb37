"""What every bench run shares: the toolkit loop's call, resetting weights and optimizer, the comm hook."""

from __future__ import annotations

import os

import torch

from ..core.loop import train_loop


def run_toolkit(accelerator, model, optimizer, dataloader, K: int, steps: int, callbacks) -> list[float]:
    """``sync_each_batch`` or ``no_sync`` (the caller sets the flag): :func:`accum_kit.train_loop`; returns the losses.

    ``train_loop`` restarts Accelerate's window counter itself, so every run's
    windows start at the dataloader's first batch.
    """
    accelerator.gradient_accumulation_steps = K
    profiler, *others = callbacks
    result = train_loop(accelerator, model, optimizer, dataloader, max_train_steps=steps, progress=False,
                        profiler=profiler, callbacks=others)
    return result.train_loss


def reset_weights(model, initial: list) -> None:
    """Weights back to ``initial`` (tensors in ``model.parameters()`` order), no gradients."""
    with torch.no_grad():
        for p, p0 in zip(model.parameters(), initial):
            p.copy_(p0)
            p.grad = None


def reset_training_state(model, initial: list, optimizer) -> None:
    """Weights back to ``initial``, AdamW moments and step counts to zero, no gradients."""
    reset_weights(model, initial)
    with torch.no_grad():
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps it
        for st in inner.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.zero_()
    optimizer.zero_grad(set_to_none=True)


def comm_hook(name: str):
    """The DDP comm hook for ``--comm_hook`` (None: DDP's default all-reduce)."""
    if name == "none":
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[name]


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none): recorded with every run."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
