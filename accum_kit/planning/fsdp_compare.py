"""Predicted vs measured under FSDP2: the plan's step time per K and policy next to an FSDP2 ``bench.json``.

``accum-kit bench`` under ``accelerate_configs/cpu_fsdp.yaml`` measures every
(K, policy) on the machine it runs on. Fed a profile of the same preset and
micro-batch on the same machine and process count (bus bandwidths
``measured``), the step-time model (:mod:`accum_kit.planning.step_time`, as
``plan --fsdp`` uses it) should predict those step times: ``predicted / measured`` per cell says how far to trust it, next
to the bench's own noise floor (how much one cell's per-pass medians spread).
Torch-free.
"""

from __future__ import annotations

from tabulate import tabulate

from .. import checks
from ..engines.costs import policy_costs
from ..engines.model_units import ShardedModel
from ..errors import UsageError
from ..stats import median
from .step_time import BusBandwidths, step_time

BENCH_FIX = ("pass the bench.json of `accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml -m accum_kit "
             "bench ...`")
#: The schema the sharded bench (FSDP2, HSDP) writes into its bench.json.
SHARDED_BENCH_SCHEMA = "accum_kit.bench.fsdp/1"


def compare_fsdp_bench(path: str, plan) -> dict:
    """Per (K, policy) of the bench's preset: predicted and measured seconds per step, their ratio, and speedups.

    Args:
        path: an FSDP2 ``bench.json`` (schema ``accum_kit.bench.fsdp/1``).
        plan: the :class:`accum_kit.planning.fsdp_plan.FSDPPlan` (with a profile: c and o come from it,
            the bandwidths are the plan's).

    Returns keys ``bench``, ``preset``, ``rows`` (``K``, ``policy``, ``predicted_s``, ``measured_s``,
    ``predicted_over_measured``, ``speedup_predicted``, ``speedup_measured`` with its interval),
    ``max_abs_relative_error``, ``median_abs_relative_error``, ``noise_floor`` (the bench's) and ``notes``.

    Raises:
        UsageError (``--compare_bench``): no profile in the plan, a missing or unreadable file, not an
            FSDP2 bench, no matching preset.
    """
    if plan.profile is None:
        raise UsageError("--compare_bench", "predicting step times needs the compute per micro-batch",
                         "pass --from_profile with an FSDP2 train_summary.json too")
    bench = checks.json_file("--compare_bench", path, BENCH_FIX)
    if not isinstance(bench, dict) or bench.get("schema") != SHARDED_BENCH_SCHEMA or not bench.get("rows"):
        raise UsageError("--compare_bench", f"{path} is not an FSDP2 bench.json with rows", BENCH_FIX)
    presets = list(bench.get("presets", {}))
    name = (plan.profile.model or "").removeprefix("preset:")
    preset = name if name in presets else (presets[0] if len(presets) == 1 else None)
    if preset is None:
        raise UsageError("--compare_bench", f"{path} holds presets {presets}, none of them the profile's model "
                         f"{plan.profile.model!r}", "bench the profiled preset, e.g. --model_presets small")
    info = bench["presets"][preset]
    layout = ShardedModel(tuple(info["units"]["resharded"]), tuple(info["units"]["kept"]))
    b = info["element_bytes"]
    W = bench.get("machine", {}).get("world_size") or plan.num_processes
    R = (info.get("mesh") or {}).get("dp_replicate_size", 1)
    if R > 1 and not plan.busbw_all_reduce_GBps:
        raise UsageError("--compare_bench", f"{path} is an HSDP bench ({R} replicas) and the plan has no "
                         "all-reduce bandwidth across replicas", "plan with --from_profile of an HSDP run or "
                         "--inter_node_busbw_GBps")
    rows, errors = [], []
    cells = [r for r in bench["rows"] if r["preset"] == preset]
    predicted = {}
    links = BusBandwidths(shard_GBps=plan.busbw_reduce_scatter_GBps, all_gather_GBps=plan.busbw_all_gather_GBps,
                          replicate_GBps=plan.busbw_all_reduce_GBps)
    p = plan.profile
    for r in cells:
        cost = policy_costs(r["policy"], layout, world_size=W, accumulation_steps=r["K"], param_bytes=b["b_p"],
                            compute_bytes=b["b_c"], reduce_bytes=b["b_r"], replicate_size=R)
        predicted[(r["K"], r["policy"])] = step_time(cost, p.compute_seconds, links, other_seconds=p.other_seconds,
                                                     accumulation_seconds=p.accumulation_seconds).seconds
    for r in cells:
        pred, meas = predicted[(r["K"], r["policy"])], r["step_s_median"]
        base = predicted.get((r["K"], "sync_each_batch"))
        ratio = pred / meas if meas else None
        if ratio is not None:
            errors.append(abs(ratio - 1))
        rows.append({"K": r["K"], "policy": r["policy"], "predicted_s": pred, "measured_s": meas,
                     "predicted_over_measured": ratio, "speedup_predicted": base / pred if base else None,
                     "speedup_measured": r.get("speedup_vs_sync_each_batch"),
                     "speedup_ci": [r.get("speedup_ci_low"), r.get("speedup_ci_high")]})
    notes = []
    if W != plan.profile.world_size:
        notes.append(f"the bench ran on {W} processes, the profile on {plan.profile.world_size}")
    if info.get("emulated_inter_node_GBps"):
        notes.append(f"the bench EMULATED its inter-node link at {info['emulated_inter_node_GBps']:g} GB/s (a delay "
                     "added to every all-reduce across replicas, on top of loopback)")
    if plan.interconnect != "measured":
        notes.append(f"bandwidths are {plan.interconnect}'s, not this machine's: pass --interconnect measured "
                     "to validate the model here")
    return {"bench": str(path), "preset": preset, "rows": rows,
            "max_abs_relative_error": max(errors) if errors else None,
            "median_abs_relative_error": median(errors), "noise_floor": info.get("noise_floor"), "notes": notes}


def format_fsdp_comparison(cmp: dict) -> list[str]:
    """Text lines: predicted vs measured per K and policy, the errors and the noise floor."""
    def f(v, fmt="{:.3f}"):
        return "n/a" if v is None else fmt.format(v)

    table = [(r["K"], r["policy"], f(r["predicted_s"]), f(r["measured_s"]), f(r["predicted_over_measured"]),
              f(r["speedup_predicted"], "{:.2f}x"),
              f"{f(r['speedup_measured'], '{:.2f}x')} [{f(r['speedup_ci'][0], '{:.2f}')}, {f(r['speedup_ci'][1], '{:.2f}')}]")
             for r in cmp["rows"]]
    lines = ["", f"Predicted vs measured ({cmp['bench']}, preset {cmp['preset']})"]
    lines += [f"  {line}" for line in tabulate(table, headers=("K", "policy", "predicted s/step", "measured s/step",
                                                               "predicted / measured", "speedup predicted",
                                                               "speedup measured [95% CI]"),
                                               tablefmt="simple", disable_numparse=True).splitlines()]
    lines.append(f"  |predicted / measured - 1|: median {f(cmp['median_abs_relative_error'], '{:.1%}')}, max "
                 f"{f(cmp['max_abs_relative_error'], '{:.1%}')}; the bench's noise floor (its bench.json's noise_floor: how "
                 f"much a cell's per-repeat medians spread, median over cells) {f(cmp['noise_floor'], '{:.1%}')}")
    lines += [f"  note: {n}" for n in cmp["notes"]]
    return lines
