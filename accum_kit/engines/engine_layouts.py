"""The engines a cluster offers, as meshes of W processes on M machines, and which link each group of a mesh
crosses: what :mod:`accum_kit.planning.topology` and the memory plan price with
:func:`accum_kit.engines.costs.policy_costs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import DDP_POLICIES, ZERO_STAGES, PolicyCosts
from .policies import policies_for


@dataclass(frozen=True)
class EngineLayout:
    """One engine's mesh of W processes on M machines and the policies it runs.

    Attributes:
        engine: ``DDP``, ``FSDP2``, ``HSDP`` or ``DeepSpeed``.
        replicate_size: R; shard_size: S (R S = W).
        policies: what :func:`accum_kit.engines.costs.policy_costs` prices for it (accumulation policies or ZeRO
            stages).
    """

    engine: str
    replicate_size: int
    shard_size: int
    policies: tuple[str, ...]


def engine_layouts(world: int, machines: int) -> list[EngineLayout]:
    """Every engine accum-kit runs, as a mesh of W processes on M machines (ranks machine by machine).

    DDP: ``R = W, S = 1`` (its policies without FSDP2's); FSDP2: ``R = 1, S = W`` (four policies);
    HSDP: ``R = M, S = W / M``, only when M > 1 and S > 1 (five policies); DeepSpeed: ZeRO partitions
    over all W (``R = 1, S = W``; its stages :data:`accum_kit.engines.costs.ZERO_STAGES`; its all-reduces span all W).
    """
    layouts = [EngineLayout("DDP", world, 1, DDP_POLICIES),
               EngineLayout("FSDP2", 1, world, tuple(policies_for(False)))]
    if machines > 1 and world // machines > 1:
        layouts.append(EngineLayout("HSDP", machines, world // machines, tuple(policies_for(True))))
    layouts.append(EngineLayout("DeepSpeed", 1, world, ZERO_STAGES))
    return layouts


def group_links(costs: PolicyCosts, machines: int) -> dict:
    """Which link each group of ``costs``' mesh crosses when its W processes sit on M machines, ranks machine by
    machine: ``{"shard": "intra" | "inter", "all_reduce": "intra" | "inter"}``.

    The shard group is S consecutive ranks: it stays inside a machine when S <= W / M. The all-reduce group
    (R ranks S apart, or all W when R = 1) spans the machines whenever there are several. A ring runs at its
    slowest link, so a group that spans machines runs at the inter-node bus bandwidth.
    """
    S, W = costs.shard_size, costs.world_size
    shard = "intra" if machines == 1 or S <= W // machines else "inter"
    return {"shard": shard, "all_reduce": "inter" if machines > 1 else "intra"}
