"""Where an FSDP2 policy's step time goes, part by part: the measured side of the profiler's estimate.

The profiler estimates what ``no_sync`` saves against syncing every
micro-batch from one run's records (:mod:`accum_kit.profiler.sharded`). The
bench runs both, so it can also split the measured difference: each window's
step time into the forward passes, the post-backward hooks (FSDP2's
reduction path), the rest of the backwards (autograd; of which its
accumulation into the unsharded gradients, where timed), the optimizer step
and what is left (loading, zeroing, the loop). Means over windows, so the
parts add up to the mean step time; the difference of two policies' parts
says which of the estimate's terms the measured saving sits in.
"""

from __future__ import annotations

from collections import defaultdict

from ..profiler import ProfileRecords

#: The parts, in the order they are printed.
PARTS = ("forward", "hooks", "autograd", "accumulation", "optimizer", "rest", "step")


def window_parts(records: ProfileRecords) -> dict[str, float] | None:
    """Mean seconds per window of each of :data:`PARTS`, from one selection of a profiler's raw records.

    ``autograd``: the backwards minus their post-backward hooks (``accumulation`` is part of it);
    ``accumulation``: autograd's timed add into the unsharded gradients (0 where not timed); ``rest``: the
    step minus forwards, backwards and optimizer. None without a whole window in ``records``.
    """
    hooks: dict = defaultdict(float)
    for p in records.post_backwards:
        hooks[(p.tag, p.micro_batch)] += p.seconds
    by_window: dict = defaultdict(list)
    for m in records.micro_batches:
        by_window[(m.tag, m.step)].append(m)
    rows = []
    for s in records.steps:
        mbs = by_window.get((s.tag, s.step))
        if not mbs:
            continue
        fwd = sum(m.forward_seconds for m in mbs)
        bwd = sum(m.backward_seconds for m in mbs)
        pb = sum(hooks[(m.tag, m.micro_batch)] for m in mbs)
        rows.append({"forward": fwd, "hooks": pb, "autograd": bwd - pb,
                     "accumulation": sum(m.accumulate_seconds or 0.0 for m in mbs),
                     "optimizer": s.optimizer_seconds, "rest": s.step_seconds - fwd - bwd - s.optimizer_seconds,
                     "step": s.step_seconds})
    if not rows:
        return None
    return {k: sum(r[k] for r in rows) / len(rows) for k in PARTS}


def saving_parts(base: dict | None, policy: dict | None) -> dict[str, float] | None:
    """``base`` minus ``policy`` per part (seconds per step; positive: the policy spends less there)."""
    if not base or not policy:
        return None
    return {k: base[k] - policy[k] for k in PARTS}


def format_parts(parts: dict[str, float]) -> str:
    """One line: each part's seconds saved per step."""
    return ", ".join(f"{k} {parts[k]:+.3f}" for k in PARTS)
