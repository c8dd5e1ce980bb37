"""BatchNorm under accumulation: finding the layers that break exactness, and the loop's one warning.

A BatchNorm layer in training mode normalises every forward with the mean and
variance of that forward's own batch (Ioffe and Szegedy, "Batch
Normalization", ICML 2015, https://arxiv.org/abs/1502.03167). With K
micro-batches per process on W processes, each of the K x W forwards of a
window uses the statistics of its own B examples, while one big batch would
use those of all B x K x W: the accumulated gradient cannot equal the big
batch's, however the losses are normalised. ``SyncBatchNorm`` takes the
statistics over the processes but still per micro-batch (exact only at
K = 1); GroupNorm and LayerNorm are per example (exact); a BatchNorm in eval
mode uses its running statistics (exact). docs/batchnorm.md has the measured
deviations and what becomes of the running statistics under DDP.
"""

from __future__ import annotations

import warnings

import torch


class BatchNormAccumulationWarning(UserWarning):
    """BatchNorm layers train under gradient accumulation (filter it with ``warnings.filterwarnings``)."""


def is_batchnorm(module: torch.nn.Module) -> bool:
    """Whether ``module`` normalises with batch statistics in training mode: any subclass of
    ``torch.nn.modules.batchnorm._BatchNorm`` (``BatchNorm1d/2d/3d``, their lazy forms, ``SyncBatchNorm``)."""
    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm)


def batchnorm_layers(model: torch.nn.Module, training_only: bool = False) -> list[str]:
    """Names of the BatchNorm layers of ``model``.

    Every subclass of ``torch.nn.modules.batchnorm._BatchNorm`` counts:
    ``BatchNorm1d/2d/3d``, their lazy forms and ``SyncBatchNorm``. With
    ``training_only`` only those in training mode (they normalise with batch
    statistics; a layer in eval mode uses its running statistics). A
    DDP-wrapped model's names keep DDP's ``module.`` prefix.
    """
    return [name or type(model).__name__ for name, m in model.named_modules()
            if is_batchnorm(m) and (m.training or not training_only)]


def batchnorm_message(layers: list[str], accumulation_steps: int, world_size: int) -> str:
    """The warning text: which layers, why the update differs from one big batch, and the fixes."""
    shown = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
    return (f"{len(layers)} BatchNorm layer(s) train with batch statistics ({shown}) under gradient accumulation "
            f"(K={accumulation_steps} micro-batches x {world_size} process(es)): each micro-batch is normalised with "
            "its own statistics, so the accumulated update is close to, but not equal to, one big batch's "
            "(the loss normalisation is not at fault). Exact alternatives: GroupNorm or LayerNorm, or BatchNorm in "
            "eval mode (frozen running statistics); SyncBatchNorm shares statistics across processes but still "
            "per micro-batch. The running statistics move K times per optimizer step. See docs/batchnorm.md; "
            "accum_kit.verify.verify_accumulation measures the deviation on your model.")


def warn_if_batchnorm_trains(accelerator, model: torch.nn.Module, schedule=None) -> bool:
    """Warn once (main process) when BatchNorm layers train and a window holds more than one micro-batch per process.

    Args:
        accelerator: the loop's Accelerator (K, processes, which process warns).
        model: the (prepared) model, in the mode it will train in.
        schedule: the run's accumulation schedule ``{optimizer step: K}``;
            None: the Accelerator's K throughout.

    Returns:
        True when the condition holds (on every process; only the main process warns).
    """
    ks = list(schedule.values()) if schedule else [accelerator.gradient_accumulation_steps]
    layers = batchnorm_layers(model, training_only=True)
    if not layers or max(ks) <= 1:
        return False
    if accelerator.is_main_process:
        warnings.warn(batchnorm_message(layers, max(ks), accelerator.num_processes),
                      BatchNormAccumulationWarning, stacklevel=3)
    return True
