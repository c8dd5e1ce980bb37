"""DDP, FSDP2, HSDP or DeepSpeed ZeRO: every engine and policy from the one cost table (torch-free).

The three engines are three meshes of the same W processes on M machines,
``R`` replicas x ``S`` shards, so :func:`accum_kit.engines.costs.policy_costs`
prices all of them:

- DDP: ``R = W, S = 1`` (every process holds everything; one all-reduce of
  the gradient per synchronised backward, across all W processes);
- FSDP2: ``R = 1, S = W`` (sharded over all W; its reduce-scatters and
  all-gathers span the machines, so they run at the inter-node bandwidth,
  the slowest link of the ring);
- HSDP: ``R = M, S = W / M`` (sharded inside a machine, at the intra-node
  bandwidth; the all-reduce across replicas at the inter-node bandwidth);
- DeepSpeed ZeRO-1/2/3: partitioned over all W (``R = 1, S = W``), every
  collective over all W processes (:func:`accum_kit.engines.costs.zero_costs`;
  ZeRO-3's parameter all-gathers are not predicted, so its time is a floor).

The meshes, each engine's policies and which link each group crosses come
from the table too (:func:`accum_kit.engines.engine_layouts.engine_layouts`,
:func:`accum_kit.engines.engine_layouts.group_links`): nothing here branches on the
engine. Memory per process is the table's total: parameter shards + optimizer
state + gradients held + gathered parameters kept (activations left out),
compared with ``--gpu_memory_GB``. Time per step is the communication of
:func:`accum_kit.engines.costs.comm_seconds` (every collective exposed), or
with a profile the step-time model of :mod:`accum_kit.planning.step_time`.
The recommendation is the fastest (engine, policy) that fits, among those
whose communication is predicted in full (not a floor).
"""

from __future__ import annotations

from ..engines.bandwidth import GB
from ..engines.costs import PolicyCosts, policy_costs
from ..engines.engine_layouts import engine_layouts, group_links
from .interconnects import INTERCONNECTS
from .step_time import BusBandwidths, step_time


def shard_group_inside_machine(costs: PolicyCosts, machines: int) -> bool:
    """Whether the shard group of ``costs``' mesh stays inside one machine (HSDP with a replica per machine)."""
    return group_links(costs, machines)["shard"] == "intra"


def compare_engines(model, *, world: int, machines: int, K: int, element_bytes: tuple[int, int, int],
                    intra_GBps: float, inter_GBps: float | None, inter_source: str = "",
                    gpu_memory_GB: float | None = None, profile=None) -> dict:
    """Every (engine, policy) of W processes on M machines: memory per process, communication, step time.

    Args:
        model: :class:`accum_kit.engines.costs.ShardedModel`.
        world, machines: W (all machines) and M.
        K: micro-batches per window.
        element_bytes: (b_p, b_c, b_r).
        intra_GBps: bus bandwidth inside a machine, GB/s; inter_GBps: across machines (None: InfiniBand's peak).
        gpu_memory_GB: memory per process (1e9 bytes) for the fit; None: everything fits.
        profile: a :class:`accum_kit.planning.measured_profile.MeasuredProfile` for step times, or None.

    Returns:
        ``{"rows": [...], "recommended": {"engine", "policy"} | None, "intra_GBps", "inter_GBps",
        "inter_source"}``; each row has ``engine``, ``mesh`` (R, S), ``policy``, the link of each group,
        ``memory_bytes`` (total per process), ``fits``, ``comm`` (seconds by collective), ``step_seconds``
        and ``comm_is_floor``.
    """
    if inter_GBps is None:
        inter_GBps, inter_source = INTERCONNECTS["infiniband"][0], "InfiniBand NDR nominal peak (default)"
    bandwidth = {"intra": intra_GBps, "inter": inter_GBps}
    b_p, b_c, b_r = element_bytes
    rows = []
    for layout in engine_layouts(world, machines):
        R, S = layout.replicate_size, layout.shard_size
        for policy in layout.policies:
            c = policy_costs(policy, model, world_size=world, accumulation_steps=K, param_bytes=b_p,
                             compute_bytes=b_c, reduce_bytes=b_r, replicate_size=R)
            links = group_links(c, machines)
            prices = BusBandwidths(shard_GBps=bandwidth[links["shard"]], replicate_GBps=bandwidth[links["all_reduce"]])
            t = prices.seconds(c)
            memory = c.total_bytes
            step = (step_time(c, profile.compute_seconds, prices, accumulation_seconds=profile.accumulation_seconds,
                              other_seconds=profile.other_seconds).seconds if profile else None)
            rows.append({"engine": layout.engine, "mesh": [R, S], "policy": policy,
                         "shard_link": links["shard"] if S > 1 else None,
                         "replicate_link": links["all_reduce"] if c.all_reduce_calls else None,
                         "memory_bytes": memory,
                         "fits": None if gpu_memory_GB is None else memory <= gpu_memory_GB * GB,
                         "comm": t, "step_seconds": step, "comm_is_floor": c.comm_is_floor,
                         "reduce_scatter_calls": c.reduce_scatter_calls, "all_reduce_calls": c.all_reduce_calls,
                         "all_gather_calls": c.all_gather_calls})
    # a floor (ZeRO-3: its parameter all-gathers are not predicted) is never recommended
    fitting = [r for r in rows if r["fits"] is not False and not r["comm_is_floor"]]
    best = min(fitting, key=lambda r: (round(r["step_seconds"] or r["comm"]["total"], 12), r["memory_bytes"])) \
        if fitting else None
    return {"rows": rows, "recommended": {"engine": best["engine"], "policy": best["policy"]} if best else None,
            "intra_GBps": intra_GBps, "inter_GBps": inter_GBps, "inter_source": inter_source,
            "gpu_memory_GB": gpu_memory_GB}


def format_engines(cmp: dict, world: int, machines: int, K: int) -> list[str]:
    """Text lines: one row per (engine, policy), the recommendation, and how each link was priced."""
    from tabulate import tabulate

    def g(x):
        return "n/a" if x is None else f"{x:.4g}"

    best = cmp["recommended"] or {}
    table = [(r["engine"], f"{r['mesh'][0]}x{r['mesh'][1]}",
              r["policy"] + (" *" if (r["engine"], r["policy"]) == (best.get("engine"), best.get("policy")) else ""),
              g(r["memory_bytes"] / GB), {None: "n/a", True: "yes", False: "NO"}[r["fits"]],
              r["reduce_scatter_calls"], r["all_reduce_calls"], r["all_gather_calls"],
              g(r["comm"]["reduce_scatter"] + r["comm"]["all_gather"]), g(r["comm"]["all_reduce"]),
              g(r["comm"]["total"]), g(r["step_seconds"])) for r in cmp["rows"]]
    lines = ["", f"Engines on {machines} machine(s) x {world // machines} processes, K = {K} (one cost table; "
                 f"intra-node {g(cmp['intra_GBps'])} GB/s, inter-node {g(cmp['inter_GBps'])} GB/s "
                 f"({cmp['inter_source'] or 'given'}))"]
    lines += [f"  {line}" for line in tabulate(
        table, headers=("engine", "R x S", "policy", "memory GB/proc", "fits", "reduce-scatters", "all-reduces",
                        "all-gathers", "shard-group s", "all-reduce s", "comm s", "s/step"),
        tablefmt="simple", disable_numparse=True).splitlines()]
    lines.append("  recommended (fastest that fits): " + (f"{best['engine']} --accumulation_policy {best['policy']}"
                                                          if best else "none fits"))
    lines.append("  links: DDP's all-reduce, FSDP2's and ZeRO's collectives span the machines (inter-node "
                 "busbw, the ring's slowest link); HSDP shards inside a machine (intra-node) and all-reduces across "
                 "machines (inter-node). ZeRO-3's parameter all-gathers are not predicted (a floor). Memory: parameter shards + AdamW state + gradients held + gathered "
                 "parameters, activations left out" + ("" if cmp["gpu_memory_GB"] is not None else
                                                       "; no --gpu_memory_GB: everything listed as fitting"))
    return lines
