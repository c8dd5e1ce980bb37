"""Predicted vs measured: the what-if model's step times next to a ``bench.json``'s (``--compare_bench``).

``accum-kit bench`` measures the step time of every (preset, K, mode) on the
machine it runs on. Fed a profile of the same preset and micro-batch on the
same machine and process count (``--interconnect measured``), the model should
predict those step times; the relative error ``(predicted - measured) /
measured`` per K and mode is how far to trust it. Torch-free, like the rest
of ``accum-kit plan``.
"""

from __future__ import annotations

from tabulate import tabulate

from .. import checks
from ..errors import UsageError
from ..stats import median
from .whatif import MODES, MeasuredProfile, predict

BENCH_FIX = "pass the bench.json written by `accum-kit bench`"


def _load(path: str) -> dict:
    bench = checks.json_file("--compare_bench", path, BENCH_FIX)
    if not isinstance(bench, dict) or not bench.get("rows") or not isinstance(bench.get("presets"), dict):
        raise UsageError("--compare_bench", f"{path} has no measured rows", BENCH_FIX)
    return bench


def _preset(bench: dict, profile: MeasuredProfile, path: str) -> str:
    """The bench preset the profile's model is: ``preset:NAME`` in the summary, or the bench's only preset."""
    presets = list(bench["presets"])
    name = (profile.model or "").removeprefix("preset:")
    if name in presets:
        return name
    if len(presets) == 1:
        return presets[0]
    raise UsageError("--compare_bench", f"{path} holds presets {presets}, none of them the profile's model "
                     f"{profile.model!r}", "bench the profiled preset, e.g. --model_presets small")


def _relative(predicted: float | None, measured: float | None) -> float | None:
    return (predicted - measured) / measured if (predicted is not None and measured) else None


def compare_with_bench(path: str, profile: MeasuredProfile, c: float, exposed: float, other: float,
                       num_processes: int) -> dict:
    """Predicted vs measured step time (seconds) per K and mode, and the speedup, for the profile's preset.

    Args:
        path: a ``bench.json``.
        profile: the loaded profile (its model picks the bench preset).
        c, exposed, other: the model's compute per micro-batch, exposed
            communication per sync and per-step time (seconds).
        num_processes: the target's process count (a note if the bench ran on another).

    Returns keys ``bench``, ``preset``, ``rows`` (per K: predicted, measured
    and relative error of each mode's step time and of the speedup),
    ``max_abs_relative_error``, ``median_abs_relative_error`` (over both
    modes' step times), the same two over speedups (``speedup_...``), ``bench_inputs`` (the bench's own c, exposed time and
    o, see :func:`_bench_inputs`), ``same_run_max_abs_relative_error`` and
    ``same_run_median_abs_relative_error`` (the same formulas fed by those:
    the noise floor), ``compute_ratio_profile_over_bench`` (c drift) and
    ``notes`` (settings that differ from the profile's).

    Raises:
        UsageError (``--compare_bench``): a missing or unreadable file, no rows, or no matching preset.
    """
    bench = _load(path)
    preset = _preset(bench, profile, path)
    cfg, machine = bench.get("config", {}), bench.get("machine", {})
    measured = {(r["K"], r["mode"]): r.get("step_s_median") for r in bench["rows"] if r.get("preset") == preset}
    speedups = {d["K"]: d.get("speedup") for d in bench.get("per_k", []) if d.get("preset") == preset}
    rows, errors, floor, speedup_errors = [], [], [], []
    own = _bench_inputs(bench["presets"][preset])
    for K in sorted({k for k, _ in measured}):
        row = predict(K, c, exposed, other)
        out = {"K": K}
        for mode, pred in zip(MODES, (row.no_sync_step_seconds, row.sync_each_batch_step_seconds)):
            meas = measured.get((K, mode))
            err = _relative(pred, meas)
            out.update({f"{mode}_predicted_s": pred, f"{mode}_measured_s": meas, f"{mode}_relative_error": err})
            if err is not None:
                errors.append(abs(err))
        if own is not None:  # the same formulas fed by the bench's own medians
            same = predict(K, *own)
            for mode, pred in zip(MODES, (same.no_sync_step_seconds, same.sync_each_batch_step_seconds)):
                err = _relative(pred, measured.get((K, mode)))
                if err is not None:
                    floor.append(abs(err))
        out.update(speedup_predicted=row.speedup, speedup_measured=speedups.get(K),
                   speedup_relative_error=_relative(row.speedup, speedups.get(K)))
        if out["speedup_relative_error"] is not None:
            speedup_errors.append(abs(out["speedup_relative_error"]))
        rows.append(out)
    notes = []
    if machine.get("world_size") not in (None, num_processes):
        notes.append(f"the bench ran on {machine['world_size']} processes, the prediction is for {num_processes}")
    if profile.world_size != num_processes:
        notes.append(f"the profile ran on {profile.world_size} processes, the prediction is for {num_processes}")
    if cfg.get("per_device_train_batch_size") not in (None, profile.per_device_train_batch_size):
        notes.append(f"micro-batch differs: bench {cfg['per_device_train_batch_size']}, "
                     f"profile {profile.per_device_train_batch_size}")
    if cfg.get("comm_hook", "none") != "none":
        notes.append(f"the bench used the {cfg['comm_hook']} compression hook, which the model leaves out")
    return {"bench": str(path), "preset": preset, "rows": rows,
            "max_abs_relative_error": max(errors) if errors else None,
            "median_abs_relative_error": median(errors),
            "speedup_max_abs_relative_error": max(speedup_errors) if speedup_errors else None,
            "speedup_median_abs_relative_error": median(speedup_errors),
            "bench_inputs": dict(zip(("c_seconds", "exposed_seconds", "other_seconds"), own)) if own else None,
            "compute_ratio_profile_over_bench": c / own[0] if own and own[0] else None,
            "same_run_max_abs_relative_error": max(floor) if floor else None,
            "same_run_median_abs_relative_error": median(floor), "notes": notes}


def _bench_inputs(info: dict) -> tuple[float, float, float] | None:
    """The bench's own c, exposed a and per-step o (optimizer + other of its no_sync runs), seconds.

    Fed into the same formulas they give the noise floor: how well the model
    fits the run its inputs come from, so that the rest of the error is the
    drift between the profile and the bench (load on a shared machine).
    """
    prof = (info.get("profile") or {}).get("no_sync") or {}
    c, a, opt, other = info.get("c_seconds"), info.get("a_seconds"), prof.get("optimizer_s"), prof.get("other_s")
    if None in (c, a, opt, other):
        return None
    return c, a, opt + other


def _s(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:+.0%}"


def format_comparison(comparison: dict) -> list[str]:
    """Text lines: one table row per K (predicted / measured / error per mode, then the speedup)."""
    table = [(r["K"],
              _s(r["no_sync_predicted_s"]), _s(r["no_sync_measured_s"]), _pct(r["no_sync_relative_error"]),
              _s(r["sync_each_batch_predicted_s"]), _s(r["sync_each_batch_measured_s"]),
              _pct(r["sync_each_batch_relative_error"]),
              _s(r["speedup_predicted"]), _s(r["speedup_measured"]), _pct(r["speedup_relative_error"]))
             for r in comparison["rows"]]
    headers = ("K", "no_sync pred s", "meas s", "err", "sync_each pred s", "meas s", "err",
               "speedup pred", "meas", "err")
    lines = ["", f"Predicted vs measured ({comparison['bench']}, preset {comparison['preset']}; "
                 "err = (predicted - measured) / measured)",
             "\n".join(f"  {line}" for line in tabulate(table, headers=headers, tablefmt="simple",
                                                         disable_numparse=True).splitlines()),
             f"  |error| over step times: median {_pct(comparison['median_abs_relative_error']).lstrip('+')}, "
             f"max {_pct(comparison['max_abs_relative_error']).lstrip('+')}; over speedups: median "
             f"{_pct(comparison['speedup_median_abs_relative_error']).lstrip('+')}, max "
             f"{_pct(comparison['speedup_max_abs_relative_error']).lstrip('+')}"]
    own = comparison.get("bench_inputs")
    if own:
        lines.append(
            f"  same formulas fed by the bench's own c = {_s(own['c_seconds'])} s, e = {_s(own['exposed_seconds'])} s, "
            f"o = {_s(own['other_seconds'])} s: |error| median "
            f"{_pct(comparison['same_run_median_abs_relative_error']).lstrip('+')}, max "
            f"{_pct(comparison['same_run_max_abs_relative_error']).lstrip('+')} (the noise floor); profile c / bench c = "
            f"{_s(comparison['compute_ratio_profile_over_bench'])}")
    lines += [f"  note: {n}" for n in comparison["notes"]]
    return lines
