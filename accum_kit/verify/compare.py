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

For the ``sum`` row the report gives the measured least-squares ratio
``<g, o> / <o, o>`` (1/W under DDP, see :mod:`accum_kit.verify.oracle`) and
the residual left after scaling by it (:func:`scaled_residual`).
"""

from __future__ import annotations

import math

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-6  # gradient units (nats per unit parameter) of a token-mean gradient


def compare_gradients(got: dict, want: dict, rtol: float, atol: float) -> dict:
    """Errors of ``got`` against ``want`` (dicts name -> same-shape tensors), in float64.

    Returns:
        ``max_abs_error`` (max |g - o|), ``rel_error`` (||g - o|| / ||o|| over
        all parameters; inf when ||o|| = 0 and g differs), ``tolerance_used``
        (max |g - o| / (atol + rtol |o|); <= 1 passes), ``dot`` (<g, o>),
        ``want_sq`` (||o||^2) and ``got_norm`` (||g||).
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
    return {
        "max_abs_error": max_abs,
        "rel_error": math.sqrt(err_sq / want_sq) if want_sq > 0 else (0.0 if err_sq == 0 else math.inf),
        "tolerance_used": used,
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
