"""``accum-kit plan``: batch arithmetic, learning-rate scaling and solving for K.

Three questions answered before a run, without a GPU (and without importing torch):

1. **Batch plan** (:mod:`.batch`, :func:`plan_batch`): effective batch
   ``B x K x P``, micro-batches and optimizer steps per epoch
   (:func:`optimizer_steps_per_epoch`, ``ceil(M / K)``), padded or dropped
   examples and the last, possibly partial, optimizer step, under Accelerate's
   default DataLoader sharding.
2. **Learning-rate scaling** (:mod:`.lr`, :func:`scale_learning_rate`): linear
   (Goyal et al. 2017, arXiv:1706.02677), square root (Krizhevsky 2014,
   arXiv:1404.5997; Hoffer et al. 2017, arXiv:1705.08741) or none, with a
   gradual-warmup suggestion after Goyal et al. section 2.2.
3. **Solving for K** (:mod:`.solve`, :func:`solve_accumulation_steps`): the
   largest per-device batch ``B <= max`` and smallest ``K`` with
   ``B K P == target``.

4. **What if** (:mod:`.whatif`, ``--from_profile``): step time with and
   without no_sync, speedup and communication share per K on a target
   process count and bus bandwidth, from a ``train --profile_comm``
   measurement, and the K that keeps communication under a share;
   :mod:`.whatif_bench` compares it with a ``bench.json`` (``--compare_bench``).

5. **Accumulation schedule** (:mod:`.schedule`, ``--accumulation_schedule``):
   batch-size warm-up ``{step: K}``; K at a step, steps of a run
   (:func:`scheduled_steps`) and a phase table of K, examples, tokens,
   steps and epochs (:func:`schedule_phases`).

:func:`make_plan` answers all of them from keywords named like the flags and
:func:`format_plan` prints them (:mod:`.report`); every result is a dataclass,
and ``--json`` prints the same fields. The command line contract
(``ARGUMENTS``, ``DESCRIPTION``, ``run_command``) is in :mod:`.command`.
Without ``--gradient_accumulation_steps``, K follows the one default rule of
:func:`accum_kit.core.settings.resolve_accumulation_steps`.
"""

from .batch import BatchPlan, effective_batch_size, optimizer_steps_per_epoch, plan_batch
from .command import ARGUMENTS, DESCRIPTION, PlanArguments, run_command
from ..core.lr_scaling import (
    LR_RULES,
    SOURCES,
    WARMUP_EPOCHS,
    WARMUP_MULTIPLIER_THRESHOLD,
    WARMUP_SOURCE,
    LearningRateScaling,
    scale_learning_rate,
)
from .report import PlanReport, format_plan, make_plan
from ..core.accumulation_schedule import (
    SchedulePhase,
    accumulation_steps_at,
    check_accumulation_schedule,
    parse_accumulation_schedule,
    schedule_phases,
    scheduled_steps,
)
from .solve import AccumulationSolution, solve_accumulation_steps

__all__ = [
    "ARGUMENTS",
    "AccumulationSolution",
    "BatchPlan",
    "DESCRIPTION",
    "LR_RULES",
    "LearningRateScaling",
    "PlanArguments",
    "PlanReport",
    "SOURCES",
    "SchedulePhase",
    "WARMUP_EPOCHS",
    "WARMUP_MULTIPLIER_THRESHOLD",
    "WARMUP_SOURCE",
    "accumulation_steps_at",
    "check_accumulation_schedule",
    "parse_accumulation_schedule",
    "schedule_phases",
    "scheduled_steps",
    "effective_batch_size",
    "format_plan",
    "make_plan",
    "optimizer_steps_per_epoch",
    "plan_batch",
    "run_command",
    "scale_learning_rate",
    "solve_accumulation_steps",
]
