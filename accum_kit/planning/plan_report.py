"""Everything ``accum-kit plan`` prints: the report, built from flag-named keywords, and its text form."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from tabulate import tabulate

from ..core.accumulation_schedule import SchedulePhase, schedule_phases
from ..core.lr_scaling import (LR_RULES, WARMUP_EPOCHS, WARMUP_MULTIPLIER_THRESHOLD, WARMUP_SOURCE,
                               LearningRateScaling, scale_learning_rate)
from ..core.settings import resolve_accumulation_steps
from ..errors import UsageError
from .batch import BatchPlan, plan_batch
from .fsdp_compare import compare_fsdp_bench, format_fsdp_comparison
from .fsdp_format import format_fsdp_plan
from .fsdp_plan import FSDP_FLAGS, FSDPPlan, check_fsdp_flags, make_fsdp_plan
from .measured_profile import load_profile, settings_from_profile
from .solve import AccumulationSolution, solve_accumulation_steps
from .whatif import (DEFAULT_ACCUMULATION_STEPS, DEFAULT_MAX_COMM_SHARE, WhatIfReport, check_whatif_flags,
                     format_whatif, make_whatif)
from .whatif_bench import compare_with_bench, format_comparison


@dataclass(frozen=True)
class PlanSection:
    """One of the plan's optional sections: what it reads from a profile, how it is built, compared and printed.

    Attributes:
        field: its :class:`PlanReport` field (and ``--json`` key).
        collectives: the profile it reads (:func:`accum_kit.planning.measured_profile.load_profile`).
        needs_profile: whether it predicts from a profile only (its target flags then need ``--from_profile``).
        make: ``make(keywords) -> section | None`` from :func:`make_plan`'s keywords (plus ``K``, ``B``).
        compare: ``compare(section, bench path, keywords) -> section`` with its ``comparison`` filled.
        lines: ``lines(section) -> list[str]``, its text and its comparison's.
        flags: the flags only this section reads -> the problem when one is given without it.
        enable: the fix for that problem (how to ask for the section).
        check: ``check(args)``: ranges and combinations of those flags (``args``: the flags' values by name).
    """

    field: str
    collectives: str
    needs_profile: bool
    make: Callable
    compare: Callable
    lines: Callable
    flags: dict = field(default_factory=dict)
    enable: str = ""
    check: Callable = lambda args: None


def _make_whatif(kw: dict):
    if kw["from_profile"] is None:
        return None
    return make_whatif(kw["from_profile"], num_processes=kw["num_processes"], num_machines=kw["num_machines"],
                       interconnect=kw["interconnect"], busbw_GBps=kw["busbw_GBps"],
                       accumulation_steps=kw["accumulation_steps"], max_comm_share=kw["max_comm_share"],
                       per_device_train_batch_size=kw["B"], show_K=kw["K"])


def _compare_whatif(whatif: WhatIfReport, path: str, kw: dict) -> WhatIfReport:
    p = whatif.profile
    return replace(whatif, comparison=compare_with_bench(path, p, p.compute_seconds, whatif.exposed_comm_seconds,
                                                         p.other_seconds, kw["num_processes"]))


def _make_fsdp(kw: dict) -> FSDPPlan:
    return make_fsdp_plan(
        num_processes=kw["num_processes"], gradient_accumulation_steps=kw["K"], num_machines=kw["num_machines"],
        model_preset=kw["model_preset"], num_parameters=kw["num_parameters"], num_layers=kw["num_layers"],
        vocab_size=kw["vocab_size"], block_size=kw["block_size"], mixed_precision=kw["mixed_precision"],
        gpu_memory_GB=kw["gpu_memory_GB"], free_memory_GB=kw["free_memory_GB"], interconnect=kw["interconnect"],
        busbw_GBps=kw["busbw_GBps"], from_profile=kw["from_profile"],
        replicate_size=kw["parallelism_config_dp_replicate_size"], inter_node_busbw_GBps=kw["inter_node_busbw_GBps"])


def _with_comparison(lines: Callable, compared: Callable) -> Callable:
    return lambda section: lines(section) + (compared(section.comparison) if section.comparison is not None else [])


#: ``--fsdp`` given -> the section it adds: the FSDP2 / HSDP policy plan (``from_profile`` then an FSDP2 profile,
#: ``compare_bench`` an FSDP2 bench.json); not given -> the what-if (only with ``from_profile``).
SECTIONS = {
    False: PlanSection("whatif", "all_reduce", True, _make_whatif, _compare_whatif,
                       _with_comparison(format_whatif, format_comparison)),
    True: PlanSection("fsdp", "sharded", False, _make_fsdp,
                      lambda plan, path, kw: replace(plan, comparison=compare_fsdp_bench(path, plan)),
                      _with_comparison(format_fsdp_plan, format_fsdp_comparison), FSDP_FLAGS, "pass --fsdp too",
                      lambda a: check_fsdp_flags(a.model_preset, a.num_parameters, a.num_layers, a.gpu_memory_GB,
                                                 a.free_memory_GB, a.mixed_precision, a.vocab_size)),
}


def check_section_flags(section: PlanSection, args) -> None:
    """The flags of the sections not asked for must not be given; those of ``section`` are checked.

    Args:
        section: the section the command line asks for (a value of :data:`SECTIONS`).
        args: an object with the flags' values as attributes (:class:`accum_kit.planning.plan_command.PlanArguments`).

    Raises:
        UsageError: a flag of another section (naming it, and how to ask for its section), or a bad value
            of one of ``section``'s own (see its ``check``).
    """
    for other in SECTIONS.values():
        for flag, problem in other.flags.items():
            if other is not section and getattr(args, flag.removeprefix("--")) is not None:
                raise UsageError(flag, problem, other.enable)
    section.check(args)


@dataclass(frozen=True)
class PlanReport:
    """Everything ``accum-kit plan`` prints: ``solution`` only with a target,
    ``learning_rates`` only with a base learning rate, ``whatif`` only with a profile,
    ``schedule`` (one row per phase) only with an accumulation schedule, ``fsdp`` only with ``--fsdp``."""

    batch: BatchPlan
    solution: AccumulationSolution | None = None
    learning_rates: tuple[LearningRateScaling, ...] = ()
    whatif: WhatIfReport | None = None
    schedule: tuple[SchedulePhase, ...] = ()
    notes: tuple[str, ...] = ()  # where values the flags left unset came from
    fsdp: FSDPPlan | None = None

    def to_dict(self) -> dict:
        """The report as plain JSON-ready dicts (what ``--json`` prints)."""
        return {
            "batch": asdict(self.batch),
            "solution": asdict(self.solution) if self.solution else None,
            "learning_rates": [asdict(s) for s in self.learning_rates],
            "whatif": self.whatif.to_dict() if self.whatif else None,
            "schedule": [asdict(p) for p in self.schedule] or None,
            "notes": list(self.notes),
            "fsdp": self.fsdp.to_dict() if self.fsdp else None,
        }


def check_learning_rate_flags(base_learning_rate: float | None, base_batch_size: int | None, lr_scaling: str | None) -> None:
    """The learning-rate flags go together: both base values, and a rule only with them.

    Raises:
        UsageError: one base value without the other, or ``lr_scaling`` without them.
    """
    if base_learning_rate is None and base_batch_size is not None:
        raise UsageError("--base_learning_rate", "missing: --base_batch_size was given without it",
                         "pass the learning rate tuned at --base_batch_size, or omit both")
    if base_learning_rate is not None and base_batch_size is None:
        raise UsageError("--base_batch_size", "missing: --base_learning_rate was given without it",
                         "pass the batch size (examples per optimizer step) the base learning rate was tuned at")
    if lr_scaling is not None and base_learning_rate is None:
        raise UsageError("--lr_scaling", "needs --base_learning_rate and --base_batch_size",
                         "pass both, e.g. --base_learning_rate 1e-4 --base_batch_size 256")


def check_schedule_flags(accumulation_schedule, gradient_accumulation_steps: int | None,
                         target_batch_size: int | None) -> None:
    """A schedule sets K: ``--gradient_accumulation_steps`` must agree with its K at step 0, and no target.

    Raises:
        UsageError: naming ``--gradient_accumulation_steps`` (disagrees) or ``--target_batch_size`` (given).
    """
    if accumulation_schedule is None:
        return
    first = accumulation_schedule[0]
    if gradient_accumulation_steps is not None and gradient_accumulation_steps != first:
        raise UsageError("--gradient_accumulation_steps", f"{gradient_accumulation_steps} conflicts with "
                         f"--accumulation_schedule, whose K at step 0 is {first}",
                         "drop --gradient_accumulation_steps (the schedule sets K) or make them agree")
    if target_batch_size is not None:
        raise UsageError("--target_batch_size", "cannot be combined with --accumulation_schedule, which sets K",
                         "omit one of them")


def check_batch_size_given(per_device_train_batch_size: int | None) -> None:
    """Without a profile to take it from, the per-device batch size is required.

    Raises:
        UsageError (``--per_device_train_batch_size``): it is None.
    """
    if per_device_train_batch_size is None:
        raise UsageError("--per_device_train_batch_size", "missing",
                         "pass the examples per micro-batch per process, or --from_profile train_summary.json "
                         "to take it (and K) from a profiled run")


def check_target_flags(target_batch_size: int | None, gradient_accumulation_steps: int | None) -> None:
    """``--target_batch_size`` solves for K, so K must not be given with it.

    Raises:
        UsageError (``--gradient_accumulation_steps``): both were given.
    """
    if target_batch_size is not None and gradient_accumulation_steps is not None:
        raise UsageError(
            "--gradient_accumulation_steps",
            "cannot be combined with --target_batch_size, which solves for it",
            "omit --gradient_accumulation_steps (or omit --target_batch_size to plan a given K)",
        )


def make_plan(
    per_device_train_batch_size: int | None = None,
    gradient_accumulation_steps: int | None = None,
    num_processes: int | None = None,
    num_examples: int | None = None,
    *,
    drop_last: bool = False,
    target_batch_size: int | None = None,
    base_learning_rate: float | None = None,
    base_batch_size: int | None = None,
    lr_scaling: str | None = None,
    from_profile: str | None = None,
    num_machines: int | None = None,
    interconnect: str | None = None,
    busbw_GBps: float | None = None,
    accumulation_steps=DEFAULT_ACCUMULATION_STEPS,
    max_comm_share: float = DEFAULT_MAX_COMM_SHARE,
    compare_bench: str | None = None,
    accumulation_schedule=None,
    block_size: int | None = None,
    num_train_epochs: int = 1,
    fsdp: bool = False,
    model_preset: str | None = None,
    vocab_size: int = 384,
    num_parameters: int | None = None,
    num_layers: int | None = None,
    mixed_precision: str = "no",
    gpu_memory_GB: float | None = None,
    free_memory_GB: float | None = None,
    parallelism_config_dp_replicate_size: int | None = None,
    inter_node_busbw_GBps: float | None = None,
) -> PlanReport:
    """All of ``accum-kit plan`` from keyword arguments named like its flags.

    With ``target_batch_size``, ``per_device_train_batch_size`` is the largest
    per-device batch that fits and K is solved for (so K must not be given).
    Without it, K = ``gradient_accumulation_steps``, else
    ``$ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, else 4 (the rule of
    :func:`accum_kit.core.settings.resolve_accumulation_steps`, the same as ``train``).
    ``lr_scaling=None`` reports all three rules. ``num_processes=None`` is 1,
    or with ``from_profile`` the profile's world size. ``from_profile`` adds
    the what-if section (:func:`accum_kit.planning.whatif.make_whatif`, which
    documents the other what-if keywords), its arithmetic shown for this K.
    ``accumulation_schedule`` (``{step: K}``, checked) sets K to its K at step 0
    and adds one row per phase: K, examples (and with ``block_size`` input
    tokens) per step, steps, and with ``num_examples`` micro-batches and epochs
    over ``num_train_epochs`` epochs (:func:`accum_kit.core.accumulation_schedule.schedule_phases`).
    With ``from_profile``, ``per_device_train_batch_size`` and K default to the
    profiled run's (:func:`accum_kit.planning.measured_profile.settings_from_profile`);
    without it, ``per_device_train_batch_size`` is required.
    ``fsdp`` replaces the what-if section with the FSDP2 policy plan
    (:func:`accum_kit.planning.fsdp_plan.make_fsdp_plan`, which documents its keywords;
    ``from_profile`` is then an FSDP2 profile and ``compare_bench`` an FSDP2 bench.json).

    Raises:
        UsageError: bad or inconsistent values; the message names the flag.
    """
    check_target_flags(target_batch_size, gradient_accumulation_steps)
    check_schedule_flags(accumulation_schedule, gradient_accumulation_steps, target_batch_size)
    notes, k_from_profile = (), None
    if from_profile is not None:
        per_device_train_batch_size, k, note = settings_from_profile(
            from_profile, per_device_train_batch_size, gradient_accumulation_steps,
            take_k=target_batch_size is None and accumulation_schedule is None)
        k_from_profile = k if gradient_accumulation_steps is None else None
        notes = (note,) if note else ()
    check_batch_size_given(per_device_train_batch_size)
    if accumulation_schedule is not None:
        gradient_accumulation_steps = accumulation_schedule[0]
    section = SECTIONS[bool(fsdp)]
    check_whatif_flags(from_profile, num_machines, num_processes, interconnect, busbw_GBps, accumulation_steps,
                       max_comm_share, compare_bench, needs_profile=section.needs_profile,
                       replicate_size=parallelism_config_dp_replicate_size)
    if num_processes is None:
        num_processes = load_profile(from_profile, section.collectives).world_size if from_profile is not None else 1
    if target_batch_size is not None:
        solution = solve_accumulation_steps(target_batch_size, per_device_train_batch_size, num_processes)
        B, K = solution.per_device_train_batch_size, solution.gradient_accumulation_steps
    else:
        solution, B = None, per_device_train_batch_size
        # a K the profile recorded already followed the rule when that run started
        K = k_from_profile or resolve_accumulation_steps(gradient_accumulation_steps)
    batch = plan_batch(B, K, num_processes, num_examples, drop_last=drop_last)

    check_learning_rate_flags(base_learning_rate, base_batch_size, lr_scaling)
    rates: tuple[LearningRateScaling, ...] = ()
    if base_learning_rate is not None:
        rules = LR_RULES if lr_scaling is None else (lr_scaling,)
        rates = tuple(
            scale_learning_rate(base_learning_rate, base_batch_size, batch.effective_batch_size, rule,
                                steps_per_epoch=batch.optimizer_steps_per_epoch)
            for rule in rules
        )
    kw = dict(locals())  # the flags' values, with K, B and num_processes as resolved above
    built = section.make(kw)
    if built is not None and compare_bench is not None:
        built = section.compare(built, compare_bench, kw)
    phases = ()
    if accumulation_schedule is not None:
        phases = tuple(schedule_phases(accumulation_schedule, B, num_processes, block_size=block_size,
                                       micro_batches_per_epoch=batch.micro_batches_per_process,
                                       num_train_epochs=num_train_epochs))
    return PlanReport(batch, solution, rates, schedule=phases, notes=notes, **{section.field: built})


def _g(x: float) -> str:
    return f"{x:.6g}"


def _indent(table: str) -> str:
    return "\n".join(f"  {line}" for line in table.splitlines())


def _solution_lines(s: AccumulationSolution) -> list[str]:
    lines = [
        f"Solve: target batch {s.target_batch_size} with per-device batch <= {s.max_per_device_train_batch_size} "
        f"on {s.num_processes} processes",
        f"  --per_device_train_batch_size {s.per_device_train_batch_size} "
        f"--gradient_accumulation_steps {s.gradient_accumulation_steps}   "
        f"({s.per_device_train_batch_size} x {s.gradient_accumulation_steps} x {s.num_processes} = {s.target_batch_size})",
    ]
    if s.note:
        lines.append(f"  note: {s.note}")
    return lines + [""]


def _batch_lines(b: BatchPlan) -> list[str]:
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
    lines = [f"Batch plan (Accelerate DataLoader, {mode})",
             _indent(tabulate(rows, tablefmt="plain", disable_numparse=True))]
    if b.num_examples is None:
        lines.append(f"  note: the last optimizer step of an epoch sees (micro-batches per process mod {K}) "
                     "micro-batches when that is not 0; pass --num_examples to compute it")
    elif b.last_step_is_partial:
        lines.append(f"  note: the last optimizer step sees fewer than K={K} micro-batches (Accelerate syncs at the end "
                     "of the dataloader); accum_kit's tokens normalisation averages over what it holds, while a "
                     f"plain loss / K scales that step's gradient by {b.last_step_micro_batches}/{K}")
    return lines


def _learning_rate_lines(rates: tuple[LearningRateScaling, ...]) -> list[str]:
    first = rates[0]
    lines = ["", f"Learning rate: base {_g(first.base_learning_rate)} at batch {first.base_batch_size} -> "
                 f"batch {first.batch_size} (k = {_g(first.batch_ratio)})"]
    table = [(r.rule, _g(r.multiplier), _g(r.learning_rate), r.source) for r in rates]
    lines.append(_indent(tabulate(table, headers=("rule", "multiplier", "learning rate", "source"),
                                  tablefmt="plain", disable_numparse=True)))
    for r in rates:
        if r.warmup_suggested:
            steps = f" = {r.warmup_steps} optimizer steps" if r.warmup_steps else ""
            lines.append(
                f"  warmup ({r.rule}): multiplier {_g(r.multiplier)} > {_g(WARMUP_MULTIPLIER_THRESHOLD)}: ramp the "
                f"learning rate linearly from {_g(r.base_learning_rate)} to {_g(r.learning_rate)} over "
                f"{r.warmup_epochs} epochs{steps} ({WARMUP_SOURCE})"
            )
    if not any(r.warmup_suggested for r in rates):
        lines.append(f"  warmup: not suggested (rule: when a multiplier exceeds "
                     f"{_g(WARMUP_MULTIPLIER_THRESHOLD)}, warm up over {WARMUP_EPOCHS} epochs; {WARMUP_SOURCE})")
    return lines


def _schedule_lines(phases: tuple[SchedulePhase, ...]) -> list[str]:
    known = phases[0].micro_batches_per_process is not None
    tokens = phases[0].tokens_per_step is not None
    headers = ["steps done", "K", "examples/step", *(["tokens/step"] if tokens else []), "optimizer steps",
               *(["micro-batches/process", "epochs"] if known else [])]
    rows = []
    for p in phases:
        span = f"{p.start_step}-{p.end_step}" if p.end_step is not None else f"{p.start_step}-"
        rows.append([span, p.gradient_accumulation_steps, p.examples_per_step,
                     *([p.tokens_per_step] if tokens else []), p.steps if p.steps is not None else "to the end",
                     *([p.micro_batches_per_process, f"{p.epochs:.3g}"] if known else [])])
    scope = (f"{sum(p.epochs for p in phases):.3g} epoch(s) of --num_examples; an epoch's last window may be partial" if known
             else "pass --num_examples for the steps of the last phase and the epochs")
    lines = ["", f"Accumulation schedule (the batch plan above is for the K at step 0; K changes at window "
                 f"boundaries; {scope})",
             _indent(tabulate(rows, headers=headers, tablefmt="plain", disable_numparse=True))]
    if not tokens:
        lines.append("  note: examples only; pass --block_size for tokens per step")
    return lines


def format_plan(report: PlanReport) -> str:
    """The text ``accum-kit plan`` prints: the solution (with a target), the batch
    plan as a two-column table, the learning-rate rules as a table (with a base rate) and
    the what-if predictions (with a profile)."""
    lines = _solution_lines(report.solution) if report.solution is not None else []
    lines += _batch_lines(report.batch)
    lines += [f"  note: {n}" for n in report.notes]
    if report.schedule:
        lines += _schedule_lines(report.schedule)
    if report.learning_rates:
        lines += _learning_rate_lines(report.learning_rates)
    for section in SECTIONS.values():
        built = getattr(report, section.field)
        lines += section.lines(built) if built is not None else []
    return "\n".join(lines)
