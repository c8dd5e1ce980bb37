"""``accum-kit plan``: batch arithmetic, learning-rate scaling and solving for K.

Three questions answered before a run, without a GPU (and without importing torch):

1. **Batch plan** (:mod:`.batch`, :func:`plan_batch`): effective batch
   ``B x K x P``, micro-batches and optimizer steps per epoch
   (:func:`optimizer_steps_per_epoch`, ``ceil(M / K)``), padded or dropped
   examples and the last, possibly partial, optimizer step, under Accelerate's
   default DataLoader sharding.
2. **Learning-rate scaling** (:mod:`accum_kit.core.lr_scaling`, :func:`scale_learning_rate`): linear
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

5. **Accumulation schedule** (:mod:`accum_kit.core.accumulation_schedule`, ``--accumulation_schedule``):
   batch-size warm-up ``{step: K}``; K at a step, steps of a run
   (:func:`scheduled_steps`) and a phase table of K, examples, tokens,
   steps and epochs (:func:`schedule_phases`).

:func:`make_plan` answers all of them from keywords named like the flags and
:func:`format_plan` prints them (:mod:`.plan_report`); every result is a dataclass,
and ``--json`` prints the same fields. The command line contract
(``ARGUMENTS``, ``DESCRIPTION``, ``run_command``) is in :mod:`.plan_command`.
Without ``--gradient_accumulation_steps``, K follows the one default rule of
:func:`accum_kit.core.settings.resolve_accumulation_steps`.

The modules, by role, each importing only those before it (no cycle):
:mod:`.batch`, :mod:`.solve` (batch arithmetic); :mod:`.interconnects`
(named links' bus bandwidths); :mod:`.step_time` (the one step-time model,
every engine); :mod:`.measured_profile` (the one reader of a
``train --profile_comm`` summary); :mod:`.whatif` and :mod:`.whatif_bench`
(DDP from a profile, and against a bench); :mod:`.topology` (every engine on
several machines); :mod:`.fsdp_format`, :mod:`.fsdp_plan`,
:mod:`.fsdp_compare` (``--fsdp``: its text, the plan, against a bench);
:mod:`.plan_report` and :mod:`.plan_command` (the command).

The names below are imported on first use (PEP 562 ``__getattr__``), so that
importing one module of the package (the profiler and the bench import
:mod:`.step_time`) does not load the command and its tables.
"""

from __future__ import annotations

import importlib

#: Public name -> the module that defines it.
_EXPORTS = {
    "ARGUMENTS": ".plan_command",
    "AccumulationSolution": ".solve",
    "BatchPlan": ".batch",
    "DESCRIPTION": ".plan_command",
    "LR_RULES": "..core.lr_scaling",
    "LearningRateScaling": "..core.lr_scaling",
    "PlanArguments": ".plan_command",
    "PlanReport": ".plan_report",
    "SOURCES": "..core.lr_scaling",
    "SchedulePhase": "..core.accumulation_schedule",
    "WARMUP_EPOCHS": "..core.lr_scaling",
    "WARMUP_MULTIPLIER_THRESHOLD": "..core.lr_scaling",
    "WARMUP_SOURCE": "..core.lr_scaling",
    "accumulation_steps_at": "..core.accumulation_schedule",
    "check_accumulation_schedule": "..core.accumulation_schedule",
    "parse_accumulation_schedule": "..core.accumulation_schedule",
    "schedule_phases": "..core.accumulation_schedule",
    "scheduled_steps": "..core.accumulation_schedule",
    "effective_batch_size": ".batch",
    "format_plan": ".plan_report",
    "make_plan": ".plan_report",
    "optimizer_steps_per_epoch": ".batch",
    "plan_batch": ".batch",
    "run_command": ".plan_command",
    "scale_learning_rate": "..core.lr_scaling",
    "solve_accumulation_steps": ".solve",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Import a public name from its module on first access and cache it here.

    Raises:
        AttributeError: ``name`` is not public (so that ``from accum_kit.planning import <module>`` falls back
            to importing the module).
    """
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
