"""Range and choice checks for flags and keyword arguments, each rule written once.

Every check raises :class:`accum_kit.errors.UsageError` naming the flag, the
problem and the fix, so the command line prints ``error: --flag: problem. Fix: ...``
and exits 2. None of them imports torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

from .errors import UsageError


def at_least(flag: str, value, minimum: int = 1, fix: str | None = None) -> None:
    """Require an integer ``value >= minimum``.

    Raises:
        UsageError: ``value`` is not an integer (bools are refused too) or is below ``minimum``.
    """
    if minimum == 1:
        fix = fix or "pass a positive integer"
    else:
        fix = fix or f"pass {minimum} or a larger integer"
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(flag, f"must be an integer (got {value!r})", fix)
    if value < minimum:
        raise UsageError(flag, f"must be >= {minimum} (got {value})", fix)


def positive(flag: str, value, fix: str | None = None) -> None:
    """Require a finite number ``> 0`` (int or float).

    Raises:
        UsageError: not a number, not finite, or ``<= 0``.
    """
    fix = fix or "pass a positive number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(flag, f"must be a number (got {value!r})", fix)
    if not math.isfinite(value) or value <= 0:
        raise UsageError(flag, f"must be a finite number > 0 (got {value})", fix)


def non_negative(flag: str, value, fix: str | None = None) -> None:
    """Require a finite number ``>= 0``.

    Raises:
        UsageError: not a number, not finite, or negative.
    """
    fix = fix or "pass 0 or a positive number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(flag, f"must be a number (got {value!r})", fix)
    if not math.isfinite(value) or value < 0:
        raise UsageError(flag, f"must be >= 0 (got {value})", fix)


def one_of(flag: str, value, choices: Iterable) -> None:
    """Require ``value in choices``.

    Raises:
        UsageError: an unknown value; the fix lists the choices.
    """
    choices = tuple(choices)
    if value not in choices:
        raise UsageError(flag, f"unknown value {value!r}", f"use one of {list(choices)}")


def distinct_choices(flag: str, values: list, choices: Iterable) -> None:
    """Require a non-empty list of known, distinct values (for ``nargs="+"`` flags).

    Raises:
        UsageError: empty list, an unknown value, or a repeated one.
    """
    choices = tuple(choices)
    if not values:
        raise UsageError(flag, "no value given", f"pass one or more of {list(choices)}")
    for v in values:
        one_of(flag, v, choices)
    if len(set(values)) != len(values):
        raise UsageError(flag, f"repeated value in {values}", "give each value once")


def json_file(flag: str, path, fix: str):
    """The parsed contents of the JSON file ``path`` given to ``flag``.

    Raises:
        UsageError: the file is missing, unreadable or not JSON (the fix says what to pass).
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(flag, f"no such file: {path}", fix)
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(flag, f"{path} is not readable JSON ({e})", fix) from None
