"""The bench's statistics and verdicts, in process: t quantiles, ratio intervals, bars, tune recommendation, flags.

Oracles: printed Student t tables (any statistics textbook), numerical
integration of the t density written here, the t-interval formula written
out with the standard library, and a coverage simulation. No launch, no timing.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from accum_kit import stats

# Student t quantiles from a printed table (two-sided 95 % and 99 %, i.e. the 0.975 and 0.995 quantiles).
T_TABLE = {1: (12.706, 63.657), 2: (4.303, 9.925), 3: (3.182, 5.841), 4: (2.776, 4.604), 5: (2.571, 4.032),
           6: (2.447, 3.707), 7: (2.365, 3.499), 8: (2.306, 3.355), 9: (2.262, 3.250), 10: (2.228, 3.169),
           15: (2.131, 2.947), 19: (2.093, 2.861), 20: (2.086, 2.845), 29: (2.045, 2.756), 30: (2.042, 2.750),
           40: (2.021, 2.704), 60: (2.000, 2.660), 120: (1.980, 2.617)}


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_t_quantiles_match_the_printed_table(df):
    q975, q995 = T_TABLE[df]
    assert stats.t_quantile(0.975, df) == pytest.approx(q975, abs=6e-4)
    assert stats.t_quantile(0.995, df) == pytest.approx(q995, abs=6e-4)
    assert stats.t_quantile(0.025, df) == pytest.approx(-q975, abs=6e-4)


def _t_density_mass(t: float, df: int, n: int = 4000) -> float:
    """P(|T| <= t) by Simpson's rule on the t density (gamma-function normalisation): an independent computation."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    f = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    h = t / n
    s = f(0) + f(t) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
    return 2 * s * h / 3


@pytest.mark.parametrize("df", [1, 2, 3, 6, 11, 24])
@pytest.mark.parametrize("t", [0.3, 1.0, 2.5])
def test_t_mass_matches_numerical_integration(df, t):
    assert stats.t_central_mass(t, df) == pytest.approx(_t_density_mass(t, df), abs=1e-8)


def test_t_functions_refuse_bad_arguments():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            stats.t_central_mass(1.0, bad)
    for q in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError):
            stats.t_quantile(q, 3)


def test_ratio_interval_is_the_t_interval_on_log_ratios():
    ratios = [0.97, 1.04, 1.01, 0.93, 1.10]
    got = stats.ratio_interval(ratios)
    logs = [math.log(r) for r in ratios]
    m, sd = sum(logs) / 5, math.sqrt(sum((x - sum(logs) / 5) ** 2 for x in logs) / 4)
    half = T_TABLE[4][0] * sd / math.sqrt(5)
    assert got["low"] == pytest.approx(math.exp(m - half), rel=1e-4)
    assert got["high"] == pytest.approx(math.exp(m + half), rel=1e-4)
    assert got["geometric_mean"] == pytest.approx(math.exp(m))
    assert got["median"] == 1.01 and got["n"] == 5
    # a ratio and its inverse are symmetric on the log scale: inverting every ratio inverts the interval
    inv = stats.ratio_interval([1 / r for r in ratios])
    assert (inv["low"], inv["high"]) == (pytest.approx(1 / got["high"]), pytest.approx(1 / got["low"]))


def test_ratio_interval_edge_cases():
    assert stats.ratio_interval([])["median"] is None
    one = stats.ratio_interval([1.2, None])
    assert one["median"] == 1.2 and one["low"] is None and one["high"] is None
    same = stats.ratio_interval([1.5, 1.5, 1.5])
    assert same["low"] == pytest.approx(1.5) and same["high"] == pytest.approx(1.5)


def test_ratio_interval_covers_the_true_ratio_95_percent_of_the_time():
    """Log-normal per-pass ratios around 1.1, 8 passes each: about 95 % of 2000 intervals contain 1.1."""
    rng = random.Random(0)
    hits = 0
    for _ in range(2000):
        r = stats.ratio_interval([1.1 * math.exp(rng.gauss(0, 0.05)) for _ in range(8)])
        hits += r["low"] <= 1.1 <= r["high"]
    assert 0.935 <= hits / 2000 <= 0.965, hits


def test_interval_verdicts():
    v = stats.interval_verdict
    assert v(0.98, 1.02, 1.03, at_most=True) == "PASS"
    assert v(1.01, 1.05, 1.03, at_most=True) == "UNRESOLVED"
    assert v(1.04, 1.08, 1.03, at_most=True) == "FAIL"
    assert v(1.30, 1.50, 1.25, at_most=False) == "PASS"
    assert v(1.20, 1.30, 1.25, at_most=False) == "UNRESOLVED"
    assert v(1.10, 1.20, 1.25, at_most=False) == "FAIL"
    assert v(None, None, 1.0, at_most=True) is None
    assert stats.resolved(0.9, 0.99) is True and stats.resolved(0.9, 1.01) is False


def _runs(step_by_repeat: dict) -> list[dict]:
    """Synthetic bench runs: {mode: [median step of repeat 0, 1, ...]} at K=8, preset comm_heavy."""
    return [{"preset": "comm_heavy", "K": 8, "mode": m, "repeat": i, "step_seconds": [t], "peak_rss_mb": 100.0}
            for m, ts in step_by_repeat.items() for i, t in enumerate(ts)]


def test_paired_estimate_pairs_within_repeats():
    from accum_kit.bench.bench_report import paired_estimate

    # Drift: repeat 1 is twice as slow for both modes; the paired ratios stay 1.5, 1.6, 1.4.
    runs = _runs({"sync_each_batch": [3.0, 6.4, 2.8], "no_sync": [2.0, 4.0, 2.0]})
    est = paired_estimate(runs, 8, "sync_each_batch", "no_sync")
    assert est["per_repeat"] == pytest.approx([1.5, 1.6, 1.4])
    assert est["median"] == pytest.approx(1.5)
    lo, hi = stats.ratio_interval([1.5, 1.6, 1.4])["low"], stats.ratio_interval([1.5, 1.6, 1.4])["high"]
    assert (est["low"], est["high"]) == (pytest.approx(lo), pytest.approx(hi))
    assert 1.25 < est["low"] < 1.5 < est["high"] < 1.8


def _per_k(point, lo, hi, ideal=1.5, raw=(1.0, 0.98, 1.02)):
    return {"preset": "comm_heavy", "K": 8, "speedup": point, "speedup_ci_low": lo, "speedup_ci_high": hi,
            "ideal_speedup": ideal, "fraction_of_ideal": point / ideal, "fraction_of_ideal_ci_low": lo / ideal,
            "fraction_of_ideal_ci_high": hi / ideal, "no_sync_over_raw_ddp": raw[0],
            "no_sync_over_raw_ddp_ci_low": raw[1], "no_sync_over_raw_ddp_ci_high": raw[2]}


def test_bars_judge_by_the_interval_not_the_point():
    from accum_kit.bench.report_ddp import evaluate_bars

    bars = {b["name"]: b for b in evaluate_bars([], [_per_k(1.45, 1.40, 1.50)])}
    assert bars["speedup"]["verdict"] == "PASS" and bars["speedup"]["passed"] is True
    assert bars["fraction_of_ideal"]["verdict"] == "PASS"  # 1.40 / 1.5 = 93 % >= 90 %
    assert bars["no_sync_vs_raw_ddp"]["verdict"] == "PASS"
    assert bars["memory"]["verdict"] == "SKIP" and bars["memory"]["passed"] is None
    # the same point estimates, wider intervals: unresolved, not passed
    bars = {b["name"]: b for b in evaluate_bars([], [_per_k(1.45, 1.20, 1.70, raw=(1.0, 0.95, 1.06))])}
    assert bars["speedup"]["verdict"] == "UNRESOLVED" and bars["speedup"]["passed"] is None
    assert bars["no_sync_vs_raw_ddp"]["verdict"] == "UNRESOLVED"
    # a point estimate within the bar whose interval lies outside cannot happen; one wholly outside fails
    bars = {b["name"]: b for b in evaluate_bars([], [_per_k(1.10, 1.05, 1.15, raw=(1.06, 1.04, 1.08))])}
    assert bars["speedup"]["verdict"] == "FAIL" and bars["speedup"]["passed"] is False
    assert bars["no_sync_vs_raw_ddp"]["verdict"] == "FAIL"


def test_memory_bar_uses_the_per_repeat_ratio_of_the_two_runs():
    from accum_kit.bench.report_ddp import evaluate_bars

    runs = []
    for rep, (lo, hi) in enumerate([(100.0, 101.0), (102.0, 102.5), (99.0, 100.5)]):
        runs += [{"preset": "small", "mode": "no_sync", "K": 1, "repeat": rep, "peak_rss_mb": lo},
                 {"preset": "small", "mode": "no_sync", "K": 16, "repeat": rep, "peak_rss_mb": hi}]
    rows = [{"preset": "small", "mode": "no_sync", "K": 16, "peak_rss_mb": 102.5}]
    bar = next(b for b in evaluate_bars(rows, [], runs) if b["name"] == "memory")
    ratios = [1.01, 102.5 / 102.0, 100.5 / 99.0]
    assert bar["value"] == pytest.approx(statistics.median(ratios))
    assert bar["interval"] == [pytest.approx(stats.ratio_interval(ratios)["low"]), pytest.approx(stats.ratio_interval(ratios)["high"])]
    assert bar["verdict"] == "PASS"


def test_ratio_cells_mark_intervals_that_contain_one():
    from accum_kit.bench.bench_tables import fmt_ratio

    assert fmt_ratio(0.99, 0.95, 1.03) == "0.990 [0.950-1.030] not resolved"
    assert fmt_ratio(1.45, 1.40, 1.50, "{:.2f}", "x") == "1.45x [1.40-1.50]"
    assert fmt_ratio(1.2, None, None) == "1.200 [n<2]"
    # skewed per-pass ratios: the median can fall outside the interval, which is centred on the geometric mean
    assert fmt_ratio(1.30, 1.09, 1.22) == "1.300 [1.090-1.220] (median outside)"


def test_mean_interval_is_the_textbook_t_interval():
    from accum_kit import stats

    xs = [0.21, 0.35, 0.18, 0.40, 0.29]  # n = 5: t(0.975, 4) = 2.776 (any t table)
    m = sum(xs) / 5
    sd = (sum((x - m) ** 2 for x in xs) / 4) ** 0.5
    mean, low, high = stats.mean_interval(xs)
    assert mean == pytest.approx(m)
    assert (low, high) == pytest.approx((m - 2.776 * sd / 5 ** 0.5, m + 2.776 * sd / 5 ** 0.5), rel=1e-3)
    assert stats.mean_interval([0.3]) == (0.3, None, None) and stats.mean_interval([]) == (None, None, None)


def _tune_runs(factor: dict, reps=4):
    """Synthetic --tune runs: setting -> its step time / base's, with a common drift per repeat."""
    runs = []
    for rep in range(reps):
        drift = 1 + 0.3 * rep
        for s, f in factor.items():
            jitter = 1 + 0.01 * ((rep + len(s)) % 3 - 1)
            mbs = [{"sync": False, "forward_s": 0.1, "backward_s": 0.2}, {"sync": True, "forward_s": 0.1, "backward_s": 0.35}]
            runs.append({"preset": "comm_heavy", "K": 2, "mode": s, "repeat": rep, "step_seconds": [drift * f * jitter],
                         "micro_batches": mbs, "seconds_per_sync": 0.3, "syncs": 1, "allreduce_calls": 4,
                         "peak_rss_mb": 1000.0, "peak_increase_mb": 50.0})
    return runs


def test_tune_summary_and_recommendation():
    from accum_kit.bench.report_tune import recommend, summarize_tune

    settings = {"base": {}, "bucket_cap_mb=5": {"bucket_cap_mb": 5}, "find_unused_parameters": {"find_unused_parameters": True}}
    rows = summarize_tune("comm_heavy", _tune_runs({"base": 1.0, "bucket_cap_mb=5": 0.9, "find_unused_parameters": 1.1}), settings)
    by = {r["setting"]: r for r in rows}
    assert by["bucket_cap_mb=5"]["over_base"] == pytest.approx(0.9, rel=0.03)
    assert by["bucket_cap_mb=5"]["over_base_ci_high"] < 1 < by["find_unused_parameters"]["over_base_ci_low"]
    assert by["base"]["exposed_comm_s_per_sync"] == pytest.approx(0.15)  # 0.35 - 0.2
    assert by["base"]["exposed_limit_s"] == pytest.approx(0.1)  # max(0, 0.3 - 0.2)
    assert by["base"]["exposed_over_limit"] == pytest.approx(1.5)
    rec = recommend(rows)
    assert rec["best"] == "bucket_cap_mb=5" and rec["slower"] == ["find_unused_parameters"]
    # nothing resolvably faster: keep the base
    rows = summarize_tune("comm_heavy", _tune_runs({"base": 1.0, "bucket_cap_mb=5": 1.0}), {"base": {}, "bucket_cap_mb=5": {}})
    assert recommend(rows)["best"] is None and "keep the base" in recommend(rows)["text"]


# --------------------------------------------------------------------------- flags


def test_schedule_defaults_quick_and_tune(monkeypatch):
    from accum_kit.bench.bench_config import QUICK_SCHEDULE, BenchConfig

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a 2-process DDP launch: the DDP modes (one process: test_bench_one_process.py)
    d = BenchConfig()
    assert (d.steps, d.warmup_steps, d.repeats) == (1, 0, 24) and d.accumulation_steps == [1, 2, 4, 8, 16]
    q = BenchConfig(quick=True)
    assert (q.steps, q.warmup_steps, q.repeats) == QUICK_SCHEDULE == (2, 1, 3)  # the earlier default run
    assert BenchConfig(quick=True, repeats=5).repeats == 5  # an explicit flag wins
    t = BenchConfig(tune=True)
    assert t.accumulation_steps == [8] and t.model_presets == ["comm_heavy"]


@pytest.mark.parametrize("argv, flag", [
    (["--tune", "--accumulation_steps", "1", "8"], "--accumulation_steps"),
    (["--tune", "--tune_bucket_cap_mb", "5", "0"], "--tune_bucket_cap_mb"),
    (["--modes", "no_sync", "trainer", "--ddp_static_graph", "true"], "--ddp_static_graph"),
    (["--ddp_bucket_cap_mb", "-1"], "--ddp_bucket_cap_mb"),
    (["--modes", "no_sync", "manual"], "--modes"),
    (["--lora_r", "8"], "--lora_r"),  # LoRA settings need --use_peft
    (["--use_peft", "--lora_r", "0"], "--lora_r"),
    (["--use_peft", "--tune"], "--use_peft"),
])
def test_bench_bad_input_exits_2(argv, flag, tmp_path, capsys, monkeypatch):
    from accum_kit.cli import run

    monkeypatch.setenv("WORLD_SIZE", "2")  # the flags of a 2-process DDP launch, refused before it is used

    out = tmp_path / "out"
    assert run("bench", [*argv, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err, err
    assert not out.exists()


def test_ddp_flags_reach_the_accelerators_ddp_kwargs(accelerator):
    """Trainer's flag names (and DDP's as aliases) -> DDP kwargs -> Accelerate's DistributedDataParallelKwargs.

    (The ``accelerator`` fixture resets Accelerate's state around the test.)
    """
    from accum_kit import build_accelerator
    from accum_kit.bench.bench_config import BenchConfig
    from accum_kit.cli import parse
    from accum_kit.job.config import TrainConfig
    from accum_kit.engines.ddp import ddp_kwargs

    argv = ["--ddp_bucket_cap_mb", "5", "--gradient_as_bucket_view", "true", "--static_graph", "true",
            "--ddp_find_unused_parameters", "true"]
    want = {"bucket_cap_mb": 5.0, "gradient_as_bucket_view": True, "static_graph": True, "find_unused_parameters": True}
    assert ddp_kwargs(parse(TrainConfig, argv)) == want
    with pytest.MonkeyPatch.context() as mp:  # the bench takes DDP's settings under a launch of 2 or more processes
        mp.setenv("WORLD_SIZE", "2")
        assert parse(BenchConfig, ["--bucket_cap_mb", "7"]).ddp_kwargs() == {"bucket_cap_mb": 7.0}
    assert ddp_kwargs(parse(TrainConfig, [])) == {}
    acc = build_accelerator(2, cpu=True, ddp_kwargs=want)
    h = acc.ddp_handler
    assert (h.bucket_cap_mb, h.gradient_as_bucket_view, h.static_graph, h.find_unused_parameters) == (5.0, True, True, True)


def test_build_accelerator_updates_a_given_ddp_handler(accelerator):
    from accelerate.utils import DistributedDataParallelKwargs

    from accum_kit import build_accelerator

    own = DistributedDataParallelKwargs(broadcast_buffers=False, bucket_cap_mb=50)
    acc = build_accelerator(2, cpu=True, kwargs_handlers=[own], ddp_kwargs={"bucket_cap_mb": 5})
    assert acc.ddp_handler.bucket_cap_mb == 5 and acc.ddp_handler.broadcast_buffers is False
    assert own.bucket_cap_mb == 50  # not mutated


def test_train_refuses_a_bad_bucket_size(tmp_path, capsys):
    from accum_kit.cli import run

    out = tmp_path / "out"
    assert run("train", ["--ddp_bucket_cap_mb", "0", "--output_dir", str(out)]) == 2
    assert "--ddp_bucket_cap_mb" in capsys.readouterr().err
    assert not out.exists()


def test_fsdp_launch_schedule_and_the_flags_of_the_other_launch_kind(monkeypatch, tmp_path):
    """Under an FSDP2 launch: one warm-up window, the DDP-only flags refused; under DDP the policies refused."""
    from accum_kit.bench.bench_config import BenchConfig
    from accum_kit.errors import UsageError

    out = str(tmp_path / "bench")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    f = BenchConfig(output_dir=out)
    assert (f.steps, f.warmup_steps, f.repeats) == (5, 1, 3)
    for kwargs, flag in [({"tune": True}, "--tune"), ({"comm_hook": "fp16"}, "--comm_hook"),
                         ({"ddp_bucket_cap_mb": 5.0}, "--ddp_bucket_cap_mb"),
                         ({"gradient_as_bucket_view": True}, "--gradient_as_bucket_view")]:
        with pytest.raises(UsageError) as e:
            BenchConfig(output_dir=out, **kwargs)
        assert e.value.flag == flag and "FSDP2" in str(e.value)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    with pytest.raises(UsageError) as e:
        BenchConfig(output_dir=out, accumulation_policies=["no_sync", "sync_each_batch"])
    assert e.value.flag == "--accumulation_policies"
    assert not (tmp_path / "bench").exists()


def test_bench_use_peft_builds_the_preset_with_adapters_only_trainable(monkeypatch):
    """--use_peft --lora_r 8: every arm's model is the preset with LoRA on each block's c_attn, the only trainable
    parameters: 8 (d + 3 d) per block, counted by hand."""
    pytest.importorskip("peft")
    from accum_kit.bench.bench_config import BenchConfig
    from accum_kit.job.models import PRESETS

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = BenchConfig(use_peft=True, lora_r=8, model_presets=["tiny"])
    model = cfg.build_model("tiny")
    d, L = PRESETS["tiny"]["n_embd"], PRESETS["tiny"]["n_layer"]
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == L * 8 * (d + 3 * d)
    assert cfg.adapter_info() == {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}
    assert BenchConfig().adapter_info() is None and BenchConfig(use_peft=True).lora_r == 16  # TRL's default rank
