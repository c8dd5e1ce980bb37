"""The Accelerator a ``verify`` run uses, its tolerances, and what compilation did (used by :mod:`.check`).

:func:`resolve_accelerator` builds one from verify's arguments, or checks that
the arguments agree with the caller's; :func:`resolve_tolerances` picks the
precision's tolerance; :class:`CompileRecord` counts what ``torch.compile``
did while the rows ran, for the report.
"""

from __future__ import annotations

from ..engines.compiling import CompileWatch, compile_settings, resolve_flags
from ..errors import UsageError
from ..launch import build_accelerator, resolve_accumulation_steps
from .compare import DEFAULT_ATOL, DEFAULT_RTOL, mixed_precision_rtol


def resolve_accelerator(accelerator, gradient_accumulation_steps: int | None, mixed_precision: str | None,
                        accumulation_policy: str | None, torch_compile: bool = False,
                        torch_compile_backend: str | None = None, torch_compile_mode: str | None = None,
                        gradient_checkpointing: bool = False, gradient_checkpointing_kwargs=None):
    """``(accelerator, K)``: build the Accelerator from the arguments, or check them against the given one.

    Built here, it compiles the model in ``prepare`` when a compile argument
    asks for it (:func:`accum_kit.build_accelerator`), with symbolic shapes
    from the first call (``dynamic=True``): verify's examples vary in length
    from micro-batch to micro-batch, and static shapes would compile again for
    the first new length. A given accelerator compiles (or not) as its own
    dynamo plugin says; the arguments must then agree with it.

    Raises:
        UsageError: an argument that differs from the given accelerator's
            (``mixed_precision``, ``accumulation_policy``,
            ``gradient_accumulation_steps``, ``torch_compile_backend``, ``gradient_checkpointing``), or an
            unknown / unavailable compile backend or mode (names the flag).
    """
    if accelerator is None:
        K = resolve_accumulation_steps(gradient_accumulation_steps)
        compiled = resolve_flags(torch_compile, torch_compile_backend, torch_compile_mode) is not None
        accelerator = build_accelerator(K, mixed_precision=mixed_precision or "no",
                                        accumulation_policy=accumulation_policy, torch_compile=torch_compile,
                                        torch_compile_backend=torch_compile_backend,
                                        torch_compile_mode=torch_compile_mode,
                                        torch_compile_dynamic=True if compiled else None,
                                        gradient_checkpointing=gradient_checkpointing,
                                        gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)
        return accelerator, K
    plan = getattr(accelerator, "run_plan", None)
    if gradient_checkpointing and not getattr(plan, "gradient_checkpointing", False):
        raise UsageError("gradient_checkpointing", "asked for, but the accelerator's run plan does not checkpoint",
                         "omit it, or build the accelerator with build_accelerator(..., gradient_checkpointing=True)")
    if mixed_precision is not None and mixed_precision != accelerator.mixed_precision:
        raise UsageError("mixed_precision", f"{mixed_precision} differs from the accelerator's "
                         f"{accelerator.mixed_precision}", "omit it or build the accelerator with it")
    own = getattr(getattr(accelerator, "accumulation_policy", None), "name", "no_sync")
    if accumulation_policy is not None and accumulation_policy != own:
        raise UsageError("accumulation_policy", f"{accumulation_policy} differs from the accelerator's {own}",
                         "omit it or build the accelerator with it")
    K = accelerator.gradient_accumulation_steps
    if gradient_accumulation_steps is not None and gradient_accumulation_steps != K:
        raise UsageError("gradient_accumulation_steps", f"{gradient_accumulation_steps} differs from the "
                         f"accelerator's {K}", "omit it or build the accelerator with the same K")
    _check_compile_agrees(accelerator, torch_compile, torch_compile_backend, torch_compile_mode)
    return accelerator, K


def _check_compile_agrees(accelerator, torch_compile: bool, backend: str | None, mode: str | None) -> None:
    """Refuse compile arguments that the given accelerator's dynamo plugin does not carry out."""
    wanted = resolve_flags(torch_compile, backend, mode, flags=("torch_compile_backend", "torch_compile_mode"))
    if wanted is None:
        return
    have = compile_settings(accelerator)
    if have is None:
        raise UsageError("torch_compile", "asked for, but the accelerator does not compile (no dynamo plugin)",
                         "omit it, or build the accelerator with build_accelerator(..., torch_compile=True)")
    if have["backend"] != wanted[0] or have["mode"] != (wanted[1] or "default"):
        raise UsageError("torch_compile_backend", f"backend {wanted[0]!r}, mode {wanted[1] or 'default'!r} differs "
                         f"from the accelerator's backend {have['backend']!r}, mode {have['mode']!r}",
                         "omit it or build the accelerator with the same backend and mode")


def resolve_tolerances(precision: str, rtol: float | None, atol: float | None) -> tuple[float, float, bool]:
    """``(rtol, atol, normwise)`` for the Accelerator's ``precision``; None takes the precision's default.

    float32 is compared elementwise (rtol 1e-4, atol 1e-6); under autocast
    (bf16 / fp16) normwise with ``rtol = sqrt(m) u`` and no atol
    (:func:`~accum_kit.verify.compare.mixed_precision_rtol`).
    """
    normwise = precision != "no"
    rtol = rtol if rtol is not None else (mixed_precision_rtol(precision) if normwise else DEFAULT_RTOL)
    atol = atol if atol is not None else (0.0 if normwise else DEFAULT_ATOL)
    return rtol, atol, normwise


class CompileRecord:
    """What ``torch.compile`` did while the rows ran, from torch's own compile callbacks; inert when not compiling.

    Start it before the first prepared forward and call :meth:`finish` after
    the last: it returns None without compilation, else the accelerator's
    compile settings (``backend``, ``mode``, ``regional``, ``dynamic``) with
    ``compiles``, ``graphs``, ``recompiles``, ``compile_seconds`` and
    ``recompile_reasons`` counted on this process
    (:class:`accum_kit.engines.compiling.CompileWatch`). Every row reuses the code
    compiled by the first; a recompile means a guard failed (its reason is
    torch's).
    """

    def __init__(self, accelerator):
        self.settings = compile_settings(accelerator)
        self._watch = CompileWatch(warmup_steps=0) if self.settings is not None else None

    def finish(self) -> dict | None:
        """The settings and counts (None without compilation); unregisters from torch's callbacks."""
        if self._watch is None:
            return None
        counts = self._watch.summary()
        self._watch.close()
        keep = ("compiles", "graphs", "recompiles", "compile_seconds", "recompile_reasons")
        return {**self.settings, **{k: counts[k] for k in keep}}
