"""Errors the toolkit raises for bad input, each naming the flag and the fix."""

from __future__ import annotations


class AccumKitError(Exception):
    """Base class of the toolkit's own errors."""


class UsageError(AccumKitError, ValueError):
    """Bad user input: a flag value, a file, a dataset that cannot work.

    Args:
        flag: the command-line flag (or keyword argument) at fault, e.g.
            ``"--gradient_accumulation_steps"``.
        problem: what is wrong, e.g. ``"must be >= 1 (got 0)"``.
        fix: what to do instead, e.g. ``"pass a positive integer"``.

    The command-line entry points print ``str(error)`` and exit with code 2.
    """

    def __init__(self, flag: str, problem: str, fix: str):
        self.flag, self.problem, self.fix = flag, problem, fix
        super().__init__(f"{flag}: {problem}. Fix: {fix}.")


class ProcessCountError(AccumKitError, RuntimeError):
    """The launcher started N processes but the Accelerator sees a different number.

    Raised by :func:`accum_kit.launch.check_process_count`; without it, a
    multi-process launch on a machine without a GPU silently trains every
    process alone (see :mod:`accum_kit.launch`).
    """
