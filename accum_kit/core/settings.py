"""The one default-K rule, shared by every entry point and free of torch.

``accum-kit train``, ``verify``, ``bench``, ``plan`` and
:func:`accum_kit.build_accelerator` all pick the gradient accumulation steps K
with :func:`resolve_accumulation_steps`: the flag, else
``$ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, else
:data:`DEFAULT_GRADIENT_ACCUMULATION_STEPS`. It lives here, not in
:mod:`accum_kit.launch` (which imports torch and accelerate), so that
``accum-kit plan`` applies the same rule without importing torch.
"""

from __future__ import annotations

import os

from .. import checks
from ..errors import UsageError

#: The environment variable Accelerate itself reads for K in ``Accelerator()``.
ENV_GRADIENT_ACCUMULATION_STEPS = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"

#: K when neither ``--gradient_accumulation_steps`` nor the environment gives one.
#: One rule for every entry point (train, verify, bench, plan, build_accelerator).
DEFAULT_GRADIENT_ACCUMULATION_STEPS = 4


def resolve_accumulation_steps(requested: int | None, default: int = DEFAULT_GRADIENT_ACCUMULATION_STEPS) -> int:
    """The gradient accumulation steps K to use.

    Args:
        requested: the script's ``--gradient_accumulation_steps`` value, or None
            when the flag was not given.
        default: K when neither the flag nor the environment gives one.

    Returns:
        ``requested`` if given, else the environment variable
        ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` (which Accelerate itself reads
        in ``Accelerator()``; ``accelerate launch --gradient_accumulation_steps``
        sets it only for DeepSpeed launches in accelerate 1.15), else ``default``
        (:data:`DEFAULT_GRADIENT_ACCUMULATION_STEPS`, 4).

    Raises:
        UsageError: K below 1, or the script flag and the launcher flag disagree.
    """
    env = os.environ.get(ENV_GRADIENT_ACCUMULATION_STEPS)
    env_steps = int(env) if env not in (None, "") else None
    if requested is not None and env_steps is not None and requested != env_steps:
        raise UsageError(
            "--gradient_accumulation_steps",
            f"the script got {requested} but `accelerate launch` got {env_steps}",
            "give it in one place only",
        )
    steps = requested if requested is not None else (env_steps if env_steps is not None else default)
    checks.at_least("--gradient_accumulation_steps", steps)
    return steps
