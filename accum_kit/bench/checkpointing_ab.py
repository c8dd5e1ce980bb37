"""``accum-kit bench --gradient_checkpointing_ab``: every arm next to a twin with activation checkpointing.

The twin of an arm runs the same loop and policy on a second copy of the model, same initial weights and
data, whose transformer blocks are checkpointed (what ``--gradient_checkpointing`` does to every arm):

- DDP: ``sync_each_batch`` and ``no_sync`` share a second prepared model (``<mode>+gc``), ``raw_ddp`` a
  second plain-DDP copy; the twins join the arms, so the sweep rotates them with the others, block by block;
- FSDP2 / HSDP: a second model prepared with Accelerate's FSDP2 activation checkpointing on
  (``fsdp_plugin.activation_checkpointing``); each block of the sweep runs one window rotation per model,
  in adjacent runs, the model that goes first alternating from block to block; the twin's records are
  named ``<policy>+gc``.

The twin is prepared through the run plan as ``--gradient_checkpointing`` would prepare it
(:func:`checkpointed_prepare`), then the plan is put back. Each record of an A/B run also counts the
forwards of the blocks' attention modules (:class:`BlockForwards`): once per block and micro-batch
without checkpointing, twice with it (the recompute). The report (ratio with / without and its 95 %
interval, peak memory of each) is :mod:`.report_checkpointing`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

import torch

from ..core.run_plan import run_plan_of
from .peak_memory import PeakMemory
from .report_checkpointing import GC_SUFFIX, twin_name

__all__ = ["GC_SUFFIX", "BlockForwards", "TrimmedPeakMemory", "checkpointed_prepare", "release_freed_memory",
           "twin_name"]


@contextlib.contextmanager
def checkpointed_prepare(accelerator):
    """Inside: ``accelerator.prepare`` checkpoints each model's transformer blocks, as under
    ``--gradient_checkpointing`` (the engine's own way, :meth:`accum_kit.engines.base.Engine.resolve_activation_checkpointing`
    and ``apply_activation_checkpointing``: FSDP2 turns its plugin's ``activation_checkpointing`` on). On exit the
    run plan's ``gradient_checkpointing`` and kwargs, and the plugin's switch if the engine has one, are put back.

    Raises:
        UsageError (``--gradient_checkpointing``): at the ``prepare`` inside, a model without transformer blocks.
    """
    plan = run_plan_of(accelerator)
    engine = plan.engine
    saved = plan.gradient_checkpointing, plan.gradient_checkpointing_kwargs
    plugin = getattr(engine, "plugin", None)
    plugin_saved = getattr(plugin, "activation_checkpointing", None)
    plan.gradient_checkpointing, plan.gradient_checkpointing_kwargs = engine.resolve_activation_checkpointing(True, None)
    try:
        yield
    finally:
        plan.gradient_checkpointing, plan.gradient_checkpointing_kwargs = saved
        if plugin_saved is not None:
            plugin.activation_checkpointing = plugin_saved


class BlockForwards:
    """Counts the forwards of a model's attention modules (the outermost modules whose class name ends in
    ``Attention``, one per transformer block) while :attr:`count` grows; :meth:`take` returns and zeroes it.

    Under checkpointing the recompute in backward calls each block again, so a micro-batch counts
    2 x blocks instead of blocks.
    """

    def __init__(self, model: torch.nn.Module):
        self.count = 0
        self.blocks = 0
        self.handles = []
        inside = set()
        for name, module in model.named_modules():
            if type(module).__name__.endswith("Attention") and not any(name.startswith(p + ".") for p in inside):
                inside.add(name)
                self.blocks += 1
                self.handles.append(module.register_forward_hook(self._hook))

    def _hook(self, module, args, output):
        self.count += 1

    def take(self) -> int:
        n, self.count = self.count, 0
        return n

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


_LIBC = None


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim(0)``; nothing elsewhere), so that a run's
    resident-set peak starts from the memory in use rather than from what the previous arm's activations left
    resident: without it a checkpointed run after one without would show the other's peak."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        _LIBC = ctypes.CDLL(name) if name else False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)


class TrimmedPeakMemory(PeakMemory):
    """:class:`accum_kit.bench.peak_memory.PeakMemory` whose :meth:`reset` first gives freed heap memory back
    (:func:`release_freed_memory`): the peaks of an A/B run, where a run with checkpointing follows one without."""

    def reset(self) -> None:
        if not self.cuda:
            release_freed_memory()
        super().reset()
