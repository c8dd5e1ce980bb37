"""Figures and targets of the bench's DeepSpeed ZeRO stages: the ratio to ZeRO-1, collectives, the reduction
path, memory against its prediction. No torch."""

from __future__ import annotations

from ..engines.costs import zero_costs
from ..stats import interval_verdict, mean_interval, median, quartiles, ratio_interval
from .bench_report import MB, _f, _m, paired_differences, paired_ratios, paired_values, target


KINDS = ("all_reduce", "reduce_scatter", "all_gather")
#: bench.csv's columns under DeepSpeed (one row per preset x K x ZeRO stage).
ZERO_CSV_FIELDS = (
    "preset", "K", "stage", "n_steps", "n_pairs", "step_s_median", "step_s_q1", "step_s_q3", "ratio_vs_zero1",
    "ratio_ci_low", "ratio_ci_high", "seconds_over_zero1", "over_ci_low", "over_ci_high", "cpu_s_median",
    "cpu_ratio_vs_zero1", "cpu_ratio_ci_low", "cpu_ratio_ci_high",
    *(f"{k}_{x}_per_step" for k in KINDS for x in ("calls", "mb")), "collective_s", "reduction_s",
    "gradient_mb", "predicted_gradient_mb", "gradient_measured_over_predicted", "parameter_mb",
    "predicted_parameter_mb", "parameter_measured_over_predicted", "peak_rss_mb", "estimated_saved_s",
    "collectives_only_saved_s", "estimated_over_measured",
)


def _kind(runs, kind: str, key: str):
    return median(((r["by_kind"] or {}).get(kind) or {}).get(key, 0.0) for r in runs if r.get("by_kind") is not None)


def _mean(runs, key):
    values = [r[key] for r in runs if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def summarize_zero_preset(preset: str, info: dict, runs: list[dict], cfg, world: int) -> dict:
    """The preset's rows, one per K x ZeRO stage; ``rows`` is popped by the caller.

    Per (K, stage) row (seconds per optimizer step; MB = 2**20 bytes):

    - ``step_s_median`` / ``step_s_q1`` / ``step_s_q3``: over every measured
      window of every repeat (process 0);
    - ``ratio_vs_zero1`` with ``ratio_ci_low`` / ``ratio_ci_high``: paired
      ratios, one per cycle (a cycle runs one window of every stage, back to
      back): this stage's step over ZeRO-1's in the same cycle; their geometric
      mean and its 95 % Student-t interval on the logarithms
      (:func:`accum_kit.stats.ratio_interval`). Above 1: slower than ZeRO-1.
      ``seconds_over_zero1`` (this stage's step minus ZeRO-1's) is the mean of
      the paired differences with its 95 % interval (``over_ci_low`` / ``over_ci_high``);
      ``cpu_s_median`` and ``cpu_ratio_vs_zero1`` (``cpu_ratio_ci_low`` / ``_high``):
      the same for process 0's CPU seconds per window, which a shared machine's
      other jobs barely change (the ratio to compare across runs);
    - per collective kind, calls and bytes per step (medians over repeats of
      the profiler's per-step figures: :func:`accum_kit.profiler.deepspeed_comm.zero_summary`),
      ``collective_s`` (their seconds) and ``reduction_s`` (the seconds inside
      the ZeRO optimizer's gradient reduction path, collectives included);
    - memory held between two micro-batches, the most over processes (median
      over repeats): ``gradient_mb`` and ``parameter_mb`` (the module's
      parameters) beside ``predicted_gradient_mb`` / ``predicted_parameter_mb``
      (:func:`accum_kit.engines.costs.zero_costs`) and their ratios; none at K=1
      (no two micro-batches in a window);
    - on the ZeRO-2 row, the profiler's estimate of what ZeRO-1 saves over it:
      ``estimated_saved_s`` = ZeRO-2's ``reduction_s`` minus ZeRO-1's (means over
      repeats), beside ``collectives_only_saved_s`` (the same from the
      collectives' seconds alone) and ``estimated_over_measured`` (against
      ``seconds_over_zero1``, the measured paired saving).
    """
    rows = []
    for K in cfg.accumulation_steps:
        base = [r for r in runs if r["K"] == K and r["stage"] == 1]
        for stage in cfg.zero_stages:
            cell = [r for r in runs if r["K"] == K and r["stage"] == stage]
            steps = [x for r in cell for x in r["step_seconds"]]
            if not steps:
                continue
            q1, q3 = quartiles(steps)
            ratios = paired_ratios(cell, base)
            est = ratio_interval(ratios)
            over, olo, ohi = mean_interval(paired_differences(cell, base))
            cpu = paired_values(cell, "cpu_seconds")
            cpu_ratios = paired_ratios(cell, base, "cpu_seconds")
            cpu_est = ratio_interval(cpu_ratios)
            pred = zero_costs(f"zero{stage}", info["engine_parameters"], world_size=world, accumulation_steps=K,
                              param_groups=info["param_groups"], param_bytes=info.get("param_bytes", 4))
            grad, param = _m(cell, "gradient_bytes"), _m(cell, "parameter_bytes")
            row = {"preset": preset, "K": K, "stage": stage, "n_steps": len(steps), "n_pairs": len(ratios),
                   "step_s_median": median(steps), "step_s_q1": q1, "step_s_q3": q3,
                   "ratio_vs_zero1": est["geometric_mean"] if ratios else None,
                   "ratio_ci_low": est["low"] if ratios else None, "ratio_ci_high": est["high"] if ratios else None,
                   "seconds_over_zero1": over, "over_ci_low": olo, "over_ci_high": ohi,
                   "cpu_s_median": median(cpu.values()) if cpu else None,
                   **{f"cpu_{k}": cpu_est[v] if cpu_ratios else None for k, v in (
                       ("ratio_vs_zero1", "geometric_mean"), ("ratio_ci_low", "low"), ("ratio_ci_high", "high"))},
                   "collective_s": _m(cell, "collective_seconds_per_step"),
                   "reduction_s": _m(cell, "reduction_seconds_per_step"),
                   "gradient_mb": grad / MB if grad else None, "predicted_gradient_mb": pred.gradient_bytes / MB,
                   "gradient_measured_over_predicted": grad / pred.gradient_bytes if (grad and pred.gradient_bytes)
                   else None,
                   "parameter_mb": param / MB if param else None,
                   "predicted_parameter_mb": pred.parameter_shard_bytes / MB,
                   "parameter_measured_over_predicted": param / pred.parameter_shard_bytes if param else None,
                   "peak_rss_mb": _m(cell, "peak_rss_mb"),
                   "predicted_calls": {"all_reduce": pred.all_reduce_calls, "reduce_scatter": pred.reduce_scatter_calls,
                                       "all_gather": None if stage == 3 else pred.all_gather_calls},
                   "estimated_saved_s": None, "collectives_only_saved_s": None, "estimated_over_measured": None}
            for kind in KINDS:
                row[f"{kind}_calls_per_step"] = _kind(cell, kind, "calls_per_step")
                row[f"{kind}_mb_per_step"] = (_kind(cell, kind, "bytes_per_step") or 0.0) / MB
            if stage == 2 and base:
                red = (_mean(cell, "reduction_seconds_per_step"), _mean(base, "reduction_seconds_per_step"))
                col = (_mean(cell, "collective_seconds_per_step"), _mean(base, "collective_seconds_per_step"))
                row["estimated_saved_s"] = red[0] - red[1] if None not in red else None
                row["collectives_only_saved_s"] = col[0] - col[1] if None not in col else None
                if row["estimated_saved_s"] is not None and over:
                    row["estimated_over_measured"] = row["estimated_saved_s"] / over
            rows.append(row)
    return {"rows": rows}


def evaluate_zero_targets(rows: list[dict], presets: dict, K: int = 8) -> list[dict]:
    """The ZeRO targets, checked on what this run measured (never in unit tests), per preset at ``K`` (if swept).

    - ZeRO-1 faster than ZeRO-2: PASS when the interval of ZeRO-2's step over ZeRO-1's lies above 1,
      FAIL when below, otherwise UNRESOLVED;
    - the profiler's estimate of ZeRO-1's saving over ZeRO-2 within 20 % of the measured (paired) one;
    - each stage's gradient memory held within 10 % of its prediction.
    """
    out = []
    for preset in presets:
        cells = {r["stage"]: r for r in rows if r["preset"] == preset and r["K"] == K}

        def add(name, ok, detail):
            out.append(target(preset, f"K={K}: {name}", ok, detail))

        z2 = cells.get(2)
        if z2 is None or 1 not in cells:
            add("ZeRO-1 against ZeRO-2", None, "needs stages 1 and 2 at this K")
        else:
            add("ZeRO-1 faster than ZeRO-2",
                interval_verdict(z2["ratio_ci_low"], z2["ratio_ci_high"], 1.0, at_most=False) or "UNRESOLVED",
                f"ZeRO-2 / ZeRO-1 step {_f(z2['ratio_vs_zero1'])}x, 95% CI [{_f(z2['ratio_ci_low'])}, "
                f"{_f(z2['ratio_ci_high'])}]")
            if z2["estimated_over_measured"] is not None:
                add("profiler's ZeRO-1 saving over ZeRO-2 within 20% of the measured one",
                    abs(z2["estimated_over_measured"] - 1) <= 0.20,
                    f"estimated {z2['estimated_saved_s']:.3f} s (collectives alone {_f(z2['collectives_only_saved_s'])}"
                    f" s) / measured {z2['seconds_over_zero1']:.3f} s per step (95% CI [{_f(z2['over_ci_low'])}, "
                    f"{_f(z2['over_ci_high'])}]) = {z2['estimated_over_measured']:.3f}")
        for stage, r in sorted(cells.items()):
            if r["gradient_measured_over_predicted"] is not None:
                add(f"ZeRO-{stage} gradient memory within 10% of prediction",
                    abs(r["gradient_measured_over_predicted"] - 1) <= 0.10,
                    f"measured {r['gradient_mb']:.2f} MB / predicted {r['predicted_gradient_mb']:.2f} MB")
    return out


