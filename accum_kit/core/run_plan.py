"""The run plan: K (or its schedule), the accumulation policy and the engine, resolved once per run.

:func:`accum_kit.build_accelerator` resolves them from its arguments and the
launch (:func:`accum_kit.core.settings.resolve_accumulation_steps`,
:func:`accum_kit.engines.policies.resolve_policy`,
:func:`accum_kit.engines.requested_engine`) into one :class:`RunPlan`, kept
on the Accelerator as ``accelerator.run_plan``. The loop, the train job and
the tools read it; nothing resolves them again. What changes on purpose
during a run changes through the plan's own methods, which also keep
Accelerate's copy (its gradient-accumulation plugin, which ``accumulate()``
reads) in step: the K schedule and the bench's K sweep
(:meth:`RunPlan.set_accumulation_steps`), the profiler's A/B switch, DDP's
static-graph first sync and the bench's policy sweep (:meth:`RunPlan.use_policy`).
"""

from __future__ import annotations

import contextlib

from .. import checks


class RunPlan:
    """K, the accumulation policy and the engine of one run.

    Args:
        engine: the run's :class:`accum_kit.engines.base.Engine`.
        policy: the policy asked for (an :class:`accum_kit.engines.policies.AccumulationPolicy`);
            the engine may restate it (DeepSpeed: the ZeRO stage, ``zero2``...).
        accumulation_steps: K, micro-batches per window per process, at the start of the run.
        schedule: ``{optimizer step: K}`` (batch-size warm-up), or None for a constant K.
        gradient_checkpointing: activation checkpointing on (one checkpoint per transformer block, applied in
            ``accelerator.prepare``; :mod:`accum_kit.engines.activation_checkpointing`).
        gradient_checkpointing_kwargs: the ``torch.utils.checkpoint.checkpoint`` arguments in force
            (``{}`` when off; ``{"use_reentrant": False, ...}`` when on), as the engine resolved them.

    Attributes:
        engine: as given.
        requested_policy: the run's policy as the engine states it and summaries record it.
        first_accumulation_steps: K of the first window.
        schedule: the checked schedule, or None.
        accelerator: the bound Accelerator (None before :meth:`bind`).
        gradient_checkpointing, gradient_checkpointing_kwargs: as given (``bool``, ``dict``).
    """

    def __init__(self, engine, policy, accumulation_steps: int, schedule: dict | None = None, *,
                 gradient_checkpointing: bool = False, gradient_checkpointing_kwargs: dict | None = None):
        checks.at_least("--gradient_accumulation_steps", accumulation_steps)
        self.engine = engine
        self.requested_policy = engine.run_policy(policy)
        self._policy = self.requested_policy  # the no-sync flavour in force (the A/B switch may add sync_each_batch)
        self.first_accumulation_steps = int(accumulation_steps)
        self.accelerator = None
        self.gradient_checkpointing = bool(gradient_checkpointing)
        self.gradient_checkpointing_kwargs = dict(gradient_checkpointing_kwargs or {})
        self.schedule = self.checked_schedule(schedule)
        if self.schedule is not None:
            self.first_accumulation_steps = self.schedule[0]

    def __repr__(self) -> str:
        return (f"RunPlan(engine={self.engine.label}, K={self.first_accumulation_steps}, "
                f"policy={self.requested_policy.name}, schedule={self.schedule}, "
                f"gradient_checkpointing={self.gradient_checkpointing})")

    # ---- binding --------------------------------------------------------------------------
    def bind(self, accelerator) -> "RunPlan":
        """Keep the plan on ``accelerator`` (``accelerator.run_plan``)."""
        self.accelerator = accelerator
        accelerator.run_plan = self
        return self

    # ---- K ---------------------------------------------------------------------------------
    @property
    def accumulation_steps(self) -> int:
        """K of the window being run (Accelerate's live value, which ``accumulate()`` follows)."""
        return self.accelerator.gradient_accumulation_steps

    def set_accumulation_steps(self, k: int) -> None:
        """Change K for the windows that follow; call between windows only (the loop does, at boundaries).

        Raises:
            UsageError: K below 1.
        """
        from ..compat import set_accumulation_steps

        checks.at_least("--gradient_accumulation_steps", k)
        set_accumulation_steps(self.accelerator, int(k))

    def checked_schedule(self, schedule: dict | None) -> dict | None:
        """``schedule`` (``{step: K}``, or None) checked, for this run's engine; returned in its checked form.

        Raises:
            UsageError: an invalid schedule (:func:`accum_kit.core.accumulation_schedule.check_accumulation_schedule`),
                or one the engine cannot follow (DeepSpeed: K cannot change during a run).
        """
        from .accumulation_schedule import check_accumulation_schedule

        if schedule is None:
            return None
        checked = check_accumulation_schedule(schedule)
        self.engine.check_schedule(checked)
        return checked

    # ---- the policy ------------------------------------------------------------------------
    @property
    def policy(self):
        """The policy in force now: ``sync_each_batch`` while Accelerate's switch is on, else the run's no-sync
        flavour (``no_sync`` when the run itself syncs each batch and the A/B switch turned that off)."""
        from ..compat import sync_each_batch
        from ..engines.policies import POLICIES

        if self.accelerator is None:
            return self._policy
        if sync_each_batch(self.accelerator, distributed_only=False):
            return POLICIES["sync_each_batch"] if not self._policy.sync_each_batch else self._policy
        return POLICIES["no_sync"] if self._policy.sync_each_batch else self._policy

    def use_policy(self, name: str) -> str:
        """Put policy ``name`` in force for the windows that follow; returns the name in force before.

        Call between windows only. ``sync_each_batch`` turns Accelerate's
        switch on and keeps the run's no-sync flavour for when it is turned
        off again; any other name sets that flavour too.

        Raises:
            UsageError: an unknown policy, or one the engine cannot apply.
        """
        from ..compat import set_sync_each_batch

        before = self.policy.name
        policy = self.requested_policy if name == self.requested_policy.name else self.engine.resolve_policy(name)
        if not policy.sync_each_batch:
            self._policy = policy
        set_sync_each_batch(self.accelerator, policy.sync_each_batch)
        return before

    @contextlib.contextmanager
    def policy_in_force(self, name: str):
        """Run a block with policy ``name`` in force, then put the previous one back."""
        before = self.use_policy(name)
        try:
            yield
        finally:
            self.use_policy(before)

    # ---- what the loop asks --------------------------------------------------------------------
    def reduces_each_micro_batch(self) -> bool:
        """Whether every micro-batch's backward reduces gradients under the policy in force."""
        return self.engine.reduces_each_micro_batch(self.accelerator, self.policy)

    def no_sync(self, model, base_no_sync):
        """The engine's ``no_sync`` context for ``model`` under the policy in force."""
        return self.engine.no_sync(self.accelerator, model, self.policy, base_no_sync)


def run_plan_of(accelerator) -> RunPlan:
    """The accelerator's :class:`RunPlan`; for an Accelerator not built by :func:`accum_kit.build_accelerator`,
    one made from its state (engine inferred, K from its gradient state, policy from its ``sync_each_batch``), kept on it."""
    plan = getattr(accelerator, "run_plan", None)
    if plan is not None:
        return plan
    from ..compat import sync_each_batch
    from ..engines import infer_engine
    from ..engines.policies import resolve_policy

    plan = RunPlan(infer_engine(accelerator), resolve_policy(None, sync_each_batch(accelerator)),
                   accelerator.gradient_accumulation_steps)
    return plan.bind(accelerator)
