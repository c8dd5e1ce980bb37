"""Figures and targets of the bench's FSDP2 / HSDP policies: speedup over ``sync_each_batch``, collectives,
memory against its prediction, ideals, the profiler's estimated saving. No torch."""

from __future__ import annotations

import statistics

from ..engines.costs import policy_costs
from ..engines.model_units import ShardedModel
from ..planning.step_time import MeasuredCommunication, step_time
from ..stats import interval_verdict, mean_interval, median, quartiles, ratio_interval
from .bench_report import MB, _f, _m, paired_differences, paired_ratios, target
from .saving_parts import format_parts, saving_parts


#: The policy every other one is compared with.
POLICY_BASE = "sync_each_batch"

#: bench.csv's columns under FSDP2 / HSDP (one row per preset x K x policy).
FSDP_CSV_FIELDS = (
    "preset", "K", "policy", "n_steps", "n_pairs", "step_s_median", "step_s_q1", "step_s_q3",
    "speedup_vs_sync_each_batch", "speedup_ci_low", "speedup_ci_high", "seconds_saved_per_step", "saved_ci_low",
    "saved_ci_high", "reduce_scatter_calls_per_step", "all_gather_calls_per_step", "reduce_scatter_mb_per_step",
    "all_gather_mb_per_step", "reduce_scatter_busbw_GBps", "all_gather_busbw_GBps", "gradient_mb_peak",
    "predicted_gradient_mb", "gradient_measured_over_predicted", "gathered_parameter_mb_peak",
    "predicted_gathered_mb", "memory_added_mb", "peak_rss_mb", "own_ideal_s", "over_ideal", "ideal_s",
    "over_shared_ideal", "estimated_saved_s",
    "estimated_over_measured", "cpu_seconds_saved_per_step", "cpu_saved_ci_low", "cpu_saved_ci_high",
    "estimated_cpu_saved_s", "estimated_over_measured_cpu",
)


def _pass_medians(runs) -> dict[int, float]:
    return {r["repeat"]: median(r["step_seconds"]) for r in runs if r["step_seconds"]}


def summarize_fsdp_preset(preset: str, info: dict, runs: list[dict], cfg, world: int) -> dict:
    """The preset's figures and its rows, one per K x policy; ``rows`` is popped by the caller.

    Per (K, policy) row (seconds per optimizer step; MB = 2**20 bytes):

    - ``step_s_median`` / ``step_s_q1`` / ``step_s_q3``: over every measured step
      of every repeat (process 0);
    - ``speedup_vs_sync_each_batch`` with ``speedup_ci_low`` / ``speedup_ci_high``:
      paired ratios, one per cycle (each cycle runs one window of every policy,
      back to back): ``sync_each_batch``'s step over this policy's; their
      geometric mean and its 95 % Student-t interval (on the logarithms: the
      ratio of two step times is multiplicative noise). ``seconds_saved_per_step``
      (``sync_each_batch``'s step minus this policy's) is the mean of the paired
      differences with its 95 % interval (``saved_ci_low`` / ``saved_ci_high``);
    - counts and bytes per step (medians over runs): ``reduce_scatter_calls_per_step``,
      ``all_gather_calls_per_step``, ``reduce_scatter_mb_per_step``,
      ``all_gather_mb_per_step``; bus bandwidths as the profiler defines them;
    - memory: ``gradient_mb_peak`` (gradient bytes held between two micro-batches,
      the most over processes; median over runs), ``gathered_parameter_mb_peak``,
      ``memory_added_mb`` (both minus ``sync_each_batch``'s at the same K),
      ``predicted_gradient_mb`` / ``predicted_gathered_mb``
      (:func:`accum_kit.engines.costs.policy_costs` with the model's units) and
      ``gradient_measured_over_predicted``; ``peak_rss_mb`` (process peak);
    - the policy's own ideal from its profile, ``own_ideal_s``: the profiler's
      ``ideal_seconds_per_step`` over the cell's records of all repeats pooled
      (K x compute per micro-batch + exposed reduce-scatter + exposed all-gather
      + optimizer step, see :mod:`accum_kit.profiler.sharded`);
      ``over_ideal`` = measured median / own ideal, i.e. 1 + what the loop spends
      outside compute, communication and the optimizer (batches, callbacks);
    - the shared-model ideal, ``ideal_s = K c + syncs a + g + o``, with ``c`` the
      compute per micro-batch and ``a`` the exposed reduce-scatter per sync of
      the preset's ``no_sync`` runs (K >= 2; medians), ``syncs`` 1 per step (K with
      ``sync_each_batch``), and ``g`` (exposed all-gather per step) and ``o``
      (optimizer step) this cell's own medians; ``over_shared_ideal``: measured / it
      (what one compute figure for every policy misses: FSDP2's copies around
      each all-gather belong to compute, and fewer all-gathers mean fewer copies);
    - the profiler's estimate of the saving against ``sync_each_batch``
      (``estimated_saved_s``, from this cell's own records of all repeats pooled,
      see :mod:`accum_kit.profiler.sharded`) and ``estimated_over_measured``;
      its terms per skipped sync, ``estimate_terms``: ``R`` and ``H`` (post-backward
      hooks of a sync and of a deferred micro-batch), ``A`` (the shard add, and
      ``A_source``), ``G`` (autograd's add into the unsharded gradient, and ``G_source``),
      and ``A_measured``: the same add measured
      in this K's ``sync_each_batch`` windows (hooks of a micro-batch that added to
      a held shard minus those of one that stored it), a check on the assumed ``A``;
    - ``saving_parts``: the measured saving split by part of the step (means per
      window of the cell's pooled records, ``sync_each_batch`` minus the policy:
      forward, post-backward hooks, autograd (the backwards without the hooks),
      of it the timed accumulation, optimizer, rest; see
      :mod:`accum_kit.bench.saving_parts`), the measured side of each term;
    - the same comparison in process 0's CPU seconds (``time.process_time``, all
      threads): ``cpu_seconds_saved_per_step`` (paired differences of the
      windows' CPU seconds, with ``cpu_saved_ci_low`` / ``cpu_saved_ci_high``),
      ``estimated_cpu_saved_s`` (the profiler's estimate with every term in CPU
      seconds) and ``estimated_over_measured_cpu``: the work saved, which other
      jobs on a shared machine disturb far less than the wall clock.

    Noise floor of a preset: the median over cells of the relative standard
    deviation of the per-repeat medians, ``stdev / median`` (how much the same
    cell moves between runs minutes apart; the paired ratios are tighter).
    """
    trainable = info["units"].get("trainable")  # --use_peft: the adapters' elements per unit
    layout = ShardedModel(tuple(info["units"]["resharded"]), tuple(info["units"]["kept"]),
                          trainable=None if trainable is None else tuple(trainable))
    b = info["element_bytes"]
    nosync = [r for r in runs if r["policy"] == "no_sync" and r["K"] >= 2]
    c, a = _m(nosync, "compute_seconds"), _m(nosync, "exposed_comm_seconds")
    rows, spreads = [], []
    for K in cfg.accumulation_steps:
        base_runs = [r for r in runs if r["K"] == K and r["policy"] == POLICY_BASE]
        base_mem = (_m(base_runs, "gradient_bytes") or 0) + (_m(base_runs, "gathered_parameter_bytes") or 0)
        for policy in cfg.accumulation_policies:
            cell = [r for r in runs if r["K"] == K and r["policy"] == policy]
            steps = [x for r in cell for x in r["step_seconds"]]
            if not steps:
                continue
            passes = _pass_medians(cell)
            med = median(steps)
            q1, q3 = quartiles(steps)
            pv = list(passes.values())
            if len(pv) >= 2:
                spreads.append(statistics.stdev(pv) / statistics.median(pv))
            ratios = paired_ratios(base_runs, cell)
            est = ratio_interval(ratios)
            speedup, lo, hi = est["geometric_mean"], est["low"], est["high"]
            saved, slo, shi = mean_interval(paired_differences(base_runs, cell))
            cpu_saved, cpu_lo, cpu_hi = mean_interval(paired_differences(base_runs, cell, "step_cpu_seconds"))
            est_cpu = info.get("pooled", {}).get(f"K{K}/{policy}", {}).get("estimated_cpu_seconds_saved_per_step")
            pred = policy_costs(policy, layout, world_size=world, accumulation_steps=K, param_bytes=b["b_p"],
                                compute_bytes=b["b_c"], reduce_bytes=b["b_r"],
                                replicate_size=info.get("mesh", {}).get("dp_replicate_size", 1))
            grad, gathered = _m(cell, "gradient_bytes"), _m(cell, "gathered_parameter_bytes")
            g, o = _m(cell, "exposed_all_gather_seconds_per_step"), _m(cell, "optimizer_seconds")
            # the step-time model, syncs per window from the cost table (K with sync_each_batch, else 1) priced at a
            ideal = (step_time(pred, c, MeasuredCommunication(a, g), other_seconds=o).seconds
                     if None not in (c, a, g, o) else None)
            pooled = info.get("pooled", {}).get(f"K{K}/{policy}", {})
            est = pooled.get("estimated_seconds_saved_per_step", _m(cell, "estimated_seconds_saved_per_step"))
            own = pooled.get("ideal_seconds_per_step", _m(cell, "ideal_seconds_per_step"))
            base_pool = info.get("pooled", {}).get(f"K{K}/{POLICY_BASE}", {})
            adding, storing = base_pool.get("post_backward_adding_seconds"), base_pool.get("post_backward_sync_seconds")
            terms = {"R": pooled.get("post_backward_sync_seconds"), "H": pooled.get("post_backward_no_sync_seconds"),
                     "A": pooled.get("shard_add_seconds"), "A_source": pooled.get("shard_add_source"),
                     "G": pooled.get("accumulation_seconds"), "G_source": pooled.get("accumulation_source"),
                     "A_measured": adding - storing if None not in (adding, storing) else None}
            rows.append({
                "preset": preset, "K": K, "policy": policy, "n_steps": len(steps), "n_pairs": len(ratios),
                "step_s_median": med, "step_s_q1": q1, "step_s_q3": q3, "pass_medians": pv,
                "speedup_vs_sync_each_batch": speedup,
                "speedup_ci_low": lo, "speedup_ci_high": hi,
                "seconds_saved_per_step": saved, "saved_ci_low": slo, "saved_ci_high": shi,
                "reduce_scatter_calls_per_step": _m(cell, "reduce_scatter_calls_per_step"),
                "all_gather_calls_per_step": _m(cell, "all_gather_calls_per_step"),
                "all_reduce_calls_per_step": _m(cell, "all_reduce_calls_per_step"),
                "all_reduce_mb_per_step": (_m(cell, "all_reduce_bytes_per_step") or 0) / MB,
                "reduce_scatter_mb_per_step": (_m(cell, "reduce_scatter_bytes_per_step") or 0) / MB,
                "all_gather_mb_per_step": (_m(cell, "all_gather_bytes_per_step") or 0) / MB,
                "reduce_scatter_busbw_GBps": _m(cell, "reduce_scatter_busbw_GBps"),
                "all_gather_busbw_GBps": _m(cell, "all_gather_busbw_GBps"),
                "gradient_mb_peak": grad / MB if grad is not None else None,
                "gathered_parameter_mb_peak": gathered / MB if gathered is not None else None,
                "memory_added_mb": ((grad or 0) + (gathered or 0) - base_mem) / MB if base_runs else None,
                "predicted_gradient_mb": pred.gradient_bytes / MB,
                "predicted_gathered_mb": pred.gathered_parameter_bytes / MB,
                "gradient_measured_over_predicted": grad / pred.gradient_bytes if (grad and pred.gradient_bytes) else None,
                "peak_rss_mb": _m(cell, "peak_rss_mb"),
                "own_ideal_s": own, "over_ideal": med / own if own else None,
                "ideal_s": ideal, "over_shared_ideal": med / ideal if ideal else None,
                "exposed_all_gather_s": g, "optimizer_s": o,
                "estimated_saved_s": est,
                "estimated_over_measured": est / saved if (est is not None and saved) else None,
                "estimate_terms": terms,
                "saving_parts": saving_parts(base_pool.get("window_parts"), pooled.get("window_parts")),
                "cpu_seconds_saved_per_step": cpu_saved, "cpu_saved_ci_low": cpu_lo, "cpu_saved_ci_high": cpu_hi,
                "estimated_cpu_saved_s": est_cpu,
                "estimated_over_measured_cpu": est_cpu / cpu_saved if (est_cpu is not None and cpu_saved) else None,
            })
    return {"rows": rows, "c_seconds": c, "a_seconds": a, "noise_floor": median(spreads),
            "model": {"P": layout.parameters, "P_f": layout.layer_parameters, "P_0": layout.other_parameters,
                      "U_f": len(layout.resharded), "U_0": len(layout.kept)}}


def evaluate_targets(rows: list[dict], presets: dict, K: int = 8) -> list[dict]:
    """The FSDP2 targets, checked on what this run measured (never in unit tests), per preset at ``K`` (if swept).

    - ``no_sync`` faster than ``sync_each_batch``: PASS when the speedup's 95 % interval lies
      at or above 1, FAIL when it lies below, otherwise UNRESOLVED (this run cannot tell);
    - ``no_sync_no_reshard`` at least 2x faster: the same against 2;
    - each policy within 10 % of its ideal: ``|over_ideal - 1| <= 0.10``;
    - the memory prediction within 10 % of the measured gradient bytes, each policy;
    - the profiler's estimated saving of ``no_sync`` within 20 % of the measured (paired) one, in wall
      seconds and in CPU seconds (the second is the one a shared machine leaves readable).
    """
    out = []
    for preset in presets:
        cells = {r["policy"]: r for r in rows if r["preset"] == preset and r["K"] == K}
        if not cells:
            out.append(target(preset, f"K={K} not swept", "SKIP", f"the targets are read at K={K}; pass it in "
                                                                      "--accumulation_steps to check them"))
            continue

        def add(name, ok, detail):
            out.append(target(preset, name, ok, detail))

        ns = cells.get("no_sync")
        for policy, threshold, name in (("no_sync", 1.0, "no_sync faster than sync_each_batch"),
                                        ("no_sync_no_reshard", 2.0, "no_sync_no_reshard >= 2x sync_each_batch"),
                                        ("reduce_scatter_each_batch", 1.0,
                                         "reduce_scatter_each_batch faster than sync_each_batch (HSDP)")):
            r = cells.get(policy)
            if r and POLICY_BASE in cells:  # fewer than 2 paired cycles: no interval, so this run cannot tell
                add(f"K={K}: {name}",
                    interval_verdict(r["speedup_ci_low"], r["speedup_ci_high"], threshold, at_most=False) or "UNRESOLVED",
                    f"speedup {_f(r['speedup_vs_sync_each_batch'])}x, 95% CI [{_f(r['speedup_ci_low'])}, "
                    f"{_f(r['speedup_ci_high'])}]")
        for policy, r in cells.items():
            if r["over_ideal"] is not None:
                add(f"K={K}: {policy} within 10% of its ideal", abs(r["over_ideal"] - 1) <= 0.10,
                    f"measured {r['step_s_median']:.3f} s / own ideal {r['own_ideal_s']:.3f} s = {r['over_ideal']:.3f} "
                    f"(shared-model ideal {_f(r['ideal_s'])} s)")
            if r["gradient_measured_over_predicted"] is not None:
                add(f"K={K}: {policy} gradient memory within 10% of prediction",
                    abs(r["gradient_measured_over_predicted"] - 1) <= 0.10,
                    f"measured {r['gradient_mb_peak']:.2f} MB / predicted {r['predicted_gradient_mb']:.2f} MB")
        if ns and ns["estimated_over_measured"] is not None:
            add(f"K={K}: profiler's no_sync saving within 20% of the measured one",
                abs(ns["estimated_over_measured"] - 1) <= 0.20,
                f"estimated {ns['estimated_saved_s']:.3f} s / measured {ns['seconds_saved_per_step']:.3f} s per step "
                f"(95% CI [{_f(ns['saved_ci_low'])}, {_f(ns['saved_ci_high'])}]) = {ns['estimated_over_measured']:.3f}"
                + _terms(ns.get("estimate_terms") or {})
                + (f"; measured saving by part (s per step): {format_parts(ns['saving_parts'])}"
                   if ns.get("saving_parts") else ""))
        if ns and ns.get("estimated_over_measured_cpu") is not None:
            add(f"K={K}: profiler's no_sync saving in CPU seconds within 20% of the measured one",
                abs(ns["estimated_over_measured_cpu"] - 1) <= 0.20,
                f"estimated {ns['estimated_cpu_saved_s']:.3f} CPU-s / measured {ns['cpu_seconds_saved_per_step']:.3f} "
                f"CPU-s per step (95% CI [{_f(ns['cpu_saved_ci_low'])}, {_f(ns['cpu_saved_ci_high'])}]) = "
                f"{ns['estimated_over_measured_cpu']:.3f}")
    return out


def _terms(t: dict) -> str:
    """The estimate's terms per skipped sync, for the target line (empty without post-backward records)."""
    if t.get("R") is None:
        return ""
    return (f"; per skipped sync R {_f(t['R'])} - H {_f(t['H'])} + A {_f(t['A'])} ({t['A_source']}; measured in "
            f"sync_each_batch windows {_f(t['A_measured'])}) - G {_f(t['G'])} s ({t.get('G_source') or 'n/a'})")


