"""The train job on a mixture-of-experts model: the router's load-balancing loss, its records and scalars."""

from __future__ import annotations

from ..core.router_loss import FLAG, RouterAuxLoss, RouterWindowRecords, moe_settings
from ..errors import UsageError


def router_loss(scope: str | None, accelerator, model, lm_loss=None) -> RouterAuxLoss | None:
    """The job's ``loss_fn`` for a mixture-of-experts model (None for a dense one: the default causal-LM loss).

    Args:
        scope: ``--router_aux_loss_scope`` (None: ``"window"``, the big batch's definition).
        lm_loss: the :class:`accum_kit.core.loss.CausalLMLoss` whose output-layer setting the LM part follows.

    Raises:
        UsageError (``--router_aux_loss_scope``): the flag given for a dense model, or an unknown scope.
    """
    try:
        moe_settings(model)
    except UsageError:
        if scope is not None:
            raise
        return None
    return RouterAuxLoss(accelerator, model, scope=scope or "window", lm_loss=lm_loss)


def router_records(loss: RouterAuxLoss | None, accelerator):
    """The loop callback that closes each window's router record and logs ``train/lm_loss``,
    ``train/router_aux_loss`` (the definition in force) and ``train/expert_balance`` to the trackers."""
    if loss is None:
        return None

    def log(record: dict, step: int) -> None:
        aux = record["aux_loss_window"] if record["scope"] == "window" else record["aux_loss_micro_batch_mean"]
        accelerator.log({"train/lm_loss": record["lm_loss"], "train/router_aux_loss": aux,
                         "train/expert_balance": record["expert_balance"]}, step=step)

    return RouterWindowRecords(loss, log)


def router_summary(loss: RouterAuxLoss | None) -> dict | None:
    """train_summary.json's ``router`` block: the definition trained, the coefficient, and per window the LM loss,
    both definitions' aux values, tokens per expert and the balance (None for a dense model)."""
    if loss is None:
        return None
    return {"router_aux_loss_scope": loss.scope, "router_aux_loss_coef": loss.coef, "experts": loss.experts,
            "top_k": loss.top_k, "flag": FLAG, "windows": loss.windows}
