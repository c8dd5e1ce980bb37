"""The BatchNorm finding of ``verify``: how far BatchNorm in training mode takes the update from the big batch.

The rows of ``verify`` run with every module in eval mode, so a BatchNorm
layer normalises with its running statistics and the accumulation is exact.
In training, though, :func:`accum_kit.train_loop` calls ``model.train()``
and every BatchNorm layer normalises each micro-batch with that micro-batch's
own statistics (per process; SyncBatchNorm: over the processes, still per
micro-batch). No normalisation of the loss can make that equal to one big
batch normalised with the statistics of all its examples
(:mod:`accum_kit.core.batchnorm`). When the model given to ``verify`` has
BatchNorm layers, one more pass measures it. Their mode in the given model
does not matter (``from_pretrained`` returns models in eval mode, and
``train_loop`` calls ``model.train()`` anyway); a model whose BatchNorm layers
are kept frozen during training (a callback puts them in eval mode) can ignore
the finding, as its text says.

- the toolkit's ``tokens`` normalisation through ``train_loop`` with the
  BatchNorm layers in training mode (:class:`BatchNormTrainMode`; dropout
  stays off), on the same windows and initial parameters;
- the oracle with the same layers normalising the whole big batch with its own
  statistics (:func:`big_batch_statistics`; for SyncBatchNorm too, since on
  one process all processes' examples are in that batch).

The result is an informational row and a finding with the fixes: it never
changes ``passed`` or the exit code, because the loop is not at fault.
"""

from __future__ import annotations

import contextlib
import math
import types

import torch.nn.functional as F

from ..core.batchnorm import batchnorm_layers, is_batchnorm
from ..core.callbacks import LoopCallback, LoopState

__all__ = ["FIXES", "BatchNormTrainMode", "big_batch_statistics", "finding_lines", "summarize",
           "batchnorm_layers"]

#: What to do about it, most exact first (docs/batchnorm.md has the measurements).
FIXES = (
    "GroupNorm or LayerNorm instead of BatchNorm: statistics per example, exact under any K and process count",
    "BatchNorm in eval mode (frozen running statistics, e.g. when fine-tuning): exact",
    "SyncBatchNorm (torch.nn.SyncBatchNorm.convert_sync_batchnorm, GPUs): statistics over the processes, exact at "
    "K=1 only",
    "a larger micro-batch and a smaller K: each micro-batch's statistics come closer to the big batch's",
)


class BatchNormTrainMode(LoopCallback):
    """Callback: every module in eval mode except the BatchNorm layers, which train (batch statistics).

    train_loop calls ``model.train()`` just before ``on_train_begin``; this
    turns dropout off again and leaves only BatchNorm normalising with batch
    statistics, so the pass differs from the exact rows by BatchNorm alone.
    """

    def __init__(self, model):
        self.model = model

    def on_train_begin(self, state: LoopState) -> None:
        self.model.eval()
        for m in self.model.modules():
            if is_batchnorm(m):
                m.train()


def _batch_statistics_forward(self, x):
    """BatchNorm of ``x`` with the statistics of ``x`` itself (the running buffers are neither used nor updated)."""
    return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)


@contextlib.contextmanager
def big_batch_statistics(model):
    """Inside the block every BatchNorm layer of ``model`` normalises its input with that input's statistics.

    For the oracle's one big batch on one process: plain ``F.batch_norm`` in
    training mode, whatever the layer's class (a SyncBatchNorm alone on one
    process has nothing to synchronise with, and all processes' examples are
    in the batch). The running buffers are left untouched. Other modules keep
    their mode.
    """
    layers = [m for m in model.modules() if is_batchnorm(m)]
    for m in layers:
        m.forward = types.MethodType(_batch_statistics_forward, m)
    try:
        yield model
    finally:
        for m in layers:
            del m.forward  # back to the class's forward


def summarize(layers: list[str], comparisons: list[dict]) -> dict:
    """The finding: per-window ``rel_error``, ``cosine`` and ``norm_ratio`` of the train-mode update.

    Args:
        layers: names of the BatchNorm layers that train.
        comparisons: one :func:`accum_kit.verify.compare.compare_gradients`
            result per window (train-mode update against the train-mode big batch).
    """
    windows = []
    for c in comparisons:
        want = math.sqrt(c["want_sq"])
        windows.append({"rel_error": c["rel_error"],
                        "cosine": c["dot"] / (c["got_norm"] * want) if c["got_norm"] and want else float("nan"),
                        "norm_ratio": c["got_norm"] / want if want else float("nan")})
    return {"layers": list(layers), "windows": windows,
            "rel_error": max(w["rel_error"] for w in windows),
            "cosine": min(w["cosine"] for w in windows), "fixes": list(FIXES)}


def finding_lines(finding: dict, K: int, B: int, W: int, rtol: float) -> list[str]:
    """The report's lines for the finding (informational); ``rtol``: the report's tolerance, for "within rounding"."""
    names = finding["layers"]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    per_window = ", ".join(f"#{i + 1} {w['rel_error']:.2e} (cosine {w['cosine']:.6f}, size x{w['norm_ratio']:.4f})"
                           for i, w in enumerate(finding["windows"]))
    lines = [
        f"  finding (informational, exit code unaffected): {len(names)} BatchNorm layer(s) ({shown}) normalise "
        "with batch statistics when train_loop puts the model in training mode (unless you keep them in eval mode)",
        f"  with them in training mode the accumulated update differs from the big batch's by rel err {per_window}",
        f"  why: each micro-batch's forward normalises with the statistics of its own examples ({B} per process; "
        f"over all processes for SyncBatchNorm), the big batch with those of all the window's examples "
        f"({K * B * W} in a full window of K={K} on {W} process(es)). The loss normalisation is not at fault: the "
        "rows above, in eval mode, use the running statistics",
    ]
    if finding["rel_error"] <= rtol:
        lines.append(f"  here within the tolerance (rtol {rtol:g}): each forward saw the big batch's statistics "
                     "(e.g. SyncBatchNorm at K=1)")
    return lines + [f"  fix: {fix}" for fix in finding["fixes"]] + ["  more: docs/batchnorm.md"]
