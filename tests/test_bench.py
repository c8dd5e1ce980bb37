"""``accum-kit bench``: one small 2-process sweep, checked by arithmetic on its own records; bad input.

The sweep (``accum-kit bench`` on 2 processes under ``accelerate launch --config_file
accelerate_configs/cpu_ddp.yaml``, a command of conftest.py's shared ``ddp_pool``,
with the tiny and mini presets, K in 1 2, 1 repeat, 1 warm-up step, 2
measured steps) is queued once per module and runs while the in-process
bad-input cases (``cli.run("bench", argv)``) run. Expected values come from:

- the flags (row counts, schedule, steps per run);
- the models themselves, built here: gradient bytes all-reduced per sync;
- arithmetic on the JSON's own raw records: the ideal speedup from ``c`` and
  ``a``, ``c`` and ``a`` from the per-micro-batch phase times, medians from
  the per-step times;
- the three modes doing the same arithmetic on the same data from the same
  weights: equal losses; ``no_sync_fused`` (``no_sync`` with the default fused loss, the others run the
  logits' loss) the same first loss within 1e-6 relative, and its loss-axis row recomputed from the runs;
- the peers (``trainer``, ``accelerate_guide``), run in the same launch: the
  same all-reduce counts as ``no_sync``; the guide's mean of micro-batch means
  equals the token mean on this fixed-length data; Trainer's loss is the
  exact one x (BLOCK - 1) / BLOCK, because for GPT-2 it counts every row's
  BLOCK labels before the shift, of which BLOCK - 1 are targets;
- the manual all-reduce modes, run in the same launch: one all-reduce per
  parameter tensor of a model built here (per-parameter mode) or one in all
  (flat), the same losses as no_sync;
- every ratio's 95 % interval recomputed here from the per-repeat ratios with
  the textbook t quantile for one degree of freedom (12.706);
- ``--gradient_checkpointing_ab`` (one command on ``ddp_pool``, one on ``fsdp_pool``, tiny preset, K = 2): every
  arm's checkpointed twin ran, counting its blocks' forwards twice per micro-batch (once for the arm), with the
  arm's losses; its ratio rows are the median of the per-pair ratios and their t-interval, recomputed here;
- ``--tune`` (the next command of the same pool): one row per DDP
  setting, the same losses in every setting, more buckets with a smaller
  bucket cap, the paired ratios and intervals recomputed here.

No timing is asserted (timings belong to the bench's own printed bars). The one-process bench is
tests/test_bench_one_process.py's.
Cost: two commands on the shared DDP pool, one more on each of the DDP and FSDP2 pools (``--gradient_checkpointing_ab``;
no launch of their own), in-process ``cli.run("bench", argv)`` calls.
"""

from __future__ import annotations

import csv
import json
import math
import statistics

import pytest

import job_helpers as jh

PRESETS = ("tiny", "mini")
KS = (1, 2)
CORE = ("sync_each_batch", "no_sync", "raw_ddp")
FUSED = ("no_sync_fused",)
MANUAL = ("manual_allreduce", "manual_allreduce_flat")
PEERS = ("trainer", "accelerate_guide")
MODES = CORE + FUSED + MANUAL + PEERS
WARMUP, STEPS, REPEATS, WORLD = 1, 2, 2, 2
BLOCK, VOCAB = 32, 384
ARGS = ["--model_presets", *PRESETS, "--accumulation_steps", *map(str, KS), "--repeats", str(REPEATS),
        "--warmup_steps", str(WARMUP), "--steps", str(STEPS), "--block_size", str(BLOCK), "--modes", *MODES]
T_0975_DF1 = 12.7062  # Student t, 0.975 quantile, 1 degree of freedom (any t table): REPEATS = 2
TUNE_K, TUNE_REPEATS, TUNE_CAPS = 2, 3, (0.01, 100)
T_0975_DF2 = 4.3027  # 2 degrees of freedom: TUNE_REPEATS = 3
TUNE_ARGS = ["--tune", "--model_presets", "tiny", "--accumulation_steps", str(TUNE_K), "--repeats", str(TUNE_REPEATS),
             "--block_size", str(BLOCK), "--tune_bucket_cap_mb", *map(str, TUNE_CAPS)]


@pytest.fixture(scope="module")
def launch(tmp_path_factory, ddp_pool):
    """Queue the 2-process bench and the 2-process --tune run on conftest.py's shared ``ddp_pool`` (not waiting)."""
    root = tmp_path_factory.mktemp("bench")
    out, tune_out = root / "out", root / "tune"
    started = ddp_pool.submit("bench", [*ARGS, "--output_dir", out])
    tune_started = ddp_pool.submit("bench", [*TUNE_ARGS, "--output_dir", tune_out])
    return {"started": started, "out": out, "tune_started": tune_started, "tune_out": tune_out}


@pytest.fixture(scope="module")
def bench(launch):
    res = launch["started"].result()
    assert res.returncode == 0, res.describe()
    out = launch["out"]
    return {"res": res, "out": out, "json": json.loads((out / "bench.json").read_text()),
            "csv": list(csv.DictReader((out / "bench.csv").open()))}


# --------------------------------------------------------------------------- bad input (in process, no launch)


@pytest.mark.parametrize("argv, flag", [
    (["--accumulation_steps", "1", "0"], "--accumulation_steps"),
    (["--accumulation_steps", "2", "2"], "--accumulation_steps"),
    (["--steps", "0"], "--steps"),
    (["--warmup_steps", "-1"], "--warmup_steps"),
    (["--repeats", "0"], "--repeats"),
    (["--model_presets", "tiny", "huge"], "--model_presets"),
    (["--modes", "no_sync", "fast"], "--modes"),
    (["--modes", "no_sync", "trainer", "--gradient_as_bucket_view", "true"], "--gradient_as_bucket_view"),
    (["--comm_hook", "int8"], "--comm_hook"),
    (["--bucket_cap_mb", "0"], "--bucket_cap_mb"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
    (["--steps", "three"], "--steps"),  # argparse's own error
    (["--gradient_checkpointing_ab", "--gradient_checkpointing"], "--gradient_checkpointing_ab"),
    (["--gradient_checkpointing_ab", "--modes", "trainer"], "--gradient_checkpointing_ab"),
])
def test_bad_input_exits_2_naming_the_flag_and_writes_nothing(launch, argv, flag, tmp_path, capsys, monkeypatch):
    """(Requests the launch first, so the sweep runs while these in-process cases do; WORLD_SIZE=2: the flags as a
    2-process DDP launch reads them, refused before the launch is used.)"""
    from accum_kit.cli import run

    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "out"
    assert run("bench", [*argv, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err, err
    assert not out.exists()


def test_output_dir_that_is_a_file_is_refused(tmp_path, capsys):
    from accum_kit.cli import run

    f = tmp_path / "file"
    f.write_text("x")
    assert run("bench", ["--output_dir", str(f)]) == 2
    assert "--output_dir" in capsys.readouterr().err
    assert f.read_text() == "x"


def test_cli_lists_and_dispatches_bench(capsys):
    from accum_kit.cli import main

    assert main(["bench", "--accumulation_steps", "0"]) == 2
    assert "--accumulation_steps" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "bench" in capsys.readouterr().out


def test_report_side_imports_nothing_from_the_sweep():
    """One-way dependency: config <- sweep (and the parts) -> records; report, tables and files never import the
    sweep side."""
    import ast
    from pathlib import Path

    import accum_kit.bench

    pkg = Path(accum_kit.bench.__file__).parent
    sweep_side = {"sweep", "parts", "part_ddp", "part_tune", "part_fsdp2", "part_zero", "part_compiled", "part_single",
                  "peers", "runs", "run_records", "peak_memory", "peak_flops", "bench_data", "torch", "accum_kit.bench.sweep"}
    for name in ("bench_report.py", "report_ddp.py", "report_tune.py", "report_fsdp2.py", "report_zero.py",
                 "report_compiled.py", "report_single.py", "bench_tables.py", "bench_files.py"):
        tree = ast.parse((pkg / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        assert not imported & sweep_side, (name, imported)


def test_old_bench_module_names_are_the_moved_modules():
    """``accum_kit.bench.report`` and the other names bench's modules had keep importing, as the same objects."""
    import importlib

    from accum_kit import MOVED_MODULES

    moved = {old: new for old, new in MOVED_MODULES.items() if old.startswith("bench.")}
    assert {"bench.config", "bench.data", "bench.report", "bench.tables", "bench.zero", "bench.fsdp"} <= set(moved)
    for old, new in moved.items():
        assert importlib.import_module(f"accum_kit.{old}") is importlib.import_module(f"accum_kit.{new}"), old


def test_variable_target_labels_keep_inputs_and_at_least_one_target():
    from accum_kit.bench.bench_data import synthetic_tokens, variable_target_labels

    tokens = synthetic_tokens(64, 16, 384, seed=1)
    labels = variable_target_labels(tokens, seed=2)
    assert labels.shape == tokens.shape
    kept = (labels != -100).sum(dim=1)
    assert int(kept.min()) >= 2 and int(kept.max()) <= 16 and len(set(kept.tolist())) > 5
    for row, lab, n in zip(tokens, labels, kept.tolist()):  # a prefix of the row's own tokens, then -100
        assert lab[:n].tolist() == row[:n].tolist() and (lab[n:] == -100).all()


def test_ideal_speedup_formula():
    from accum_kit.bench.report_ddp import ideal_speedup

    assert ideal_speedup(1, 0.3, 0.1) == pytest.approx(1.0)
    assert ideal_speedup(8, 0.2, 0.2) == pytest.approx((1.6 + 1.6) / (1.6 + 0.2))
    assert ideal_speedup(16, 1.0, 0.0) == pytest.approx(1.0)


# --------------------------------------------------------------------------- the launched sweep


def test_output_files_exist_parse_and_leave_no_temp_files(bench):
    out = bench["out"]
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert jh.staging_leftovers(out) == []
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.json", "bench.png"]


def test_csv_has_one_row_per_preset_k_mode_matching_the_json(bench):
    rows, js = bench["csv"], bench["json"]["rows"]
    assert len(rows) == len(PRESETS) * len(KS) * len(MODES) == len(js)
    assert sorted((r["preset"], int(r["K"]), r["mode"]) for r in rows) == sorted(
        (p, k, m) for p in PRESETS for k in KS for m in MODES)
    for r, j in zip(rows, js):
        assert (r["preset"], int(r["K"]), r["mode"]) == (j["preset"], j["K"], j["mode"])
        for key in ("step_s_median", "ideal_speedup", "allreduce_calls_per_step", "peak_rss_mb"):
            assert float(r[key]) == pytest.approx(j[key], rel=1e-12)


def test_schedule_runs_and_steps(bench):
    runs = bench["json"]["runs"]
    assert len(runs) == len(PRESETS) * REPEATS * len(KS) * len(MODES)
    for r in runs:
        assert len(r["step_seconds"]) == STEPS and len(r["optimizer_seconds"]) == STEPS
        assert len(r["losses"]) == WARMUP + STEPS
        assert len(r["micro_batches"]) == STEPS * r["K"]  # measured micro-batches only
        assert all(math.isfinite(x) and x > 0 for x in r["step_seconds"])
        # the timed phases lie inside the step: what is left over is >= 0
        assert len(r["other_seconds"]) == STEPS and all(x >= -1e-9 for x in r["other_seconds"])
    # Rotated order: consecutive (repeat, K) blocks start with different modes.
    for p in PRESETS:
        firsts = [r["mode"] for r in runs if r["preset"] == p and r["position"] == 0]
        assert firsts == [MODES[i % len(MODES)] for i in range(len(firsts))]


def test_medians_and_spread_come_from_the_measured_steps(bench):
    js = bench["json"]
    for row in js["rows"]:
        steps = [s for r in js["runs"] if (r["preset"], r["K"], r["mode"]) == (row["preset"], row["K"], row["mode"])
                 for s in r["step_seconds"]]
        assert row["n_steps"] == len(steps) == REPEATS * STEPS
        assert row["step_s_median"] == pytest.approx(statistics.median(steps))
        assert row["step_s_min"] == pytest.approx(min(steps)) and row["step_s_max"] == pytest.approx(max(steps))


def paired(runs, K, num, den):
    """Median over repeats of the ratio of the two runs' median step times in that repeat."""
    ratios = []
    for rep in range(REPEATS):
        t = {r["mode"]: statistics.median(r["step_seconds"]) for r in runs if r["K"] == K and r["repeat"] == rep}
        ratios.append(t[num] / t[den])
    return statistics.median(ratios)


def test_c_and_a_from_phase_times_and_ideal_arithmetic(bench):
    js = bench["json"]
    for p in PRESETS:
        runs = [r for r in js["runs"] if r["preset"] == p]
        c = statistics.median(m["forward_s"] + m["backward_s"] for r in runs if r["mode"] == "no_sync"
                              for m in r["micro_batches"] if not m["sync"])
        bwd_sync = statistics.median(m["backward_s"] for r in runs if r["mode"] == "sync_each_batch" for m in r["micro_batches"])
        bwd_free = statistics.median(m["backward_s"] for r in runs if r["mode"] == "no_sync"
                                     for m in r["micro_batches"] if not m["sync"])
        info = js["presets"][p]
        assert info["c_seconds"] == pytest.approx(c)
        assert info["a_seconds"] == pytest.approx(max(bwd_sync - bwd_free, 0.0))
        c, a = info["c_seconds"], info["a_seconds"]
        for d in (d for d in js["per_k"] if d["preset"] == p):
            K = d["K"]
            med = {r["mode"]: r["step_s_median"] for r in js["rows"] if r["preset"] == p and r["K"] == K}
            assert d["ideal_no_sync_step_s"] == pytest.approx(K * c + a)
            assert d["ideal_sync_each_batch_step_s"] == pytest.approx(K * c + K * a)
            assert d["ideal_speedup"] == pytest.approx((K * c + K * a) / (K * c + a))
            assert d["speedup"] == pytest.approx(paired(runs, K, "sync_each_batch", "no_sync"))
            assert d["speedup_of_pooled_medians"] == pytest.approx(med["sync_each_batch"] / med["no_sync"])
            assert d["fraction_of_ideal"] == pytest.approx(d["speedup"] / d["ideal_speedup"])
            assert d["no_sync_over_raw_ddp"] == pytest.approx(paired(runs, K, "no_sync", "raw_ddp"))
            assert d["no_sync_over_raw_ddp_of_pooled_medians"] == pytest.approx(med["no_sync"] / med["raw_ddp"])
            assert d["overhead_s"] == pytest.approx(med["no_sync"] - (K * c + a))
            if K == 1:
                assert d["ideal_speedup"] == pytest.approx(1.0)


def _gradient_bytes(preset: str) -> int:
    """Bytes of all trainable parameters, from a model built here (tied weights counted once)."""
    from accum_kit.job.models import build_model

    model = build_model(preset, VOCAB, BLOCK, seed=0)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def test_allreduce_counts_and_bytes_are_k_times_fewer_with_no_sync(bench):
    js = bench["json"]
    for p in PRESETS:
        grad_bytes = _gradient_bytes(p)
        assert js["presets"][p]["gradient_bytes"] == grad_bytes
        for K in KS:
            row = {r["mode"]: r for r in js["rows"] if r["preset"] == p and r["K"] == K}
            calls_once = row["no_sync"]["allreduce_calls_per_step"]
            assert calls_once >= 1 and calls_once == int(calls_once)
            assert row["sync_each_batch"]["allreduce_calls_per_step"] == K * calls_once
            for once in ("raw_ddp", *PEERS):  # the same DDP bucket settings, one sync per window
                assert row[once]["allreduce_calls_per_step"] == calls_once, (p, K, once)
                assert row[once]["syncs_per_step"] == 1
            assert row["sync_each_batch"]["syncs_per_step"] == K
            assert row["no_sync"]["syncs_per_step"] == 1
            for mode, syncs in (("sync_each_batch", K), ("no_sync", 1), ("raw_ddp", 1), ("trainer", 1),
                                ("accelerate_guide", 1)):
                assert row[mode]["allreduce_mb_per_step"] * 2**20 == pytest.approx(syncs * grad_bytes)


def test_three_modes_compute_the_same_losses(bench):
    """Same weights, same data, same arithmetic: the loss of every step agrees across modes."""
    runs = bench["json"]["runs"]
    for p in PRESETS:
        for K in KS:
            losses = {r["mode"]: r["losses"] for r in runs if r["preset"] == p and r["K"] == K and r["repeat"] == 0}
            assert set(losses) == set(MODES)
            for mode in CORE:
                assert losses[mode] == pytest.approx(losses["no_sync"], rel=1e-5, abs=1e-6), (p, K, mode)
            # random tokens over a 384-id vocabulary: the first loss is about ln(384) = 5.95
            assert losses["no_sync"][0] == pytest.approx(math.log(VOCAB), abs=0.3)


def test_memory_is_recorded_per_run(bench):
    js = bench["json"]
    for p in PRESETS:
        assert "VmHWM" in js["presets"][p]["memory_method"]
    for r in js["runs"]:
        assert r["peak_rss_mb"] > 50 and r["peak_increase_mb"] >= 0


def test_bars_and_printed_table(bench):
    js, stdout = bench["json"], bench["res"].stdout
    bars = {b["name"]: b for b in js["bars"]}
    assert list(bars) == ["speedup", "fraction_of_ideal", "no_sync_vs_raw_ddp", "memory"]
    # No comm_heavy preset and no K=16 in this sweep: those bars are not measured.
    assert bars["speedup"]["passed"] is None and bars["fraction_of_ideal"]["passed"] is None
    assert bars["memory"]["passed"] is None
    worst = max(d["no_sync_over_raw_ddp"] for d in js["per_k"])
    assert bars["no_sync_vs_raw_ddp"]["value"] == pytest.approx(worst)
    # Judged by each K's interval, not by the point estimate: PASS only if every interval lies at or below 1.03,
    # FAIL if one lies wholly above it, else UNRESOLVED.
    intervals = [(d["no_sync_over_raw_ddp_ci_low"], d["no_sync_over_raw_ddp_ci_high"]) for d in js["per_k"]]
    verdict = ("FAIL" if any(lo > 1.03 for lo, _ in intervals) else
               "PASS" if all(hi <= 1.03 for _, hi in intervals) else "UNRESOLVED")
    assert bars["no_sync_vs_raw_ddp"]["verdict"] == verdict
    assert bars["no_sync_vs_raw_ddp"]["passed"] is {"PASS": True, "FAIL": False}.get(verdict)
    for p in PRESETS:
        assert f"{p}: " in stdout
    assert stdout.count("SKIP (not measured)") == 3
    assert f"{verdict}  no_sync / raw_ddp" in stdout
    cfg = js["config"]
    assert cfg["accumulation_steps"] == list(KS) and cfg["model_presets"] == list(PRESETS)
    assert js["command"].startswith("accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m accum_kit bench")
    assert js["machine"]["world_size"] == WORLD and js["machine"]["backend"] == "gloo"
    assert {"torch", "accelerate", "transformers"} <= set(js["versions"])


def test_peer_losses_and_their_difference_columns(bench):
    """The guide equals the token mean here (fixed lengths); Trainer is (BLOCK - 1) / BLOCK of it (GPT-2)."""
    js = bench["json"]
    for p in PRESETS:
        for K in KS:
            runs = {r["mode"]: r["losses"] for r in js["runs"] if r["preset"] == p and r["K"] == K and r["repeat"] == 0}
            exact = runs["no_sync"]
            assert runs["accelerate_guide"] == pytest.approx(exact, rel=1e-5, abs=1e-6), (p, K)
            assert runs["trainer"] == pytest.approx([x * (BLOCK - 1) / BLOCK for x in exact], rel=1e-5), (p, K)
            rows = {r["mode"]: r for r in js["rows"] if r["preset"] == p and r["K"] == K}
            csv_rows = {r["mode"]: r for r in bench["csv"] if r["preset"] == p and int(r["K"]) == K}
            for mode in MODES:
                d = [x - y for x, y in zip(runs[mode], exact)]
                assert rows[mode]["loss_max_abs_diff_vs_no_sync"] == pytest.approx(max(abs(x) for x in d), abs=1e-12)
                assert rows[mode]["loss_mean_diff_vs_no_sync"] == pytest.approx(sum(d) / len(d), abs=1e-12)
                assert float(csv_rows[mode]["loss_max_abs_diff_vs_no_sync"]) == pytest.approx(
                    rows[mode]["loss_max_abs_diff_vs_no_sync"], rel=1e-9, abs=1e-15)
                pruns = [r for r in js["runs"] if r["preset"] == p]
                assert rows[mode]["no_sync_over_mode"] == pytest.approx(paired(pruns, K, "no_sync", mode)), mode
            # Trainer: about ln(VOCAB) / BLOCK below the exact loss at these near-uniform initial predictions
            assert rows["trainer"]["loss_mean_diff_vs_no_sync"] == pytest.approx(-math.log(VOCAB) / BLOCK, rel=0.05)
            d = next(d for d in js["per_k"] if d["preset"] == p and d["K"] == K)
            for peer in PEERS:
                assert d[f"no_sync_over_{peer}"] == pytest.approx(rows[peer]["no_sync_over_mode"])
                assert d[f"loss_diff_{peer}"]["max_abs"] == pytest.approx(rows[peer]["loss_max_abs_diff_vs_no_sync"])
    stdout = bench["res"].stdout
    assert "no_sync / mode" in stdout and "guide's mean of" in stdout


def _t_interval(ratios, t):
    """exp(mean log r -+ t sd / sqrt(n)): the t-interval on the log ratios, written out here."""
    logs = [math.log(r) for r in ratios]
    m, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = t * sd / math.sqrt(len(logs))
    return math.exp(m - half), math.exp(m + half)


def _per_repeat(runs, K, num, den):
    out = []
    for rep in range(REPEATS):
        t = {r["mode"]: statistics.median(r["step_seconds"]) for r in runs if r["K"] == K and r["repeat"] == rep}
        out.append(t[num] / t[den])
    return out


def test_every_ratio_has_the_t_interval_of_its_per_repeat_ratios(bench):
    js = bench["json"]
    assert "t-interval on the log" in js["interval_method"]
    csv_rows = {(r["preset"], int(r["K"]), r["mode"]): r for r in bench["csv"]}
    for d in js["per_k"]:
        runs = [r for r in js["runs"] if r["preset"] == d["preset"]]
        names = {"speedup": ("sync_each_batch", "no_sync"), "no_sync_over_raw_ddp": ("no_sync", "raw_ddp"),
                 **{f"no_sync_over_{m}": ("no_sync", m) for m in MANUAL + PEERS}}
        for name, (num, den) in names.items():
            ratios = _per_repeat(runs, d["K"], num, den)
            lo, hi = _t_interval(ratios, T_0975_DF1)
            assert d[f"{name}_ci_low"] == pytest.approx(lo, rel=1e-4) and d[f"{name}_ci_high"] == pytest.approx(hi, rel=1e-4), name
            assert d[f"{name}_per_repeat"] == pytest.approx(ratios)
        assert d["fraction_of_ideal_ci_low"] == pytest.approx(d["speedup_ci_low"] / d["ideal_speedup"])
        for mode in MODES:
            row = csv_rows[(d["preset"], d["K"], mode)]
            lo, hi = _t_interval(_per_repeat(runs, d["K"], "no_sync", mode), T_0975_DF1) if mode != "no_sync" else (1, 1)
            assert float(row["no_sync_over_mode_ci_low"]) == pytest.approx(lo, rel=1e-4), mode
            assert float(row["no_sync_over_mode_ci_high"]) == pytest.approx(hi, rel=1e-4), mode
            assert float(row["speedup_ci_high"]) == pytest.approx(d["speedup_ci_high"], rel=1e-12)
            assert float(row["no_sync_over_raw_ddp_ci_low"]) == pytest.approx(d["no_sync_over_raw_ddp_ci_low"], rel=1e-12)
    # an interval that contains 1 is marked in the printed tables (t = 12.7 with 2 repeats: most do)
    assert "not resolved" in bench["res"].stdout


def test_fused_mode_is_the_loss_axis_against_no_sync(bench):
    """no_sync_fused (train_loop's default loss) against no_sync (the logits' loss, raw DDP's formula): one row per
    preset and K; same weights and data, so the first losses agree within 1e-6 relative; the ratio is the median of
    the per-repeat ratios with its t-interval, the memory saved the mean of the per-repeat differences of the rise."""
    js = bench["json"]
    axis = {(r["preset"], r["K"]): r for r in js["fused_loss"]}
    assert sorted(axis) == sorted((p, k) for p in PRESETS for k in KS)
    for (p, K), row in axis.items():
        assert (row["arm"], row["against"], row["n_pairs"]) == ("no_sync_fused", "no_sync", REPEATS)
        runs = [r for r in js["runs"] if r["preset"] == p]
        first = {(r["mode"], r["repeat"]): r["losses"][0] for r in runs if r["K"] == K}
        for rep in range(REPEATS):
            assert first[("no_sync_fused", rep)] == pytest.approx(first[("no_sync", rep)], rel=1e-6, abs=0), (p, K)
        assert row["first_loss_rel_diff"] <= 1e-6
        ratios = _per_repeat(runs, K, "no_sync_fused", "no_sync")
        assert row["fused_over_logits"] == pytest.approx(statistics.median(ratios))
        lo, hi = _t_interval(ratios, T_0975_DF1)
        assert (row["fused_over_logits_ci_low"], row["fused_over_logits_ci_high"]) == pytest.approx((lo, hi), rel=1e-4)
        rise = {(r["mode"], r["repeat"]): r["peak_increase_mb"] for r in runs if r["K"] == K}
        assert row["memory_saved_mb"] == pytest.approx(
            statistics.fmean(rise[("no_sync", rep)] - rise[("no_sync_fused", rep)] for rep in range(REPEATS)))
        assert row["predicted_saved_mb"] == js["presets"][p]["fused_loss_prediction"]["saved_mb"]
    assert {t["target"] for t in js["targets"]} == {
        f"K={K} no_sync_fused {what}" for K in KS for what in ("step not worse", "saves memory as predicted")}
    assert "the fused loss as its own axis" in bench["res"].stdout


def test_manual_allreduce_modes_count_one_collective_per_parameter_tensor_and_match_no_sync(bench):
    """Per-parameter mode: one all-reduce per parameter tensor of the model (built here); flat: one in all."""
    from accum_kit.job.models import build_model

    js = bench["json"]
    for p in PRESETS:
        model = build_model(p, VOCAB, BLOCK, seed=0)
        tensors = len([q for q in model.parameters() if q.requires_grad])  # tied weights once, as .grad is
        grad_bytes = _gradient_bytes(p)
        for K in KS:
            row = {r["mode"]: r for r in js["rows"] if r["preset"] == p and r["K"] == K}
            assert row["manual_allreduce"]["allreduce_calls_per_step"] == tensors, (p, K)
            assert row["manual_allreduce_flat"]["allreduce_calls_per_step"] == 1, (p, K)
            for mode in MANUAL:
                assert row[mode]["syncs_per_step"] == 1
                assert row[mode]["allreduce_mb_per_step"] * 2**20 == pytest.approx(grad_bytes)
                assert row[mode]["exposed_comm_s_per_sync"] is not None and row[mode]["exposed_comm_s_per_sync"] >= 0
                assert row[mode]["loss_max_abs_diff_vs_no_sync"] == pytest.approx(0, abs=1e-5)
            for rep in range(REPEATS):
                losses = {r["mode"]: r["losses"] for r in js["runs"] if (r["preset"], r["K"], r["repeat"]) == (p, K, rep)}
                for mode in MANUAL:
                    assert losses[mode] == pytest.approx(losses["no_sync"], rel=1e-5, abs=1e-6), (p, K, mode)


@pytest.fixture(scope="module")
def tune(launch):
    res = launch["tune_started"].result()
    assert res.returncode == 0, res.describe()
    out = launch["tune_out"]
    assert sorted(x.name for x in out.iterdir()) == ["tune.csv", "tune.json"]
    return {"res": res, "json": json.loads((out / "tune.json").read_text()),
            "csv": list(csv.DictReader((out / "tune.csv").open()))}


def test_tune_runs_every_setting_with_the_same_losses(tune):
    js, rows = tune["json"], tune["csv"]
    want = ["base", *(f"bucket_cap_mb={c:g}" for c in TUNE_CAPS), "gradient_as_bucket_view", "static_graph",
            "find_unused_parameters"]
    assert [r["setting"] for r in rows] == want
    assert json.loads(rows[want.index("static_graph")]["ddp_kwargs"]) == {"static_graph": True}
    runs = js["runs"]
    assert len(runs) == TUNE_REPEATS * len(want)
    for rep in range(TUNE_REPEATS):  # same weights, data and arithmetic: the same losses (static_graph included,
        # whose first backward had to synchronise: under no_sync first it fails, pytorch/pytorch#143580)
        losses = {r["mode"]: r["losses"] for r in runs if r["repeat"] == rep}
        assert set(losses) == set(want)
        for s in want:
            assert losses[s] == pytest.approx(losses["base"], rel=1e-5, abs=1e-6), s
    calls = {r["setting"]: float(r["allreduce_calls_per_step"]) for r in rows}
    assert calls["base"] == calls["bucket_cap_mb=100"] == 1  # the tiny model fits DDP's first bucket
    assert calls["bucket_cap_mb=0.01"] > 1


def test_tune_ratios_intervals_and_recommendation(tune):
    js, rows = tune["json"], tune["json"]["rows"]
    for r in rows:
        runs = [x for x in js["runs"] if x["mode"] in (r["setting"], "base")]
        ratios = []
        for rep in range(TUNE_REPEATS):
            t = {x["mode"]: statistics.median(x["step_seconds"]) for x in runs if x["repeat"] == rep}
            ratios.append(t[r["setting"]] / t["base"])
        assert r["over_base"] == pytest.approx(statistics.median(ratios))
        if r["setting"] != "base":
            lo, hi = _t_interval(ratios, T_0975_DF2)
            assert (r["over_base_ci_low"], r["over_base_ci_high"]) == (pytest.approx(lo, rel=1e-4), pytest.approx(hi, rel=1e-4))
        assert r["exposed_limit_s"] == pytest.approx(max(r["allreduce_s_per_sync"] - r["backward_no_sync_s"], 0.0))
        assert r["exposed_comm_s_per_sync"] == pytest.approx(max(r["backward_sync_s"] - r["backward_no_sync_s"], 0.0))
    faster = [r for r in rows if r["setting"] != "base" and r["over_base_ci_high"] < 1]
    rec = js["recommendations"]["tiny"]
    assert rec["best"] == (min(faster, key=lambda r: r["over_base"])["setting"] if faster else None)
    assert "recommendation: " + rec["text"] in tune["res"].stdout


# --------------------------------------------------------------------------- --gradient_checkpointing_ab
AB_K, AB_LAYERS = 2, 2  # tiny preset: 2 blocks (accum_kit/job/models.py)
AB_POLICIES = ("sync_each_batch", "no_sync")  # two of FSDP2's four: the twin is the same code for every policy
AB_ARGS = ["--gradient_checkpointing_ab", "--quick", "--model_presets", "tiny", "--accumulation_steps", str(AB_K),
           "--repeats", str(REPEATS), "--block_size", str(BLOCK)]


@pytest.fixture(scope="module")
def ab(tmp_path_factory, ddp_pool, fsdp_pool):
    """The A/B sweep under DDP and under FSDP2 (sync_each_batch and no_sync each), one command on each pool."""
    root = tmp_path_factory.mktemp("bench_ab")
    started = {"ddp": ddp_pool.submit("bench", [*AB_ARGS, "--modes", "sync_each_batch", "no_sync",
                                                 "--output_dir", root / "ddp"]),
               "fsdp2": fsdp_pool.submit("bench", [*AB_ARGS, "--steps", "1", "--accumulation_policies", *AB_POLICIES,
                                                   "--output_dir", root / "fsdp2"])}
    out = {}
    for name, pending in started.items():
        res = pending.result()
        assert res.returncode == 0, res.describe()
        out[name] = {"res": res, "json": json.loads((root / name / "bench.json").read_text())}
    return out


@pytest.mark.parametrize("part, arm_key, arms", [("ddp", "mode", ("sync_each_batch", "no_sync")),
                                                 ("fsdp2", "policy", AB_POLICIES)])
def test_checkpointing_ab_twins_recompute_and_their_ratio_rows(ab, part, arm_key, arms):
    """Every arm has a checkpointed twin run in every repeat; the twin ran each block's forward twice per micro-batch
    (hooks on the attention modules), its arm once; the twin's losses are the arm's (checkpointing is exact); the
    ratio row is the median of the per-pair ratios (DDP: per repeat; FSDP2: per repeat and cycle) with its t-interval."""
    js = ab[part]["json"]
    runs = [r for r in js["runs"] if r["K"] == AB_K]
    run_steps = js["config"]["warmup_steps"] + js["config"]["steps"] * (len(arms) if part == "fsdp2" else 1)
    by_arm = {a: [r for r in runs if r[arm_key] == a] for a in arms + tuple(f"{a}+gc" for a in arms)}
    assert set(r[arm_key] for r in runs) == set(by_arm)
    rows = {r["arm"]: r for r in js["presets"]["tiny"]["checkpointing"]}
    assert set(rows) == set(arms)
    for arm in arms:
        for name, twice in ((arm, 1), (f"{arm}+gc", 2)):
            assert sorted(r["repeat"] for r in by_arm[name]) == list(range(REPEATS)), name
            for rep in range(REPEATS):  # DDP: one run per arm; FSDP2: one run per model, its records one per policy
                run = [r for r in runs if r["repeat"] == rep and (r[arm_key] == name if part == "ddp"
                                                                  else r[arm_key].endswith("+gc") == (twice == 2))]
                assert sum(r["block_forwards"] for r in run) == twice * AB_LAYERS * run_steps * AB_K, (name, rep)
        for base, twin in zip(sorted(by_arm[arm], key=lambda r: r["repeat"]),
                              sorted(by_arm[f"{arm}+gc"], key=lambda r: r["repeat"])):
            assert twin["losses"] == pytest.approx(base["losses"], rel=1e-5, abs=1e-6)
        row = rows[arm]
        for key, prefix in (("step_seconds", ""), ("step_cpu_seconds", "cpu_")):
            if part == "fsdp2":  # pairs: the two models' windows of one (repeat, cycle)
                pairs = {}
                for side, rs in (("base", by_arm[arm]), ("twin", by_arm[f"{arm}+gc"])):
                    for r in rs:
                        for c, t in zip(r["cycles"], r[key]):
                            pairs.setdefault((r["repeat"], c), {})[side] = t
                ratios = [p["twin"] / p["base"] for _, p in sorted(pairs.items())]
            else:  # pairs: the two runs of one repeat
                med = {(r[arm_key], r["repeat"]): statistics.median(r[key]) for r in runs}
                ratios = [med[(f"{arm}+gc", rep)] / med[(arm, rep)] for rep in range(REPEATS)]
            assert len(ratios) == REPEATS
            assert row[f"{prefix}with_over_without"] == pytest.approx(statistics.median(ratios), rel=1e-9)
            lo, hi = _t_interval(ratios, T_0975_DF1)
            assert row[f"{prefix}ci_low"] == pytest.approx(lo, rel=1e-4)
            assert row[f"{prefix}ci_high"] == pytest.approx(hi, rel=1e-4)
        assert row["twin"] == f"{arm}+gc" and row["n_pairs"] == REPEATS
        assert row["block_forwards_per_micro_batch_without"] == 1 and row["block_forwards_per_micro_batch_with"] == 2
        assert row["peak_mb_without"] > 0 and row["peak_mb_with"] > 0 and row["peak_saved_mb"] is not None
    assert "activation checkpointing, tiny: step time with / without" in ab[part]["res"].stdout
