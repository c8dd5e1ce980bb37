"""verify's mixture-of-experts finding: how far the per-micro-batch router aux loss takes the gradient from the
window's (the big batch's) definition, on the user's model, data and K (main process, float64).

For each window verify ran, the window's examples are cut into the micro-batches the processes ran (B
examples each, in the dataloader's order) and two gradients of ``router_aux_loss_coef x aux`` are taken
on the float64 copy of the initial model: the window's definition (transformers' own
``load_balancing_loss_func`` over the whole window as one batch) and the per-micro-batch one (each
micro-batch's value, averaged over the window's micro-batches). Reported: both values and the relative
difference of the two gradients, per window. Informational: it never decides ``passed``. See
:mod:`accum_kit.core.router_loss` and docs/moe.md for the definitions and ``--router_aux_loss_scope``.
"""

from __future__ import annotations

import torch

from ..core.router_loss import moe_settings
from ..errors import UsageError


def _aux(model64, batch, experts: int, top_k: int) -> torch.Tensor:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    out = model64(**{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}, output_router_logits=True)
    return load_balancing_loss_func(out.router_logits, experts, top_k, batch.get("attention_mask"))


def router_finding(model64, windows: list, micro_batch: int, collate_fn, to_device) -> dict | None:
    """The finding for a mixture-of-experts ``model64`` (None for a dense one).

    Args:
        model64: the float64 oracle copy of the initial model.
        windows: per window, its examples in the dataloader's order (every process's micro-batches).
        micro_batch: B, examples per micro-batch and process.
        collate_fn: list of examples -> batch; ``to_device``: batch -> batch on the oracle's device.

    Returns:
        ``{"coef", "experts", "top_k", "windows": [{"micro_batches", "aux_window", "aux_micro_batch_mean",
        "gradient_rel_diff"}]}``.
    """
    try:
        experts, top_k, coef, _ = moe_settings(model64)
    except UsageError:
        return None
    params = [p for p in model64.parameters() if p.requires_grad]

    def grad(loss):
        model64.zero_grad(set_to_none=True)
        loss.backward()
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])

    rows = []
    for examples in windows:
        whole = _aux(model64, to_device(collate_fn(examples)), experts, top_k)
        g_window = grad(coef * whole)
        chunks = [examples[i: i + micro_batch] for i in range(0, len(examples), micro_batch)]
        parts = [_aux(model64, to_device(collate_fn(c)), experts, top_k) for c in chunks]
        per_micro = sum(parts) / len(parts)
        g_micro = grad(coef * per_micro)
        rows.append({"micro_batches": len(chunks), "aux_window": float(whole), "aux_micro_batch_mean": float(per_micro),
                     "gradient_rel_diff": float((g_micro - g_window).norm() / g_window.norm().clamp(min=1e-300))})
    return {"coef": coef, "experts": experts, "top_k": top_k, "windows": rows}


def finding_lines(finding: dict) -> list[str]:
    """The report's lines for :func:`router_finding`'s result."""
    worst = max(w["gradient_rel_diff"] for w in finding["windows"])
    lines = [f"  router aux loss ({finding['experts']} experts, top-{finding['top_k']}, coef {finding['coef']:g}): "
             "the per-micro-batch definition against the window's (--router_aux_loss_scope)"]
    for i, w in enumerate(finding["windows"], 1):
        lines.append(f"    window {i} ({w['micro_batches']} micro-batches): aux {w['aux_window']:.6f} (window) vs "
                     f"{w['aux_micro_batch_mean']:.6f} (per micro-batch, mean); gradient of coef x aux differs by "
                     f"{w['gradient_rel_diff']:.2%}")
    lines.append(f"    largest: {worst:.2%}; the train job's default (window) is the big batch's")
    return lines
