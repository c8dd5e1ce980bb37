"""Text of ``accum-kit plan --fsdp``: the formulas with the plan's numbers, and the table (torch-free).

:mod:`accum_kit.planning.fsdp_plan` computes the plan and calls :func:`arithmetic_lines`; this module
imports nothing of it (the plan's type only for type checkers), so the two form no import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..engines.bandwidth import GB
from .topology import format_engines

if TYPE_CHECKING:
    from .fsdp_plan import FSDPPlan


def _g(x: float) -> str:
    return f"{x:.4g}"


def arithmetic_lines(model, W, K, b, ag_bw, rs_bw, costs, rows, best, free, profile, ar_bw=None) -> dict:
    """The formulas with this plan's numbers: memory and seconds of the recommended policy and of sync_each_batch."""
    by = {r.policy: r for r in rows}
    out = {"P": f"P = P_f + P_0 = {model.layer_parameters} + {model.other_parameters} = {model.parameters} "
                f"({model.source})"}
    for name in dict.fromkeys([best.policy if best else None, "sync_each_batch"]):
        if name is None:
            continue
        c, r = costs[name], by[name]
        f = c.formulas
        S, R = c.shard_size, c.all_reduce_group_size
        lines = [f"gradients held: {f['gradients']} = {_g(c.gradient_bytes / GB)} GB",
                 f"gathered parameters kept: {f['gathered_parameters']} = {_g(c.gathered_parameter_bytes / GB)} GB",
                 f"fits: {_g(r.memory_needed_bytes / GB)} GB <= {_g(free / GB)} GB free: {r.fits}" if free is not None
                 else "fits: no memory given",
                 f"reduce-scatters: {f['reduce_scatter']} B -> {c.reduce_scatter_bytes:.6g} B x ({S}-1)/{S} / "
                 f"{_g(rs_bw)} GB/s = {_g(r.reduce_scatter_seconds)} s",
                 f"all-gathers: {f['all_gather']} B -> {c.all_gather_bytes:.6g} B x ({S}-1)/{S} / {_g(ag_bw)} GB/s "
                 f"= {_g(r.all_gather_seconds)} s"]
        if c.all_reduce_calls:
            lines.append(f"all-reduces across replicas: {f['all_reduce']} B -> {c.all_reduce_bytes:.6g} B x 2 "
                         f"({R}-1)/{R} / {_g(ar_bw)} GB/s = {_g(r.all_reduce_seconds)} s")
        lines.append(f"communication per step = {_g(r.reduce_scatter_seconds)} + {_g(r.all_gather_seconds)}"
                     + (f" + {_g(r.all_reduce_seconds)}" if c.all_reduce_calls else "") + f" = {_g(r.comm_seconds)} s")
        if profile is not None:
            held = c.held_gradient_adds  # the cost table's adds into a held unsharded gradient (K - 1 or 0)
            c, a, o = profile.compute_seconds, profile.accumulation_seconds, profile.other_seconds
            lines.append(f"step = K (c - a) + {'(K-1)' if held else '0 x'} a + comm + o = {K} x ({_g(c)} - {_g(a)}) + "
                         f"{held} x {_g(a)} + {_g(r.comm_seconds)} + {_g(o)} = {_g(r.step_seconds)} s")
        out[name] = lines
    return out


def format_fsdp_plan(p: "FSDPPlan") -> list[str]:
    """Text lines of the FSDP2 section: inputs, one row per policy, the recommendation and its arithmetic."""
    from tabulate import tabulate

    m, b = p.model, p.element_bytes
    lines = ["", f"FSDP2 accumulation policies ({p.num_processes} processes on {p.num_machines} machine(s), "
                 f"K = {p.gradient_accumulation_steps}, mixed precision {p.mixed_precision}: b_p {b['b_p']}, "
                 f"b_c {b['b_c']}, b_r {b['b_r']} bytes)",
             f"  model: P = {m['P']} (P_f = {m['P_f']} in {m['U_f']} layer units, P_0 = {m['P_0']} in {m['U_0']} "
             f"other units); {m['source']}",
             f"  bus bandwidth ({p.interconnect}): all-gather {_g(p.busbw_all_gather_GBps)} GB/s, reduce-scatter "
             f"{_g(p.busbw_reduce_scatter_GBps)} GB/s; {p.busbw_source}",
             *((f"  HSDP mesh: {p.replicate_size} replicas x {p.num_processes // p.replicate_size} shards; all-reduce "
                f"across replicas at {_g(p.busbw_all_reduce_GBps)} GB/s ({p.busbw_all_reduce_source})",)
               if p.replicate_size > 1 else ()),
             "  free memory per process: " + (f"{_g(p.free_memory_bytes / GB)} GB ({p.free_memory_source})"
                                              if p.free_memory_bytes is not None else p.free_memory_source)]
    if p.profile is not None:
        pr = p.profile
        lines.append(f"  profile {pr.path}: c = {_g(pr.compute_seconds)} s and accumulation a = "
                     f"{_g(pr.accumulation_seconds)} s per micro-batch, o = "
                     f"{_g(pr.other_seconds)} s per step (K_p = {pr.gradient_accumulation_steps}, "
                     f"{pr.world_size} processes)")
    hybrid = any(r.costs["all_reduce_calls"] for r in p.rows)  # a column only where something is all-reduced
    headers = ("policy", "grads held GB", "gathered GB", "fits", "reduce-scatters", *(("all-reduces",) if hybrid else ()),
               "all-gathers", "GB gathered", "comm s", "saved s vs sync_each", *(("s/step", "speedup") if p.profile else ()))
    table = []
    for r in p.rows:
        c = r.costs
        table.append((r.policy + (" *" if r.policy == p.recommended else ""), _g(c["gradient_bytes"] / GB),
                      _g(c["gathered_parameter_bytes"] / GB), {None: "n/a", True: "yes", False: "NO"}[r.fits],
                      c["reduce_scatter_calls"], *((c["all_reduce_calls"],) if hybrid else ()), c["all_gather_calls"],
                      _g(c["all_gather_bytes"] / GB),
                      _g(r.comm_seconds), _g(r.saved_seconds_vs_sync_each_batch),
                      *((_g(r.step_seconds), f"{r.speedup_vs_sync_each_batch:.3f}x") if p.profile else ())))
    lines += [f"  {line}" for line in tabulate(table, headers=headers, tablefmt="simple",
                                               disable_numparse=True).splitlines()]
    lines.append("  recommended (fastest that fits): "
                 + (f"--accumulation_policy {p.recommended}" if p.recommended else "none fits"))
    lines.append(f"  arithmetic: {p.arithmetic['P']}")
    for name, steps in p.arithmetic.items():
        if name == "P":
            continue
        lines.append(f"    {name}:")
        lines += [f"      {s}" for s in steps]
    lines += [f"  note: {n}" for n in p.notes]
    lines.append("  left out: overlap of collectives with compute (GPU; every collective is counted exposed), "
                 "per-call latency, FSDP2's padding of each parameter to a multiple of W, activations")
    if p.engines is not None:
        lines += format_engines(p.engines, p.num_processes, p.num_machines, p.gradient_accumulation_steps)
    return lines
