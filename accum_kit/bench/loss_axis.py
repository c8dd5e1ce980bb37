"""The causal-LM loss as an axis of ``accum-kit bench``: which loss each arm runs, and what the memory model predicts.

The references the kit is compared with compute the loss from the full logits: raw DDP
(:mod:`accum_kit.reference.raw_ddp`), the plain loop and the peers (the model's own loss given ``labels``). So the
kit's arms compared with them run that formula too (:func:`accum_kit.core.loss.logits_causal_lm_loss`), and each
of those comparisons says what the loop brings. An arm named ``<arm>_fused`` runs ``<arm>`` with
:func:`accum_kit.train_loop`'s default loss instead (:data:`accum_kit.core.loss.causal_lm_loss`: the loss computed
inside the output layer in chunks, without full-vocabulary logits; docs/fused_loss.md), on the same model, data and
schedule, and its comparison with ``<arm>`` says what the loss brings (:mod:`.report_loss`).

The arms: ``kit_fused`` on one process (in the default), ``no_sync_fused`` under DDP (``--modes``, opt-in), under
FSDP2 / HSDP ``<policy>_fused`` for any policy of ``--accumulation_policies`` (opt-in, e.g. ``no_sync_fused``).
"""

from __future__ import annotations

from ..errors import UsageError

#: What names an arm running the fused loss: ``<arm>`` + this.
FUSED_SUFFIX = "_fused"


def fused_name(arm: str) -> str:
    """The name of ``arm`` run with the fused loss."""
    return arm + FUSED_SUFFIX


def is_fused(arm: str) -> bool:
    """Whether ``arm`` runs the fused loss (its name ends in :data:`FUSED_SUFFIX`)."""
    return arm.endswith(FUSED_SUFFIX)


def logits_arm(arm: str) -> str:
    """The arm ``arm`` is compared with: itself without :data:`FUSED_SUFFIX` (the same loop with the logits)."""
    return arm.removesuffix(FUSED_SUFFIX)


def loss_fn(arm: str):
    """The ``loss_fn`` that :func:`accum_kit.train_loop` gets in ``arm``: None (its default, the fused loss where
    the model allows it) for a fused arm, else :func:`accum_kit.core.loss.logits_causal_lm_loss`."""
    from ..core.loss import logits_causal_lm_loss

    return None if is_fused(arm) else logits_causal_lm_loss


class SwitchedLoss:
    """A ``loss_fn`` whose formula is chosen between windows: the FSDP2 part rotates its arms window by window
    inside one :func:`accum_kit.train_loop` run, so the loss follows the arm.

    Attributes:
        fused: True: the fused loss (a :class:`accum_kit.core.loss.CausalLMLoss` with ``fused="auto"``, the
            default's settings); False (the start): :func:`accum_kit.core.loss.logits_causal_lm_loss`.
    """

    def __init__(self):
        from ..core.loss import CausalLMLoss, logits_causal_lm_loss

        self.fused = False
        self._losses = {True: CausalLMLoss(), False: logits_causal_lm_loss}

    def __call__(self, model, batch):
        return self._losses[self.fused](model, batch)

    def count_items(self, batch):
        """Target tokens of ``batch`` (the same under either formula)."""
        return self._losses[False].count_items(batch)


def compute_element_bytes(accelerator) -> int:
    """e, bytes per activation element under the run's compute precision: 2 under bf16 / fp16, else 4 (as the train
    job's prediction, :func:`accum_kit.profiler.held_memory.predicted_peak`)."""
    from ..core.run_plan import run_plan_of

    return 2 if run_plan_of(accelerator).engine.compute_precision(accelerator) in ("bf16", "fp16") else 4


def predicted_loss_memory(config: dict, micro_batch: int, seq: int, element_bytes: int = 4,
                          checkpointing: bool = False, head_bias: bool = False) -> dict:
    """What the memory model (:func:`accum_kit.engines.activation_memory.activation_bytes`) predicts one
    micro-batch's activations take with each loss, and the difference, MB (2**20 bytes).

    Args:
        config: the model's transformers config as a dict; micro_batch, seq: b and s; element_bytes: e (4 fp32,
            2 under bf16 / fp16 autocast); checkpointing: activation checkpointing; head_bias: the output layer
            has a bias.

    Returns:
        ``{"logits_mb", "fused_mb", "saved_mb", "head_logits", "head_fused"}`` (the last two: the head's
        formula with its numbers); None when the config is not a transformer's the model reads.
    """
    from dataclasses import replace

    from ..engines.activation_memory import TransformerShape, activation_bytes

    try:
        shape = replace(TransformerShape.from_config(config, element_bytes), head_bias=head_bias)
    except UsageError:
        return None
    logits, fused = (activation_bytes(shape.with_loss(loss), micro_batch, seq, checkpointing=checkpointing)
                     for loss in ("logits", "fused"))
    mb = 2**20
    return {"logits_mb": logits.total / mb, "fused_mb": fused.total / mb, "saved_mb": (logits.total - fused.total) / mb,
            "head_logits": logits.formulas["head"], "head_fused": fused.formulas["head"]}
