"""``accum-kit plan``: batch arithmetic, learning-rate scaling and solving for K.

Three questions answered before a run, without a GPU:

1. **Batch plan** (:func:`plan_batch`). With per-device batch ``B``,
   gradient accumulation steps ``K`` and ``P`` processes (all machines
   together), one optimizer step sees ``B x K x P`` examples. Over an epoch of
   ``N`` examples, a map-style ``DataLoader`` prepared by
   ``accelerator.prepare`` (``split_batches=False``, ``even_batches=True``, the
   defaults) gives every process

   * ``ceil(N / (B P))`` micro-batches without ``drop_last``: the last global
     batch is completed with examples repeated from the start of the epoch
     (``BatchSamplerShard._iter_with_no_split`` in ``accelerate/data_loader.py``;
     its ``__len__`` is ``ceil(ceil(N / B) / P)``, which equals
     ``ceil(N / (B P))``), so ``ceil(N / (B P)) B P - N`` examples are padded
     (seen twice);
   * ``floor(N / (B P))`` micro-batches with ``drop_last=True``, so
     ``N - floor(N / (B P)) B P`` examples are dropped.

   Accelerate ends the accumulation window at the end of the dataloader
   (``GradientAccumulationPlugin(sync_with_dataloader=True)``, the default), so
   a last partial window of ``r = M mod K`` micro-batches still makes an
   optimizer step: steps per epoch = ``ceil(M / K)``
   (:func:`optimizer_steps_per_epoch`).

2. **Learning-rate scaling** (:func:`scale_learning_rate`) from a base learning
   rate tuned at a base batch size, ``k = batch / base_batch``:

   * ``linear``: ``lr = base_lr k``. The "Linear Scaling Rule" of Goyal et al.
     2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"
     (arXiv:1706.02677), section 2.1.
   * ``sqrt``: ``lr = base_lr sqrt(k)``, "to keep the variance in the gradient
     expectation constant": Krizhevsky 2014, "One weird trick for
     parallelizing convolutional neural networks" (arXiv:1404.5997, p. 5), and
     Hoffer et al. 2017, "Train longer, generalize better: closing the
     generalization gap in large batch training of neural networks"
     (arXiv:1705.08741).
   * ``none``: keep ``base_lr``.

   Warmup rule (ours, after Goyal et al. section 2.2, "gradual warmup" from
   ``base_lr`` to the scaled rate over 5 epochs, used there for k up to 32):
   suggested when the rule multiplies the learning rate by more than
   :data:`WARMUP_MULTIPLIER_THRESHOLD` (4).

3. **Solving for K** (:func:`solve_accumulation_steps`): given a target batch,
   the largest per-device batch that fits in memory and ``P``, the largest
   ``B <= max`` with the smallest ``K`` such that ``B K P == target``.

:func:`main` is the command line (``accum-kit plan``); every result is also a
dataclass for use from Python, and ``--json`` prints the same fields.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass

from .cli import ArgumentParser, parse_args
from .errors import UsageError

LR_RULES = ("none", "linear", "sqrt")


def optimizer_steps_per_epoch(micro_batches_per_process: int, gradient_accumulation_steps: int) -> int:
    """Optimizer steps in one epoch: a last partial window still makes a step (``ceil(M / K)``)."""
    return math.ceil(micro_batches_per_process / gradient_accumulation_steps)

#: Warmup is suggested when the learning-rate multiplier exceeds this.
WARMUP_MULTIPLIER_THRESHOLD = 4.0
#: Length of the suggested gradual warmup, epochs (Goyal et al. 2017, section 2.2).
WARMUP_EPOCHS = 5

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


# ---------------------------------------------------------------------------
# validation helpers


def _positive_int(flag: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(flag, f"must be an integer (got {value!r})", "pass a positive integer")
    if value < 1:
        raise UsageError(flag, f"must be >= 1 (got {value})", "pass a positive integer")


def _positive_float(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(flag, f"must be a number (got {value!r})", "pass a positive number, e.g. 1e-4")
    if not math.isfinite(value) or value <= 0:
        raise UsageError(flag, f"must be a finite number > 0 (got {value})", "pass a positive number, e.g. 1e-4")


# ---------------------------------------------------------------------------
# 1. batch plan


@dataclass(frozen=True)
class BatchPlan:
    """Batch arithmetic of one epoch. Counts are examples unless named otherwise.

    Attributes:
        per_device_train_batch_size: ``B``, examples per micro-batch per process.
        gradient_accumulation_steps: ``K``, micro-batches per optimizer step per process.
        num_processes: ``P``, processes over all machines.
        effective_batch_size: ``B K P``, examples per full optimizer step.
        drop_last: the DataLoader drops the incomplete last global batch.
        num_examples: ``N``, examples in the training set (None: not given; the
            per-epoch fields below are then None too).
        micro_batches_per_process: ``M``, micro-batches each process runs per epoch.
        optimizer_steps_per_epoch: ``ceil(M / K)``.
        examples_per_epoch: examples processed per epoch over all processes,
            padding included: ``M B P`` (one process: ``N``; Accelerate pads
            only when it shards the batches over several processes).
        examples_padded: examples repeated from the start of the epoch to
            complete the last global batch (0 with ``drop_last`` or one process).
        examples_dropped: examples never seen in the epoch (0 without ``drop_last``).
        last_step_micro_batches: micro-batches per process in the epoch's last
            optimizer step, ``M mod K`` or ``K`` when that is 0.
        last_step_examples: examples in the last optimizer step over all
            processes, padding included.
        last_step_is_partial: ``last_step_micro_batches < K``.
    """

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_processes: int
    effective_batch_size: int
    drop_last: bool = False
    num_examples: int | None = None
    micro_batches_per_process: int | None = None
    optimizer_steps_per_epoch: int | None = None
    examples_per_epoch: int | None = None
    examples_padded: int | None = None
    examples_dropped: int | None = None
    last_step_micro_batches: int | None = None
    last_step_examples: int | None = None
    last_step_is_partial: bool | None = None


def effective_batch_size(per_device_train_batch_size: int, gradient_accumulation_steps: int, num_processes: int) -> int:
    """Examples per optimizer step over all processes: ``B x K x P``.

    Raises:
        UsageError: a value below 1 (the message names its flag).
    """
    _positive_int("--per_device_train_batch_size", per_device_train_batch_size)
    _positive_int("--gradient_accumulation_steps", gradient_accumulation_steps)
    _positive_int("--num_processes", num_processes)
    return per_device_train_batch_size * gradient_accumulation_steps * num_processes


def plan_batch(
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int = 1,
    num_processes: int = 1,
    num_examples: int | None = None,
    *,
    drop_last: bool = False,
) -> BatchPlan:
    """The batch plan of one epoch under Accelerate's default sharding.

    Args:
        per_device_train_batch_size: ``B``, examples per micro-batch on one process.
        gradient_accumulation_steps: ``K``, micro-batches per optimizer step.
        num_processes: ``P``, processes over all machines (``accelerate launch
            --num_processes``, i.e. ``WORLD_SIZE``).
        num_examples: ``N``, training examples per epoch; None leaves the
            per-epoch fields None.
        drop_last: the DataLoader was built with ``drop_last=True``.

    Returns:
        :class:`BatchPlan`. Formulas: ``M = ceil(N / (B P))`` (``floor`` with
        ``drop_last``), after ``BatchSamplerShard`` in ``accelerate/data_loader.py``
        with ``even_batches=True``; steps = ``ceil(M / K)`` since Accelerate
        syncs at the end of the dataloader.

    Raises:
        UsageError: a value below 1, or ``drop_last`` with fewer than ``B P``
            examples (the epoch would have no batch).
    """
    eff = effective_batch_size(per_device_train_batch_size, gradient_accumulation_steps, num_processes)
    _positive_int("--num_examples", num_examples, allow_none=True)
    B, K, P = per_device_train_batch_size, gradient_accumulation_steps, num_processes
    if num_examples is None:
        return BatchPlan(B, K, P, eff, drop_last=drop_last)
    N, global_micro = num_examples, B * P
    if drop_last:
        M = N // global_micro
        if M == 0:
            raise UsageError(
                "--num_examples",
                f"{N} examples are fewer than one global micro-batch of B x P = {global_micro} with --drop_last, "
                "so the epoch has no batch",
                "lower --per_device_train_batch_size, add data, or drop --drop_last",
            )
        padded, dropped = 0, N - M * global_micro
    else:
        M = math.ceil(N / global_micro)
        padded, dropped = M * global_micro - N, 0
    # Accelerate shards (and pads with repeated examples) only for several processes;
    # with one, the last micro-batch is simply shorter.
    short = padded if P == 1 else 0
    padded -= short
    r = M % K or K
    return BatchPlan(
        B,
        K,
        P,
        eff,
        drop_last=drop_last,
        num_examples=N,
        micro_batches_per_process=M,
        optimizer_steps_per_epoch=optimizer_steps_per_epoch(M, K),
        examples_per_epoch=M * global_micro - short,
        examples_padded=padded,
        examples_dropped=dropped,
        last_step_micro_batches=r,
        last_step_examples=r * global_micro - short,
        last_step_is_partial=r < K,
    )


# ---------------------------------------------------------------------------
# 2. learning-rate scaling


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
    if rule not in LR_RULES:
        raise UsageError("--lr_scaling", f"unknown rule {rule!r}", f"use one of {', '.join(LR_RULES)}")
    _positive_float("--base_learning_rate", base_learning_rate)
    _positive_int("--base_batch_size", base_batch_size)
    _positive_int("batch_size", batch_size)
    _positive_int("steps_per_epoch", steps_per_epoch, allow_none=True)
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


# ---------------------------------------------------------------------------
# 3. solving for K


@dataclass(frozen=True)
class AccumulationSolution:
    """``B`` and ``K`` that reach a target batch on ``P`` processes.

    Attributes:
        target_batch_size: examples per optimizer step wanted.
        max_per_device_train_batch_size: the largest per-device batch that fits.
        num_processes: ``P``.
        per_device_train_batch_size: chosen ``B`` (the largest divisor of
            ``target / P`` that is <= the maximum).
        gradient_accumulation_steps: ``K = target / (B P)``.
        note: why ``B`` is below the maximum, when it is (else None).
    """

    target_batch_size: int
    max_per_device_train_batch_size: int
    num_processes: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    note: str | None = None


def _best_split(per_process: int, max_b: int) -> tuple[int, int]:
    """Largest ``B <= max_b`` dividing ``per_process``, and ``K = per_process / B``."""
    b = max(d for d in range(1, min(max_b, per_process) + 1) if per_process % d == 0)
    return b, per_process // b


def _neighbours(target: int, step: int) -> tuple[int | None, int]:
    """Nearest multiples of ``step`` below (None if under ``step``) and above ``target``."""
    below = (target // step) * step
    return (below if below >= step else None), (target // step + 1) * step


def solve_accumulation_steps(
    target_batch_size: int, max_per_device_train_batch_size: int, num_processes: int = 1
) -> AccumulationSolution:
    """The gradient accumulation steps that reach a target batch size.

    Args:
        target_batch_size: examples per optimizer step wanted, over all processes.
        max_per_device_train_batch_size: the largest per-device batch that fits
            in memory (the ``--per_device_train_batch_size`` flag in this mode).
        num_processes: ``P``, processes over all machines.

    Returns:
        :class:`AccumulationSolution` with the largest ``B <= max`` and then the
        smallest ``K`` such that ``B x K x P == target``.

    Raises:
        UsageError (``--target_batch_size``): the target is not a multiple of
            ``P`` (every process must run the same ``B x K`` examples per step);
            the message lists the nearest reachable sizes below and above, with
            their ``B`` and ``K``, and those that keep ``B`` at the maximum.
    """
    _positive_int("--target_batch_size", target_batch_size)
    _positive_int("--per_device_train_batch_size", max_per_device_train_batch_size)
    _positive_int("--num_processes", num_processes)
    T, max_b, P = target_batch_size, max_per_device_train_batch_size, num_processes
    if T % P:
        def describe(size: int | None) -> str | None:
            if size is None:
                return None
            b, k = _best_split(size // P, max_b)
            return f"{size} (B={b}, K={k})"

        near = [d for d in map(describe, _neighbours(T, P)) if d]
        full = [f"{s} (B={max_b}, K={s // (max_b * P)})" for s in _neighbours(T, max_b * P) if s]
        raise UsageError(
            "--target_batch_size",
            f"{T} is not a multiple of --num_processes {P}, so no B x K x {P} equals it",
            f"use a reachable size: nearest {' or '.join(near)}; with per-device batch {max_b}: {' or '.join(full)}",
        )
    b, k = _best_split(T // P, max_b)
    note = None
    if b < max_b:
        full = [str(s) for s in _neighbours(T, max_b * P) if s]
        note = (
            f"per-device batch {b} is below the maximum {max_b} because {max_b} does not divide "
            f"target / num_processes = {T // P}; targets that keep B={max_b}: {' or '.join(full)}"
        )
    return AccumulationSolution(T, max_b, P, b, k, note)


# ---------------------------------------------------------------------------
# report and command line


@dataclass(frozen=True)
class PlanReport:
    """Everything ``accum-kit plan`` prints: ``solution`` only with a target,
    ``learning_rates`` only with a base learning rate."""

    batch: BatchPlan
    solution: AccumulationSolution | None = None
    learning_rates: tuple[LearningRateScaling, ...] = ()

    def to_dict(self) -> dict:
        return {
            "batch": asdict(self.batch),
            "solution": asdict(self.solution) if self.solution else None,
            "learning_rates": [asdict(s) for s in self.learning_rates],
        }


def make_plan(
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int | None = None,
    num_processes: int = 1,
    num_examples: int | None = None,
    *,
    drop_last: bool = False,
    target_batch_size: int | None = None,
    base_learning_rate: float | None = None,
    base_batch_size: int | None = None,
    lr_scaling: str | None = None,
) -> PlanReport:
    """All of ``accum-kit plan`` from keyword arguments named like its flags.

    With ``target_batch_size``, ``per_device_train_batch_size`` is the largest
    per-device batch that fits and K is solved for (so K must not be given).
    ``lr_scaling=None`` reports all three rules.

    Raises:
        UsageError: bad or inconsistent values; the message names the flag.
    """
    if target_batch_size is not None:
        if gradient_accumulation_steps is not None:
            raise UsageError(
                "--gradient_accumulation_steps",
                "cannot be combined with --target_batch_size, which solves for it",
                "omit --gradient_accumulation_steps (or omit --target_batch_size to plan a given K)",
            )
        solution = solve_accumulation_steps(target_batch_size, per_device_train_batch_size, num_processes)
        B, K = solution.per_device_train_batch_size, solution.gradient_accumulation_steps
    else:
        solution, B, K = None, per_device_train_batch_size, (1 if gradient_accumulation_steps is None else gradient_accumulation_steps)
    batch = plan_batch(B, K, num_processes, num_examples, drop_last=drop_last)

    if base_learning_rate is None and base_batch_size is not None:
        raise UsageError("--base_learning_rate", "missing: --base_batch_size was given without it",
                         "pass the learning rate tuned at --base_batch_size, or omit both")
    if base_learning_rate is not None and base_batch_size is None:
        raise UsageError("--base_batch_size", "missing: --base_learning_rate was given without it",
                         "pass the batch size (examples per optimizer step) the base learning rate was tuned at")
    if lr_scaling is not None and base_learning_rate is None:
        raise UsageError("--lr_scaling", "needs --base_learning_rate and --base_batch_size",
                         "pass both, e.g. --base_learning_rate 1e-4 --base_batch_size 256")
    rates: tuple[LearningRateScaling, ...] = ()
    if base_learning_rate is not None:
        rules = LR_RULES if lr_scaling is None else (lr_scaling,)
        rates = tuple(
            scale_learning_rate(base_learning_rate, base_batch_size, batch.effective_batch_size, rule,
                                steps_per_epoch=batch.optimizer_steps_per_epoch)
            for rule in rules
        )
    return PlanReport(batch, solution, rates)


def _g(x: float) -> str:
    return f"{x:.6g}"


def format_plan(report: PlanReport) -> str:
    """The text table ``accum-kit plan`` prints."""
    b, lines = report.batch, []
    s = report.solution
    if s is not None:
        lines += [
            f"Solve: target batch {s.target_batch_size} with per-device batch <= {s.max_per_device_train_batch_size} "
            f"on {s.num_processes} processes",
            f"  --per_device_train_batch_size {s.per_device_train_batch_size} "
            f"--gradient_accumulation_steps {s.gradient_accumulation_steps}   "
            f"({s.per_device_train_batch_size} x {s.gradient_accumulation_steps} x {s.num_processes} = {s.target_batch_size})",
        ]
        if s.note:
            lines.append(f"  note: {s.note}")
        lines.append("")
    B, K, P = b.per_device_train_batch_size, b.gradient_accumulation_steps, b.num_processes
    mode = "drop_last=True" if b.drop_last else "drop_last=False, even_batches=True"
    rows = [
        ("per_device_train_batch_size", f"{B}"),
        ("gradient_accumulation_steps", f"{K}"),
        ("num_processes", f"{P}  (all machines)"),
        ("effective batch size", f"{b.effective_batch_size}  examples per optimizer step = {B} x {K} x {P}"),
    ]
    if b.num_examples is not None:
        op = "floor" if b.drop_last else "ceil"
        rows += [
            ("num_examples", f"{b.num_examples}"),
            ("micro-batches per process", f"{b.micro_batches_per_process}  = {op}({b.num_examples} / ({B} x {P}))"),
            ("optimizer steps per epoch",
             f"{b.optimizer_steps_per_epoch}  = ceil({b.micro_batches_per_process} / {K})"),
        ]
        if b.drop_last:
            rows.append(("examples dropped", f"{b.examples_dropped}  (not seen this epoch; drop_last=True)"))
        else:
            rows.append(("examples padded", f"{b.examples_padded}  (repeated from the start of the epoch "
                                                "to complete the last global batch)"))
        if b.last_step_is_partial:
            pad = f", {b.examples_padded} of them padding" if b.examples_padded else ""
            last = (f"PARTIAL: {b.last_step_micro_batches} of {K} micro-batches per process, "
                    f"{b.last_step_examples} examples{pad}, instead of {b.effective_batch_size}")
        else:
            last = f"full: {K} of {K} micro-batches per process, {b.last_step_examples} examples"
        rows.append(("last optimizer step", last))
    width = max(len(k) for k, _ in rows)
    lines.append(f"Batch plan (Accelerate DataLoader, {mode})")
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    if b.num_examples is None:
        lines.append(f"  note: the last optimizer step of an epoch sees (micro-batches per process mod {K}) "
                     "micro-batches when that is not 0; pass --num_examples to compute it")
    elif b.last_step_is_partial:
        lines.append(f"  note: the last optimizer step sees fewer than K={K} micro-batches (Accelerate syncs at the end "
                     "of the dataloader); accum_kit's tokens normalisation averages over what it holds, while a "
                     f"plain loss / K scales that step's gradient by {b.last_step_micro_batches}/{K}")
    if report.learning_rates:
        first = report.learning_rates[0]
        lines += ["", f"Learning rate: base {_g(first.base_learning_rate)} at batch {first.base_batch_size} -> "
                      f"batch {first.batch_size} (k = {_g(first.batch_ratio)})"]
        lines.append(f"  {'rule':<6}  {'multiplier':<10}  {'learning rate':<13}  source")
        for r in report.learning_rates:
            lines.append(f"  {r.rule:<6}  {_g(r.multiplier):<10}  {_g(r.learning_rate):<13}  {r.source}")
        for r in report.learning_rates:
            if r.warmup_suggested:
                steps = f" = {r.warmup_steps} optimizer steps" if r.warmup_steps else ""
                lines.append(
                    f"  warmup ({r.rule}): multiplier {_g(r.multiplier)} > {_g(WARMUP_MULTIPLIER_THRESHOLD)}: ramp the "
                    f"learning rate linearly from {_g(r.base_learning_rate)} to {_g(r.learning_rate)} over "
                    f"{r.warmup_epochs} epochs{steps} ({WARMUP_SOURCE})"
                )
        if not any(r.warmup_suggested for r in report.learning_rates):
            lines.append(f"  warmup: not suggested (rule: when a multiplier exceeds "
                         f"{_g(WARMUP_MULTIPLIER_THRESHOLD)}, warm up over {WARMUP_EPOCHS} epochs; {WARMUP_SOURCE})")
    return "\n".join(lines)


def build_parser(prog: str = "accum-kit plan") -> ArgumentParser:
    """The argparse parser of ``accum-kit plan`` (Hugging Face style flag names)."""
    p = ArgumentParser(prog=prog, description=(
        "Effective batch size, optimizer steps per epoch, padded/dropped examples, learning-rate scaling, "
        "and the gradient accumulation steps that reach a target batch size."))
    p.add_argument("--per_device_train_batch_size", type=int, required=True,
                   help="examples per micro-batch per process (with --target_batch_size: the largest that fits)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=None,
                   help="micro-batches per optimizer step (default 1; solved for with --target_batch_size)")
    p.add_argument("--num_processes", type=int, default=1, help="processes over all machines (default 1)")
    p.add_argument("--num_examples", type=int, default=None, help="training examples per epoch")
    p.add_argument("--drop_last", action="store_true", help="the DataLoader drops the last incomplete batch")
    p.add_argument("--target_batch_size", type=int, default=None,
                   help="examples per optimizer step wanted: solve for --gradient_accumulation_steps")
    p.add_argument("--base_learning_rate", type=float, default=None, help="learning rate tuned at --base_batch_size")
    p.add_argument("--base_batch_size", type=int, default=None,
                   help="examples per optimizer step the base learning rate was tuned at")
    p.add_argument("--lr_scaling", choices=LR_RULES, default=None,
                   help="learning-rate scaling rule (default: report all three)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the text table")
    return p


def main(argv: list[str] | None = None) -> int:
    """``accum-kit plan``: print the plan; 0 on success, 2 on bad input (``error: ...`` on stderr)."""
    args = parse_args(build_parser(), argv)
    if args is None:
        return 2
    try:
        report = make_plan(
            args.per_device_train_batch_size,
            args.gradient_accumulation_steps,
            args.num_processes,
            args.num_examples,
            drop_last=args.drop_last,
            target_batch_size=args.target_batch_size,
            base_learning_rate=args.base_learning_rate,
            base_batch_size=args.base_batch_size,
            lr_scaling=args.lr_scaling,
        )
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_plan(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
