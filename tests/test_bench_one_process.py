"""``accum-kit bench`` on one process: one small in-process sweep, checked against a float64 oracle and by arithmetic.

The sweep (``cli.run("bench", ...)`` in this process, no launcher variables: the one-process part) runs the
tiny preset at K = 2 with every arm (``kit`` with the logits' loss, ``kit_fused`` with the default fused loss,
``plain``, ``trainer``, ``accelerate_guide``), 3 repeats of 2 measured steps. Expected values come from:

- a float64 forward of the same model (built here from the preset and seed) on the same synthetic rows:
  the first step's loss of both kit arms, of the plain loop and of the guide; Trainer's, which counts every row's
  BLOCK labels before the shift of which BLOCK - 1 are targets, is that loss x (BLOCK - 1) / BLOCK; the fused
  arm's first loss equals the logits arm's within 1e-6 relative, and the loss axis's row restates the pair;
- the plain loop and the kit doing the same update on this fixed-length data: equal losses at every step;
- the flags (rows, runs, steps per run), the model's parameter count (counted here) and the JSON's own records:
  tokens/s, MFU, medians, and every ratio's 95 % interval recomputed with the textbook t quantile for 2 degrees
  of freedom (4.3027);
- the parameter count again for the tensor memory: every arm holds all gradients at once (4 bytes per parameter),
  and Trainer, with a new AdamW every run, also its two moments (8 bytes per parameter) more than the plain loop.

No timing is asserted. Cost: one in-process sweep of a few seconds (Trainer builds a new Trainer every run).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import statistics

import pytest

import job_helpers as jh

ARMS = ("kit", "kit_fused", "plain", "trainer", "accelerate_guide")  # the one-process default, in its order
K, STEPS, REPEATS, BLOCK, VOCAB, SEED = 2, 2, 3, 32, 384, 42
ARGS = ["--model_presets", "tiny", "--accumulation_steps", str(K), "--repeats", str(REPEATS), "--warmup_steps", "0",
        "--steps", str(STEPS), "--block_size", str(BLOCK)]
T_0975_DF2 = 4.3027  # Student t, 0.975 quantile, 2 degrees of freedom (any t table): REPEATS = 3


def _bench_in_process(argv: list[str]) -> tuple[int, str]:
    """``cli.run("bench", argv)`` in this process as on one process: no launcher variables, fresh Accelerate state
    (and dynamo's), one torch thread. Returns ``(exit code, what it printed)``."""
    import torch

    from accum_kit.cli import run

    printed = io.StringIO()
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        for name in jh.LAUNCHER_VARS:
            mp.delenv(name, raising=False)
        torch.set_num_threads(1)
        jh.reset_accelerate_state()
        try:
            with contextlib.redirect_stdout(printed):
                rc = run("bench", argv)
        finally:
            torch._dynamo.reset()
            jh.reset_accelerate_state()
            torch.set_num_threads(threads)
    return rc, printed.getvalue()


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The one-process sweep, run once in this process with no launcher variables and one torch thread."""
    out = tmp_path_factory.mktemp("one_process") / "out"
    rc, printed = _bench_in_process([*ARGS, "--output_dir", str(out)])
    assert rc == 0, printed[-3000:]
    return {"out": out, "stdout": printed, "json": json.loads((out / "bench.json").read_text()),
            "csv": list(csv.DictReader((out / "bench.csv").open()))}


def _oracle_first_loss() -> float:
    """The first window's token-mean loss in float64: the preset's model and the bench's synthetic rows (seed + 1),
    K micro-batches of one row, every position after the first a target."""
    import torch
    import torch.nn.functional as F

    from accum_kit.bench.bench_data import synthetic_tokens
    from accum_kit.job.models import build_model

    model = build_model("tiny", VOCAB, BLOCK, seed=SEED).double()
    rows = synthetic_tokens(K, BLOCK, VOCAB, SEED + 1)
    with torch.no_grad():
        logits = model(input_ids=rows).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), rows[:, 1:].reshape(-1)).item()


def test_files_rows_and_runs(one):
    js, out = one["json"], one["out"]
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.json"]
    assert jh.staging_leftovers(out) == []
    assert js["schema"] == "accum_kit.bench.one_process/1" and js["machine"]["world_size"] == 1
    assert js["config"]["modes"] == list(ARMS)
    assert [(r["K"], r["mode"]) for r in js["rows"]] == [(K, m) for m in ARMS]
    assert [(int(r["K"]), r["mode"]) for r in one["csv"]] == [(K, m) for m in ARMS]
    runs = js["runs"]
    assert len(runs) == REPEATS * len(ARMS)
    for r in runs:
        assert len(r["step_seconds"]) == len(r["step_cpu_seconds"]) == STEPS == len(r["losses"])
        assert all(x > 0 for x in r["step_seconds"]) and r["peak_mb"] > 0 and r["peak_increase_mb"] >= 0
    for rep in range(REPEATS):  # every arm once per repeat, the order rotated by one from block to block
        order = [r["mode"] for r in sorted((r for r in runs if r["repeat"] == rep), key=lambda r: r["position"])]
        assert order == list(ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)])


def test_kit_and_plain_losses_match_a_float64_oracle_and_each_other(one):
    runs, oracle = one["json"]["runs"], _oracle_first_loss()
    for r in runs:
        expected = oracle * (BLOCK - 1) / BLOCK if r["mode"] == "trainer" else oracle
        assert r["losses"][0] == pytest.approx(expected, rel=2e-6), r["mode"]
    for rep in range(REPEATS):
        by = {r["mode"]: r["losses"] for r in runs if r["repeat"] == rep}
        assert by["kit"] == pytest.approx(by["plain"], rel=1e-6, abs=0)
        assert by["accelerate_guide"] == pytest.approx(by["plain"], rel=1e-6, abs=0)
        assert by["kit_fused"][0] == pytest.approx(by["kit"][0], rel=1e-6, abs=0)
    rows = {r["mode"]: r for r in one["json"]["rows"]}
    assert rows["kit"]["loss_max_abs_diff_vs_plain"] <= 1e-5
    assert rows["kit"]["loss_first_rel_diff_vs_plain"] <= 2e-6
    # the loss axis: one row per K, the fused arm against the logits arm, its first losses those of the runs
    axis = one["json"]["fused_loss"]
    assert [(r["K"], r["arm"], r["against"]) for r in axis] == [(K, "kit_fused", "kit")]
    firsts = {(r["mode"], r["repeat"]): r["losses"][0] for r in runs}
    assert axis[0]["first_loss_fused"] == firsts[("kit_fused", 0)] and axis[0]["first_loss_logits"] == firsts[("kit", 0)]
    assert axis[0]["first_loss_rel_diff"] == pytest.approx(
        max(abs(firsts[("kit_fused", r)] - firsts[("kit", r)]) / firsts[("kit", r)] for r in range(REPEATS)))
    assert axis[0]["first_loss_rel_diff"] <= 1e-6 and rows["kit_fused"]["loss_first_rel_diff_vs_kit"] <= 1e-6


def _t_interval(ratios, t):
    """exp(mean log r -+ t sd / sqrt(n)): the t-interval on the log ratios, written out here."""
    logs = [math.log(r) for r in ratios]
    m, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = t * sd / math.sqrt(len(logs))
    return math.exp(m - half), math.exp(m + half)


def test_throughput_mfu_ratios_and_intervals_from_the_records(one):
    from accum_kit.job.models import build_model

    js = one["json"]
    info = js["presets"]["tiny"]
    parameters = sum(p.numel() for p in build_model("tiny", VOCAB, BLOCK).parameters())
    assert info["parameters"] == parameters
    peak = info["peak_flops"]
    assert peak["source"].startswith("measured:") and peak["dtype"] == "fp32" and peak["flops_per_s"] > 0
    assert info["logits_fp32_bytes"] == BLOCK * VOCAB * 4
    for row in js["rows"]:
        own = [r for r in js["runs"] if r["mode"] == row["mode"]]
        steps = [s for r in own for s in r["step_seconds"]]
        assert row["step_s_median"] == pytest.approx(statistics.median(steps))
        assert row["tokens_per_step"] == K * BLOCK
        assert row["tokens_per_s"] == pytest.approx(K * BLOCK / statistics.median(steps))
        assert row["mfu"] == pytest.approx(6 * parameters * row["tokens_per_s"] / peak["flops_per_s"])
        assert row["peak_mb"] == pytest.approx(statistics.median(r["peak_mb"] for r in own))
        if row["mode"] == "plain":
            assert row.get("over_plain") is None
            continue
        pairs = [("step_seconds", "over_plain", "plain"), ("step_cpu_seconds", "over_plain_cpu", "plain")]
        if row["mode"] != "kit":  # every other arm against the kit with the logits, too
            pairs += [("step_seconds", "over_kit", "kit"), ("step_cpu_seconds", "over_kit_cpu", "kit")]
        for key, prefix, den in pairs:
            ratios = []
            for rep in range(REPEATS):
                t = {r["mode"]: statistics.median(r[key]) for r in js["runs"] if r["repeat"] == rep}
                ratios.append(t[row["mode"]] / t[den])
            lo, hi = _t_interval(ratios, T_0975_DF2)
            assert row[prefix] == pytest.approx(statistics.median(ratios))
            assert (row[f"{prefix}_ci_low"], row[f"{prefix}_ci_high"]) == pytest.approx((lo, hi), rel=1e-4)
    kit = next(r for r in js["rows"] if r["mode"] == "kit")
    fused = next(r for r in js["rows"] if r["mode"] == "kit_fused")
    targets = {t["target"]: t for t in js["targets"]}
    # tensor memory (one untimed run per arm): every arm holds every gradient at once (4 bytes per parameter),
    # and Trainer, whose AdamW is new every run, also makes its two moments (8 bytes per parameter)
    tensors = info["tensor_peak"]["mb"][str(K)]
    assert set(tensors) == set(ARMS) and all(v >= 4 * parameters / 2**20 for v in tensors.values())
    assert tensors["trainer"] - tensors["plain"] == pytest.approx(8 * parameters / 2**20, rel=0.1)
    assert kit["tensor_peak_minus_plain_mb"] == pytest.approx(tensors["kit"] - tensors["plain"])
    assert fused["tensor_peak_minus_kit_mb"] == pytest.approx(tensors["kit_fused"] - tensors["kit"])
    axis = js["fused_loss"][0]
    assert axis["memory_saved_mb"] == pytest.approx(tensors["kit"] - tensors["kit_fused"])
    predicted = info["predicted_tensor_peak_mb"]
    assert axis["predicted_saved_mb"] == pytest.approx(predicted["mb"]["kit"] - predicted["mb"]["kit_fused"])
    assert fused["tensor_measured_over_predicted"] == pytest.approx(tensors["kit_fused"] / predicted["mb"]["kit_fused"])
    assert set(targets) == {f"K={K} {t}" for t in ("kit_over_plain", "kit_fused_over_plain", "kit_fused_peak_below_plain",
                                                   "kit_fused_peak_predicted", "kit_fused step not worse",
                                                   "kit_fused saves memory as predicted")}
    for arm in (kit, fused):
        assert targets[f"K={K} {arm['mode']}_over_plain"]["status"] == (
            "PASS" if arm["over_plain_ci_high"] <= 1.02 else "FAIL" if arm["over_plain_ci_low"] > 1.02 else "UNRESOLVED")
    assert "/ plain [95% CI]" in one["stdout"] and "kit_over_plain" in one["stdout"]
    assert "the fused loss as its own axis" in one["stdout"]


@pytest.mark.parametrize("argv, flag", [
    (["--max_grad_norm", "-1"], "--max_grad_norm"),
    (["--optim", "sgd"], "--optim"),
    (["--mixed_precision", "fp8"], "--mixed_precision"),
    (["--modes", "kit", "no_sync"], "--modes"),
    (["--tune"], "--tune"),
    (["--accumulation_policies", "no_sync"], "--accumulation_policies"),
])
def test_bad_input_on_one_process_exits_2_naming_the_flag(argv, flag, tmp_path, capsys, monkeypatch):
    from accum_kit.cli import run

    for name in jh.LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    assert run("bench", [*argv, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err, err
    assert not out.exists()


@pytest.mark.parametrize("argv, flag", [(["--max_grad_norm", "1"], "--max_grad_norm"),
                                        (["--mixed_precision", "bf16"], "--mixed_precision"),
                                        (["--modes", "kit"], "--modes")])
def test_one_process_flags_are_refused_on_two(argv, flag, tmp_path, capsys, monkeypatch):
    """Under a 2-process DDP launch (WORLD_SIZE=2; refused while the flags are read, before any launch is used)."""
    from accum_kit.cli import run

    for name in jh.LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "out"
    assert run("bench", [*argv, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err, err
    assert not out.exists()


def test_compiled_bench_runs_on_one_process(tmp_path):
    """``bench --torch_compile`` on one process (the one-GPU case: the prepared model is compiled itself, there is no
    DDP wrapper): dynamo's ``eager`` backend (tracing without code generation, so the arithmetic is eager's), K = 2,
    2 repeats of one step. Both arms' first loss is the float64 oracle's within fp32 rounding, every run has its
    step, and the compile was timed on one process."""
    out = tmp_path / "compiled"
    rc, printed = _bench_in_process(["--torch_compile_backend", "eager", "--model_presets", "tiny",
                                     "--accumulation_steps", str(K), "--repeats", "2", "--warmup_steps", "0", "--steps",
                                     "1", "--block_size", str(BLOCK), "--output_dir", str(out)])
    assert rc == 0, printed[-3000:]
    result = json.loads((out / "compile.json").read_text())
    assert result["world_size"] == 1 and result["backend"] == "eager"
    (preset,) = result["presets"]
    assert preset["compile_seconds"] > 0 and preset["recompiles_after_first_window"] == 0
    oracle = _oracle_first_loss()
    runs = preset["runs"]
    assert sorted((r["mode"], r["repeat"]) for r in runs) == sorted((m, rep) for m in ("eager", "compiled")
                                                                     for rep in range(2))
    for r in runs:
        assert len(r["step_seconds"]) == 1 and r["losses"][0] == pytest.approx(oracle, rel=1e-5), r
