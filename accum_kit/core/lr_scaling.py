"""Learning-rate scaling from a base batch size to a new one, with its sources.

From a base learning rate tuned at a base batch size, ``k = batch / base_batch``:

* ``linear``: ``lr = base_lr k``. The "Linear Scaling Rule" of Goyal et al.
  2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"
  (arXiv:1706.02677), section 2.1.
* ``sqrt``: ``lr = base_lr sqrt(k)``, "to keep the variance in the gradient
  expectation constant": Krizhevsky 2014, "One weird trick for parallelizing
  convolutional neural networks" (arXiv:1404.5997, p. 5), and Hoffer et al.
  2017, "Train longer, generalize better: closing the generalization gap in
  large batch training of neural networks" (arXiv:1705.08741).
* ``none``: keep ``base_lr``.

Warmup rule (ours, after Goyal et al. section 2.2, "gradual warmup" from
``base_lr`` to the scaled rate over 5 epochs, used there for k up to 32):
suggested when the rule multiplies the learning rate by more than
:data:`WARMUP_MULTIPLIER_THRESHOLD` (4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import checks

LR_RULES = ("none", "linear", "sqrt")

#: Warmup is suggested when the learning-rate multiplier exceeds this.
WARMUP_MULTIPLIER_THRESHOLD = 4.0
#: Length of the suggested gradual warmup, epochs (Goyal et al. 2017, section 2.2).
WARMUP_EPOCHS = 5

#: Where each rule comes from, printed next to the scaled rate.
SOURCES = {
    "none": "no scaling: the base learning rate is kept",
    "linear": (
        'Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" '
        "(arXiv:1706.02677), linear scaling rule"
    ),
    "sqrt": (
        'Krizhevsky 2014, "One weird trick for parallelizing convolutional neural networks" '
        '(arXiv:1404.5997); Hoffer et al. 2017, "Train longer, generalize better" (arXiv:1705.08741)'
    ),
}
WARMUP_SOURCE = 'Goyal et al. 2017, "Accurate, Large Minibatch SGD", gradual warmup (section 2.2)'

#: The fix printed for a bad --base_learning_rate.
LEARNING_RATE_FIX = "pass a positive number, e.g. 1e-4"


@dataclass(frozen=True)
class LearningRateScaling:
    """A learning rate scaled from a base batch size to a new one.

    Attributes:
        rule: ``"none"``, ``"linear"`` or ``"sqrt"``.
        base_learning_rate: the learning rate tuned at ``base_batch_size``.
        base_batch_size: examples per optimizer step the base rate was tuned at.
        batch_size: the new examples per optimizer step.
        batch_ratio: ``k = batch_size / base_batch_size``.
        multiplier: ``1``, ``k`` or ``sqrt(k)``.
        learning_rate: ``base_learning_rate x multiplier``.
        source: the paper the rule comes from.
        warmup_suggested: the multiplier exceeds :data:`WARMUP_MULTIPLIER_THRESHOLD`.
        warmup_epochs: suggested gradual warmup length, epochs (None: none suggested).
        warmup_steps: the same in optimizer steps when steps per epoch are known.
    """

    rule: str
    base_learning_rate: float
    base_batch_size: int
    batch_size: int
    batch_ratio: float
    multiplier: float
    learning_rate: float
    source: str
    warmup_suggested: bool = False
    warmup_epochs: int | None = None
    warmup_steps: int | None = None


def scale_learning_rate(
    base_learning_rate: float,
    base_batch_size: int,
    batch_size: int,
    rule: str = "linear",
    *,
    steps_per_epoch: int | None = None,
) -> LearningRateScaling:
    """Scale a learning rate tuned at ``base_batch_size`` to ``batch_size``.

    Args:
        base_learning_rate: learning rate tuned at the base batch size.
        base_batch_size: examples per optimizer step of the base run (all
            processes, accumulation included).
        batch_size: examples per optimizer step of the new run (``B x K x P``).
        rule: ``"linear"`` (Goyal et al. 2017), ``"sqrt"`` (Krizhevsky 2014;
            Hoffer et al. 2017) or ``"none"``.
        steps_per_epoch: optimizer steps per epoch of the new run, to express
            the suggested warmup in steps (None: epochs only).

    Returns:
        :class:`LearningRateScaling`, with a gradual warmup over
        :data:`WARMUP_EPOCHS` epochs suggested when the multiplier exceeds
        :data:`WARMUP_MULTIPLIER_THRESHOLD`.

    Raises:
        UsageError: unknown rule, or a non-positive rate or batch size.
    """
    checks.one_of("--lr_scaling", rule, LR_RULES)
    checks.positive("--base_learning_rate", base_learning_rate, fix=LEARNING_RATE_FIX)
    checks.at_least("--base_batch_size", base_batch_size)
    checks.at_least("batch_size", batch_size)
    if steps_per_epoch is not None:
        checks.at_least("steps_per_epoch", steps_per_epoch)
    k = batch_size / base_batch_size
    multiplier = {"none": 1.0, "linear": k, "sqrt": math.sqrt(k)}[rule]
    warmup = multiplier > WARMUP_MULTIPLIER_THRESHOLD
    return LearningRateScaling(
        rule=rule,
        base_learning_rate=base_learning_rate,
        base_batch_size=base_batch_size,
        batch_size=batch_size,
        batch_ratio=k,
        multiplier=multiplier,
        learning_rate=base_learning_rate * multiplier,
        source=SOURCES[rule],
        warmup_suggested=warmup,
        warmup_epochs=WARMUP_EPOCHS if warmup else None,
        warmup_steps=WARMUP_EPOCHS * steps_per_epoch if warmup and steps_per_epoch else None,
    )
