"""accum-kit: fast and exact gradient accumulation on Hugging Face Accelerate.

Public entry points:

- :func:`build_accelerator` / :func:`check_process_count`: an Accelerator that
  cannot silently train each process alone on CPU-only machines.
- :func:`train_loop`: the accumulation loop (no_sync on non-boundary
  micro-batches, exact token-count normalisation); :class:`LoopCallback` for hooks.
- :class:`WindowNormalizer`, :func:`causal_lm_loss`: the normalisation on its own;
  :func:`classification_loss`, :func:`seq2seq_loss`: ``loss_fn`` for classifiers and encoder-decoders.
- :func:`optimizer_steps_per_epoch`: the ``ceil(M / K)`` step count of an epoch.

The names are imported lazily, on first use (PEP 562 module ``__getattr__``,
https://peps.python.org/pep-0562/): ``import accum_kit`` alone loads neither
torch nor accelerate, so torch-free commands such as ``accum-kit plan`` start
quickly, while ``from accum_kit import train_loop`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: Public name -> the submodule that defines it.
_EXPORTS = {
    "AccumKitError": "errors",
    "LoopCallback": "callbacks",
    "LoopResult": "loop",
    "LoopState": "callbacks",
    "ProcessCountError": "errors",
    "UsageError": "errors",
    "WindowNormalizer": "loss",
    "build_accelerator": "launch",
    "causal_lm_loss": "loss",
    "classification_loss": "loss",
    "check_process_count": "launch",
    "optimizer_steps_per_epoch": "planning",
    "seq2seq_loss": "loss",
    "train_loop": "loop",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on demand
    from .callbacks import LoopCallback, LoopState
    from .errors import AccumKitError, ProcessCountError, UsageError
    from .launch import build_accelerator, check_process_count
    from .loop import LoopResult, train_loop
    from .loss import WindowNormalizer, causal_lm_loss, classification_loss, seq2seq_loss
    from .planning import optimizer_steps_per_epoch


def __getattr__(name: str):
    """Import a public name from its submodule on first access and cache it here.

    Raises:
        AttributeError: ``name`` is not public (this also lets ``from accum_kit
            import <submodule>`` fall back to importing the submodule).
    """
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
