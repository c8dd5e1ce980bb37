"""Comparing a captured gradient with the oracle's, and the tolerance.

Gradients are per parameter tensor, same shapes as the parameters, in nats per
unit parameter. For each row and window: ``max_abs_error = max |g - o|``,
``rel_error = ||g - o||_2 / ||o||_2`` over all parameters, and
``tolerance_used = max |g - o| / (atol + rtol |o|)`` elementwise (the
``torch.allclose`` criterion, https://pytorch.org/docs/stable/generated/torch.allclose.html;
<= 1 passes). A row passes when every window passes and the gradients agree
across ranks (their norms within rtol). The default tolerance (rtol 1e-4,
atol 1e-6) is a float32 tolerance: the exact arithmetic lands around 1e-7
relative here, mean-of-means misses by percent.

Under autocast (``--mixed_precision bf16`` or ``fp16``) a per-element
relative bound is meaningless (elements near zero lose all relative
accuracy), so the criterion becomes normwise: ``tolerance_used = rel_error /
rtol`` per window, with ``rtol = sqrt(m) u`` (:func:`mixed_precision_rtol`):
``u`` the unit roundoff of the autocast dtype (bf16 2^-8, fp16 2^-11) and
``m = 64`` bf16/fp16 roundings a gradient element depends on (inputs and
outputs of the matmuls and elementwise ops on low-precision activations,
forward and backward, of a small GPT-2; accumulation over micro-batches,
processes and the window rescale stay fp32 and add O(2^-24)). Independent
rounding errors add in quadrature (Higham and Mary, "A New Approach to
Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019),
hence sqrt(m) u: 2^-5 ~ 3.1e-2 for bf16. Measured on the tiny preset: about
3e-3; mean-of-means misses by 6e-2 or more.

For the ``sum`` row the report gives the measured least-squares ratio
``<g, o> / <o, o>`` (1/W under DDP, see :mod:`accum_kit.verify.oracle`) and
the residual left after scaling by it (:func:`scaled_residual`).
"""

from __future__ import annotations

import math

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-6  # gradient units (nats per unit parameter) of a token-mean gradient

#: ``--mixed_precision`` values; unit roundoff 2^-p of the autocast dtype (p significant bits)
MIXED_PRECISIONS = ("no", "bf16", "fp16")
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
ROUNDINGS = 64  # m: low-precision roundings a gradient element depends on (see the module docstring)


def mixed_precision_rtol(mixed_precision: str) -> float | None:
    """Normwise relative tolerance ``sqrt(m) u`` of an autocast run; None for ``"no"`` (elementwise float32)."""
    u = UNIT_ROUNDOFF.get(mixed_precision)
    return None if u is None else math.sqrt(ROUNDINGS) * u


def compare_gradients(got: dict, want: dict, rtol: float, atol: float, normwise: bool = False) -> dict:
    """Errors of ``got`` against ``want`` (dicts name -> same-shape tensors), in float64.

    Returns:
        ``max_abs_error`` (max |g - o|), ``rel_error`` (||g - o|| / ||o|| over
        all parameters; inf when ||o|| = 0 and g differs), ``tolerance_used``
        (max |g - o| / (atol + rtol |o|), or ``rel_error / rtol`` when
        ``normwise``; <= 1 passes), ``dot`` (<g, o>), ``want_sq`` (||o||^2)
        and ``got_norm`` (||g||).
    """
    max_abs, used, err_sq, want_sq, got_sq, dot = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    for name, o in want.items():
        g = got[name].double()
        o = o.double()
        d = (g - o).abs()
        max_abs = max(max_abs, float(d.max()) if d.numel() else 0.0)
        used = max(used, float((d / (atol + rtol * o.abs())).max()) if d.numel() else 0.0)
        err_sq += float(d.pow(2).sum())
        want_sq += float(o.pow(2).sum())
        got_sq += float(g.pow(2).sum())
        dot += float((g * o).sum())
    rel = math.sqrt(err_sq / want_sq) if want_sq > 0 else (0.0 if err_sq == 0 else math.inf)
    return {
        "max_abs_error": max_abs,
        "rel_error": rel,
        "tolerance_used": rel / rtol if normwise else used,
        "dot": dot,
        "want_sq": want_sq,
        "got_norm": math.sqrt(got_sq),
    }


def scaled_residual(pairs, ratio: float) -> float:
    """``||g - ratio o|| / ||o||`` over all ``(got, want)`` pairs of gradient dicts (NaN when ||o|| = 0).

    With ``ratio`` the least-squares ``<g, o> / <o, o>``, a residual near 0
    means ``g`` is ``o`` scaled by ``ratio`` and nothing else.
    """
    num, den = 0.0, 0.0
    for got, want in pairs:
        for name, o in want.items():
            num += float((got[name].double() - ratio * o).pow(2).sum())
            den += float(o.pow(2).sum())
    return math.sqrt(num / den) if den > 0 else math.nan
