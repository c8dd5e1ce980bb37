"""accum-kit: fast and exact gradient accumulation on Hugging Face Accelerate.

Public entry points:

- :func:`build_accelerator` / :func:`check_process_count`: an Accelerator that
  cannot silently train each process alone on CPU-only machines.
- :func:`train_loop`: the accumulation loop (no_sync on non-boundary
  micro-batches, exact token-count normalisation); :class:`LoopCallback` for hooks.
- :class:`WindowNormalizer`, :func:`causal_lm_loss`: the normalisation on its own.
"""

from .callbacks import LoopCallback, LoopState
from .errors import AccumKitError, ProcessCountError, UsageError
from .launch import build_accelerator, check_process_count
from .loop import LoopResult, train_loop
from .planning import optimizer_steps_per_epoch
from .loss import WindowNormalizer, causal_lm_loss

__all__ = [
    "AccumKitError",
    "LoopCallback",
    "LoopResult",
    "LoopState",
    "ProcessCountError",
    "UsageError",
    "WindowNormalizer",
    "build_accelerator",
    "causal_lm_loss",
    "check_process_count",
    "optimizer_steps_per_epoch",
    "train_loop",
]

__version__ = "0.1.0"
