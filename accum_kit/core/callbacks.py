"""Loop callbacks: the seven hooks of :func:`accum_kit.train_loop` and the state they see.

Subclass :class:`LoopCallback` and override the hooks you need; a plain object
works too if it defines at least one hook. Misspelled hook names fail loudly
when the loop starts instead of being skipped: any public attribute whose name
starts with ``on_`` (or nearly matches a hook) but is not one of :data:`HOOKS`
raises ``TypeError``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from .window_figures import WindowFigures, nan_figures

#: The hooks, in the order one optimizer step calls them.
HOOKS = (
    "on_train_begin",  # once, after model.train()
    "on_micro_batch_begin",  # before the forward of every micro-batch
    "on_forward_end",  # after the forward (loss computed)
    "on_backward_end",  # after accelerator.backward
    "on_step_begin",  # boundary micro-batch only, before the window rescale and clipping
    "on_step_end",  # after optimizer.step, scheduler.step and zero_grad
    "on_train_end",  # once, after the last step
)


@dataclass
class LoopState:
    """What callbacks see. Counters are per process; ``step`` counts optimizer steps done."""

    epoch: int = 0
    step: int = 0
    micro_step: int = 0  # micro-batches done on this process
    boundary: bool = False  # this micro-batch ends a window (optimizer step follows)
    sync: bool = False  # DDP all-reduces gradients in this micro-batch's backward
    forced_sync: bool = False  # it does so only to prime a static-graph DDP model (the profiler and memory skip it)
    figures: WindowFigures = field(default_factory=nan_figures)  # the last finished window's loss and tokens
    grad_norm: object = None  # global gradient norm before clipping (a tensor: read it when shown), when the loop clips
    accumulation_steps: int = 0  # K of the last finished window (an accumulation schedule may change it)
    effective_batch_size: int | None = None  # examples per full window of that K over all processes (B x K x P)

    # The window's figures stay on the device until read (accum_kit.core.window_figures): reading ``loss`` or
    # ``window_tokens`` is one host read (both, and every earlier unread window, in one copy), so read them
    # when they are shown (a logging step), not on every step.
    @property
    def loss(self) -> float:
        """Loss of the last finished window, nats (NaN before the first); reading it reads the device."""
        return self.figures.loss

    @loss.setter
    def loss(self, value: float) -> None:
        self.figures = WindowFigures.of(value, self.figures.tokens)

    @property
    def window_tokens(self) -> int:
        """Target tokens of the last finished window, all processes; reading it reads the device."""
        return self.figures.tokens

    @window_tokens.setter
    def window_tokens(self, value: int) -> None:
        self.figures = WindowFigures.of(self.figures.loss, value)


class LoopCallback:
    """Base class of loop callbacks: every hook takes a :class:`LoopState` and does nothing here.

    ``on_step_begin`` runs on the boundary micro-batch before the window
    rescale, so gradients then still hold sum / (K x world_size).
    """

    def on_train_begin(self, state: LoopState) -> None: ...
    def on_micro_batch_begin(self, state: LoopState) -> None: ...
    def on_forward_end(self, state: LoopState) -> None: ...
    def on_backward_end(self, state: LoopState) -> None: ...
    def on_step_begin(self, state: LoopState) -> None: ...
    def on_step_end(self, state: LoopState) -> None: ...
    def on_train_end(self, state: LoopState) -> None: ...


def _suspicious(name: str) -> bool:
    if name.startswith("_") or name in HOOKS:
        return False
    return name.startswith("on_") or bool(difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.8))


def check_callback(callback) -> None:
    """Raise ``TypeError`` for an object that defines no hook or has a name that looks like a misspelled one."""
    names = [n for n in dir(callback) if callable(getattr(callback, n, None))]
    bad = [n for n in names if _suspicious(n)]
    if bad:
        hints = "; ".join(
            f"{n!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(n, HOOKS, n=1, cutoff=0.6)) else "")
            for n in bad)
        raise TypeError(f"{type(callback).__name__} defines {hints}, which is not a loop hook; the hooks are {list(HOOKS)}")
    if not any(n in HOOKS for n in names):
        raise TypeError(f"{type(callback).__name__} defines none of the loop hooks {list(HOOKS)}: "
                        "subclass accum_kit.LoopCallback and override the ones you need")


class CallbackList:
    """Calls one hook on every callback that implements it, in the order given.

    Args:
        callbacks: :class:`LoopCallback` instances or objects with hook methods;
            None entries are ignored.

    Raises:
        TypeError: see :func:`check_callback`.
    """

    def __init__(self, callbacks):
        self.callbacks = [c for c in callbacks if c is not None]
        for c in self.callbacks:
            check_callback(c)
        # Bound methods per hook, leaving out LoopCallback's no-op defaults.
        self._hooks = {
            name: [getattr(c, name) for c in self.callbacks
                   if hasattr(c, name) and getattr(type(c), name, None) is not getattr(LoopCallback, name)]
            for name in HOOKS
        }

    def __call__(self, name: str, state: LoopState) -> None:
        for fn in self._hooks[name]:
            fn(state)
