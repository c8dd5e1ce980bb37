"""What every bench run shares: the toolkit loop's call, resetting weights and optimizer, the comm hook, memory."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..core.loop import train_loop
from ..core.run_plan import run_plan_of


def run_toolkit(accelerator, model, optimizer, dataloader, K: int, steps: int, callbacks, loss_fn=None) -> list[float]:
    """The policy in force (the caller puts it in force through the run plan) at ``K``: :func:`accum_kit.train_loop`
    with ``loss_fn`` (None: its default, the fused loss; the DDP modes compared with raw DDP pass the logits',
    :mod:`accum_kit.bench.loss_axis`); returns the losses.

    K is set through the run plan (:meth:`accum_kit.core.run_plan.RunPlan.set_accumulation_steps`);
    ``train_loop`` restarts Accelerate's window counter itself, so every run's windows start at the
    dataloader's first batch.
    """
    run_plan_of(accelerator).set_accumulation_steps(K)
    profiler, *others = callbacks
    result = train_loop(accelerator, model, optimizer, dataloader, max_train_steps=steps, progress=False,
                        profiler=profiler, callbacks=others, loss_fn=loss_fn)
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


def device_ids(accelerator) -> list[int] | None:
    """``device_ids`` for a plain ``DistributedDataParallel`` on the accelerator's device (None on CPU)."""
    device = accelerator.device
    if device.type != "cuda":
        return None
    return [device.index if device.index is not None else accelerator.local_process_index]


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


def gathered_peaks(memory, device) -> tuple[float | None, float | None]:
    """``memory``'s (a :class:`accum_kit.bench.peak_memory.PeakMemory`) peak and rise since its reset, MB, the
    most over processes (a collective: every process calls it); None where the platform measures neither."""
    peak, increase = memory.peak()
    mem = torch.tensor([-1.0 if peak is None else peak, -1.0 if increase is None else increase],
                       dtype=torch.float64, device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    return None if peak is None else mem[0].item(), None if increase is None else mem[1].item()
