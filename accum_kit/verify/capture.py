"""Capturing what the optimizer sees, and which examples each window ran.

The optimizer passed through ``accelerator.prepare`` is :class:`GradientCapture`,
a ``torch.optim.Optimizer`` whose ``step()`` copies the gradients instead of
updating the parameters. It therefore sees exactly what a real optimizer would
see at ``optimizer.step()``: after the boundary all-reduce and after
train_loop's window rescale (``WindowNormalizer.finish``), before
``zero_grad``. The parameters never change, so every window of every row is
evaluated at the initial parameters. Dropout is switched off
(:class:`EvalMode`, ``model.eval()`` at ``on_train_begin``) so the comparison
is deterministic; gradients are computed as usual.
"""

from __future__ import annotations

import math

import torch

from ..core.callbacks import LoopCallback, LoopState
from ..core.loss import causal_lm_loss


class GradientCapture(torch.optim.Optimizer):
    """A torch optimizer whose ``step()`` records the gradients and leaves the parameters alone.

    Pass it through ``accelerator.prepare`` like any optimizer: it then sees
    exactly what a real optimizer sees at ``optimizer.step()`` (after the
    boundary all-reduce, train_loop's window rescale and clipping; before
    ``zero_grad``). ``captured`` gets one entry per optimizer step: on the
    keeping process a dict ``{parameter name: float32 CPU copy of .grad}``
    (same shape as the parameter; a None grad becomes zeros; sharded gradients,
    FSDP2's ``DTensor`` shards, are gathered first with
    :func:`accum_kit.compat.full_tensor`, so ``step`` is collective there), elsewhere None;
    ``norms`` gets the L2 norm of the whole gradient on every process (for the
    cross-rank check). When ``prepare`` returns an engine object
    (:meth:`accum_kit.engines.base.Engine.prepared_engine`: DeepSpeed ZeRO's) call
    :meth:`attach_engine` with it: the engine's optimizer hands ``step`` flat
    partitions, from which the whole gradient is rebuilt (collective).

    Args:
        named_parameters: ``model.named_parameters()`` of the model to watch.
        keep: keep full gradient copies (the main process) or only norms.
    """

    def __init__(self, named_parameters, keep: bool = True):
        named = list(named_parameters)
        self.names = [n for n, _ in named]
        # an "lr" entry lets a learning-rate scheduler wrap it (transformers' Trainer builds one); never used
        super().__init__([p for _, p in named], defaults={"lr": 0.0})
        self.keep = keep
        self.captured: list = []
        self.norms: list[float] = []
        self._name_of = {id(p): n for n, p in named}
        self._zero: dict = {}  # under DeepSpeed ZeRO: the flat partitions its inner steps get (attach_engine)
        self._pending: dict = {}  # ZeRO: this step's gradients by name, group by group

    def attach_engine(self, engine) -> None:
        """Under DeepSpeed ZeRO, after ``prepare``: learn which flat partitions the engine's steps will hand over.

        The ZeRO optimizer calls this optimizer's ``step`` once per parameter
        group with its flat float32 partition instead of the parameters
        (:func:`accum_kit.compat.zero_flat_partitions`); ``step`` then rebuilds
        each parameter's whole averaged gradient from every process's partition
        (collective) and records the optimizer step once every parameter is seen.
        """
        from ..compat import zero_flat_partitions

        self._zero, self._pending = zero_flat_partitions(engine), {}

    def take(self) -> tuple[list, list]:
        """Return ``(captured, norms)`` since the last call and forget them."""
        out = (self.captured, self.norms)
        self.captured, self.norms = [], []
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """Record the current gradients (see the class docstring); the parameters are not changed."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self._zero:
            return self._zero_step()
        from ..compat import full_tensor

        sq, grads = 0.0, {}
        for name, p in zip(self.names, self.param_groups[0]["params"]):
            g = p.grad.detach() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
            g = full_tensor(g).float()  # a sharded gradient gathered whole (collective, every process)
            sq += float(g.double().pow(2).sum())
            if self.keep:
                grads[name] = g.to("cpu", copy=True)
        self.captured.append(grads if self.keep else None)
        self.norms.append(math.sqrt(sq))
        return None

    def _zero_step(self) -> None:
        """One group of a ZeRO step: its parameters' whole gradients; the last group closes the record."""
        from ..compat import zero_full_gradients

        for group in self.param_groups:
            for flat in group["params"]:
                if flat.grad is None:
                    continue
                layout, params, zero_optimizer = self._zero[id(flat)]
                for p, g in zero_full_gradients(flat, layout, params, zero_optimizer):
                    self._pending[self._name_of[id(p)]] = g
        if len(self._pending) < len(self.names):
            return None
        grads, self._pending = self._pending, {}
        self.norms.append(math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values())))
        self.captured.append({n: grads[n].to("cpu", copy=True) for n in self.names} if self.keep else None)
        return None


class ExampleRecorder(LoopCallback):
    """Loss function and callback of :func:`accum_kit.train_loop`: which examples each window ran here.

    Pass the same instance as ``loss_fn`` and in ``callbacks``. ``windows[w]``
    lists this process's examples of window ``w`` (0-based) as
    ``{"input_ids": [int], "labels": [int]}`` with the padding removed, so the
    oracle can rebuild the big batch from what really ran.
    """

    def __init__(self):
        self.window = 0
        self.windows: list[list[dict]] = []

    def on_micro_batch_begin(self, state: LoopState) -> None:  # called before loss_fn
        self.window = state.step

    def __call__(self, model, batch):
        """Record ``batch`` under the current window; return :func:`accum_kit.causal_lm_loss` of it."""
        self.record(self.window, batch)
        return causal_lm_loss(model, batch)

    def record(self, window: int, batch) -> None:
        """Append the examples of ``batch`` (right-padded tensors of shape (batch, seq)) to ``window``."""
        while len(self.windows) <= window:
            self.windows.append([])
        ids, mask = batch["input_ids"].cpu(), batch["attention_mask"].cpu()
        labels = batch["labels"].cpu()
        for i in range(ids.size(0)):
            n = int(mask[i].sum())  # right padding: the first n positions are the example
            self.windows[window].append({"input_ids": ids[i, :n].tolist(), "labels": labels[i, :n].tolist()})


class EvalMode(LoopCallback):
    """Callback: dropout off for the whole loop (train_loop calls model.train() just before on_train_begin)."""

    def __init__(self, model):
        self.model = model

    def on_train_begin(self, state: LoopState) -> None:
        self.model.eval()
