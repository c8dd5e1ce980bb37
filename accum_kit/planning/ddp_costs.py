"""DDP read off the one cost table of :mod:`accum_kit.engines.costs` (torch-free).

DDP is the table's row with a shard group of one process: every process
holds the whole model (``S = 1``) and all ``W`` processes are replicas
(``R = W``), so no reduce-scatter or all-gather runs and every synchronised
backward all-reduces the gradients across the replicas. Treating the
gradient buffer as one unit, the table's all-reduce calls per window are the
window's synchronised backwards ("syncs"): ``K`` with ``sync_each_batch``,
``1`` with ``no_sync``. DDP splits that buffer into buckets
(``bucket_cap_mb``); a bucket is not a unit of the table, so counts here are
per sync, and bytes per sync are the whole gradient.

The what-if planner (:mod:`accum_kit.planning.whatif`) and the bench's
ideal speedup (:mod:`accum_kit.bench.report`) take their sync counts from
here and the all-reduce seconds from the table's own
:func:`~accum_kit.engines.costs.all_reduce_seconds`, so that DDP, FSDP2,
HSDP and ZeRO are priced from the same formulas.
"""

from __future__ import annotations

from ..engines.costs import PolicyCosts, ShardedModel, policy_costs

#: The accumulation policies that exist under DDP (the FSDP2 ones keep or free gathered parameters, which DDP never has).
DDP_POLICIES = ("sync_each_batch", "no_sync")


def ddp_costs(policy: str, *, world_size: int, accumulation_steps: int, gradient_bytes: float,
              reduce_bytes: int = 4) -> PolicyCosts:
    """The table's costs of ``policy`` under DDP: R = W replicas of S = 1 process.

    Args:
        policy: ``sync_each_batch`` or ``no_sync``.
        world_size: W, processes (at least 1; with 1 nothing is all-reduced).
        accumulation_steps: K, micro-batches per window.
        gradient_bytes: bytes all-reduced per synchronised backward (the
            whole gradient, all buckets together).
        reduce_bytes: bytes per gradient element (4: fp32).

    Returns:
        :class:`~accum_kit.engines.costs.PolicyCosts` whose ``all_reduce_calls``
        are syncs per window and ``all_reduce_bytes`` the bytes they carry.

    Raises:
        UsageError: a policy DDP does not have, or W / K below 1.
    """
    from ..errors import UsageError

    if policy not in DDP_POLICIES:
        raise UsageError("--accumulation_policy", f"{policy!r} is not a DDP policy", f"use one of {list(DDP_POLICIES)}")
    elements = gradient_bytes / reduce_bytes
    model = ShardedModel((), (elements,), "DDP: the whole gradient, all-reduced once per synchronised backward")
    return policy_costs(policy, model, world_size=world_size, accumulation_steps=accumulation_steps,
                        param_bytes=reduce_bytes, replicate_size=world_size)


def syncs_per_window(policy: str, accumulation_steps: int) -> int:
    """Synchronised backwards per window of K micro-batches under DDP: the table's all-reduce calls (K or 1)."""
    return ddp_costs(policy, world_size=2, accumulation_steps=accumulation_steps, gradient_bytes=4).all_reduce_calls
