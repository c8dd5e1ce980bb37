"""torch.compile under accumulation: exact, no_sync honoured, no recompiles after warm-up, bad flags refused.

Three launches run side by side (one module fixture): tests/dist_worker.py on 2
gloo processes under DDP (accelerate_configs/cpu_ddp.yaml) and under FSDP2
(cpu_fsdp.yaml), each with a compiled scenario and its eager twin, and the
train job on 2 processes with ``--torch_compile_backend eager``. Compiled
runs use small backends so that the tests stay affordable on 2 CPU cores:
``aot_eager`` (dynamo's graph capture plus AOTAutograd's functionalised
forward and backward graphs, the part of inductor that rewrites the
arithmetic, without generating C++) for the numbers, and ``eager`` (dynamo
only) for the recompile count, which dynamo alone decides (its guards run
before any backend). inductor is measured in docs/compile.md.

Expected values come from outside accum_kit: parameters from the plain
single-process big-batch oracle of tests/test_exactness.py, collective counts
from the eager twin (DDP comm hook; torch.distributed.reduce_scatter_single
wrapped by the worker), recompiles from torch's own compile callbacks.

Tolerance: the floor is measured here, on one process: the same padded batch
(the first window of 3 micro-batches), one SGD step, compiled vs eager; the
compiled multi-process run must then match the oracle within
``ex.ATOL + FLOOR_FACTOR * floor`` per step (docs/compile.md gives the values).
"""

from __future__ import annotations

import json

import pytest
import torch

import job_helpers as jh
import test_exactness as ex

W = 2
BACKEND = "aot_eager"
FLOOR_FACTOR = 10  # rounding of the compiled graph may grow over the run's steps; 10 floors cover 6 steps
TIMEOUT_S = 540
FSDP_CONFIG = jh.REPO / "accelerate_configs" / "cpu_fsdp.yaml"


def _sc(name, compiled, **kw):
    # 1 MB buckets (the smallest compiled DDP accepts): the whole model in one bucket, for both twins
    return {**ex._sc(name, 3, **kw), "torch_compile_backend": BACKEND if compiled else None, "bucket_cap_mb": 1}


DDP_SCENARIOS = [_sc("comp_k3", True), _sc("eager_k3", False),
                 _sc("comp_k3_sync_each", True, sync_each_batch=True), _sc("eager_k3_sync_each", False, sync_each_batch=True)]
FSDP_SCENARIOS = [{**_sc("comp_k3_fsdp", True), "policy": "no_sync"}, {**_sc("eager_k3_fsdp", False), "policy": "no_sync"}]
# train job: variable lengths (--packing false), K 2 then 3 (schedule), 15 micro-batches per process and epoch
# (windows 2, 2, 3, 3, 3, 2: the last partial), 8 steps (into epoch 2), evaluation before and after;
# evaluation runs first, so training's first window recompiles for grad mode (warm-up)
JOB_FLAGS = ["--model_preset", "tiny", "--block_size", "32", "--packing", "false", "--per_device_train_batch_size", "2",
             "--max_train_samples", "60", "--max_eval_samples", "10", "--accumulation_schedule", "0:2,2:3",
             "--max_train_steps", "8", "--torch_compile_backend", "eager", "--logging_steps", "4"]


def _worker_cmd(root, name, scenarios, config):
    spec = {"model_config": ex.MODEL_CONFIG, "seed": ex.SEED, "lr": ex.LR, "pad_id": ex.PAD_ID,
            "examples": ex.EXAMPLES, "scenarios": scenarios}
    (root / f"{name}.json").write_text(json.dumps(spec))
    return jh.accelerate_launch_cmd(ex.WORKER, root / f"{name}.json", root / name, config=config)


def compile_floor(backend: str = BACKEND) -> float:
    """Largest |parameter| difference after one SGD step on one process: compiled vs eager, same padded batch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from accum_kit.loss import causal_lm_loss

    batch = jh.pad_collate(ex.PAD_ID)([e for micro in ex.windows_for(1, 3)[0] for e in micro])
    params = []
    for compiled in (False, True):
        torch.manual_seed(ex.SEED)
        model = GPT2LMHeadModel(GPT2Config(**ex.MODEL_CONFIG))
        run = torch.compile(model, backend=backend) if compiled else model
        summed, n = causal_lm_loss(run, batch)
        (summed / n).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= ex.LR * p.grad
        params.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    torch._dynamo.reset()
    return max((params[0][k] - params[1][k]).abs().max().item() for k in params[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    corpus = jh.write_corpus(root / "corpus.txt")
    env = jh.clean_env(HF_DATASETS_CACHE=str(root / "hf_cache"))
    started = {
        "ddp": jh.start(_worker_cmd(root, "ddp", DDP_SCENARIOS, jh.DDP_CONFIG), env, root / "logs", "ddp"),
        "fsdp": jh.start(_worker_cmd(root, "fsdp", FSDP_SCENARIOS, FSDP_CONFIG), env, root / "logs", "fsdp"),
        "job": jh.start(jh.accelerate_launch_cmd("-m", "accum_kit", "train", *JOB_FLAGS, "--train_file", corpus,
                                                 "--output_dir", root / "job"), env, root / "logs", "job"),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        floor = compile_floor()
    finally:
        torch.set_num_threads(threads)
    failed = []
    for name, s in started.items():
        res = jh.finish(s, TIMEOUT_S)
        if res.returncode != 0:
            failed.append(f"{name} failed\n{res.describe()}")
    if failed:
        pytest.fail("\n\n".join(failed), pytrace=False)

    def load(d, sc):
        return {"scenario": sc, "init": torch.load(d / "init.pt", weights_only=True),
                "steps": torch.load(d / "steps.pt", weights_only=True),
                "ranks": [json.loads((d / f"rank{r}.json").read_text()) for r in range(W)]}

    out = {sc["name"]: load(root / "ddp" / sc["name"], sc) for sc in DDP_SCENARIOS}
    out.update({sc["name"]: load(root / "fsdp" / sc["name"], sc) for sc in FSDP_SCENARIOS})
    out["job"] = json.loads((root / "job" / "train_summary.json").read_text())
    out["floor"] = floor
    return out


def _tolerance(floor: float) -> float:
    return ex.ATOL + FLOOR_FACTOR * floor


@pytest.mark.parametrize("name", ["comp_k3", "comp_k3_sync_each", "comp_k3_fsdp"])
def test_compiled_run_matches_the_big_batch_within_the_measured_floor(runs, name):
    run = runs[name]
    assert len(ex.windows_for(W, 3)[-1]) < 3 * W, "scenario lacks a partial window"
    for info in run["ranks"]:
        settings = info["compile_settings"]
        assert settings["backend"] == BACKEND and settings["regional"] == name.endswith("fsdp"), settings
        # a later scenario of the same launch may reuse the first one's compiled code (same code, guards hold)
        assert info["model_class"] == "OptimizedModule" or info["compile"]["compiles"] > 0, "not compiled"
    params, losses = ex.oracle_run(run["init"], ex.windows_for(W, 3), "tokens", 3, W)
    tol = _tolerance(runs["floor"])
    worst = max(ex.max_excess(got, want)[0] for got, want in zip(run["steps"], params))
    assert len(run["steps"]) == len(params)
    assert worst <= tol, f"{name}: largest |param - oracle| {worst:.2e} > {tol:.2e} (floor {runs['floor']:.2e})"
    for info in run["ranks"]:
        assert info["step_tokens"] == [l["tokens_count"] for l in losses]
        assert info["train_loss"] == pytest.approx([l["tokens"] for l in losses], rel=ex.LOSS_RTOL)
    print(f"\n{name}: largest |param - oracle| {worst:.2e}, floor {runs['floor']:.2e}, tolerance {tol:.2e}")


@pytest.mark.parametrize("compiled,eager", [("comp_k3", "eager_k3"), ("comp_k3_sync_each", "eager_k3_sync_each")])
def test_compiled_ddp_all_reduces_where_eager_does(runs, compiled, eager):
    for got, want in zip(runs[compiled]["ranks"], runs[eager]["ranks"]):
        assert got["comm_hook_registered"] and want["comm_hook_registered"]
        calls = [m["allreduce_calls"] for m in got["micro"]]
        assert calls == [m["allreduce_calls"] for m in want["micro"]], f"rank {got['rank']}: {calls}"
        assert [c > 0 for c in calls] == [m["sync"] for m in got["micro"]]
        assert got["stray_allreduce_calls"] == 0


def test_compiled_fsdp_reduce_scatters_where_eager_does(runs):
    for got, want in zip(runs["comp_k3_fsdp"]["ranks"], runs["eager_k3_fsdp"]["ranks"]):
        assert got["is_fsdp2"]
        calls = [m["reduce_scatter_calls"] for m in got["micro"]]
        assert calls == [m["reduce_scatter_calls"] for m in want["micro"]], f"rank {got['rank']}: {calls}"
        assert [c > 0 for c in calls] == [m["boundary"] for m in got["micro"]]


def test_no_recompile_after_warmup_across_windows_eval_and_a_k_change(runs):
    summary = runs["job"]
    comp = summary["compile"]
    assert comp["backend"] == "eager" and not comp["regional"] and comp["dynamic"] is True
    assert summary["gradient_accumulation_steps_per_step"] == [2, 2, 3, 3, 3, 3, 3, 3], "schedule"
    # 15 micro-batches per process in epoch 1 (windows 2, 2, 3, 3, 3 and a partial 2), then 2 windows of 3
    assert summary["epochs"] == 2 and summary["micro_batches_per_process"] == 15 + 6, "no partial window"
    assert comp["compiles"] > 0 and comp["graphs"] > 0 and comp["compile_seconds"] > 0
    assert comp["recompiles_after_warmup"] == 0, json.dumps(comp["recompile_reasons"], indent=1)
    print(f"\njob: {comp['compiles']} compiles, {comp['graphs']} graphs, {comp['recompiles']} recompiles "
          f"(all in warm-up: {[r['reason'] for r in comp['recompile_reasons']]})")


# --------------------------------------------------------------------------- bad input (in-process, no compile)


@pytest.mark.parametrize("argv,flag", [
    (["--torch_compile_backend", "nope"], "--torch_compile_backend"),
    (["--torch_compile_mode", "fastest"], "--torch_compile_mode"),
    (["--torch_compile_backend", "aot_eager", "--torch_compile_mode", "max-autotune"], "--torch_compile_mode"),
])
def test_unknown_backend_or_mode_exits_2_naming_the_flag(tmp_path, capsys, argv, flag):
    from accum_kit.cli import run

    out = tmp_path / "out"
    assert run("train", [*argv, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}:" in err and "Fix:" in err, err
    assert not out.exists()


def test_a_backend_without_its_compiler_says_what_to_install(monkeypatch):
    import shutil

    from accum_kit.compiling import check_backend_available
    from accum_kit.errors import UsageError

    with pytest.raises(UsageError, match="pip install apache-tvm"):
        check_backend_available("tvm")  # registered with dynamo, its package is not installed here
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(UsageError, match="--torch_compile_backend: .*no C\\+\\+ compiler.*apt-get install g\\+\\+"):
        check_backend_available("inductor")


def test_ddp_buckets_below_one_mb_are_refused_when_compiling(monkeypatch):
    from accelerate.utils import DistributedDataParallelKwargs

    from accum_kit.compiling import check_ddp_buckets, dynamo_plugin_for
    from accum_kit.errors import UsageError

    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    with pytest.raises(UsageError, match="--ddp_bucket_cap_mb: 0.5 MB"):
        check_ddp_buckets(dynamo_plugin_for(backend="eager"), [DistributedDataParallelKwargs(bucket_cap_mb=0.5)])
    check_ddp_buckets(dynamo_plugin_for(backend="eager"), [DistributedDataParallelKwargs(bucket_cap_mb=1)])
    check_ddp_buckets(dynamo_plugin_for(backend="eager", fsdp=True), [DistributedDataParallelKwargs(bucket_cap_mb=0.5)])


def test_flags_build_accelerates_dynamo_plugin(monkeypatch):
    from accum_kit.compiling import dynamo_plugin_for

    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    assert dynamo_plugin_for() is None
    plugin = dynamo_plugin_for(torch_compile=True)
    assert plugin.backend.value == "INDUCTOR" and not plugin.use_regional_compilation
    assert dynamo_plugin_for(backend="aot_eager", fsdp=True).use_regional_compilation
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "EAGER")  # an accelerate config's dynamo_config
    assert dynamo_plugin_for(fsdp=True).backend.value == "EAGER"
    assert dynamo_plugin_for(fsdp=True).use_regional_compilation


def test_bench_figures_per_k_from_paired_runs():
    """Break-even and the paired ratio from hand-made runs (no compile): 2 repeats, compiled 0.8 s vs eager 1.0 s."""
    import math

    from accum_kit.bench.compiled import summarize_k

    runs = [{"K": 8, "repeat": rep, "mode": mode, "measured": [s], "losses": [1.0, 2.0 + (mode == "compiled") * 1e-7]}
            for rep, (e, c) in enumerate([(1.0, 0.8), (1.1, 0.77)]) for mode, s in (("eager", e), ("compiled", c))]
    row = summarize_k("tiny", runs, 8, compile_seconds=30.0)
    assert row["eager_step_seconds"] == pytest.approx(1.05) and row["compiled_step_seconds"] == pytest.approx(0.785)
    assert row["seconds_saved_per_step"] == pytest.approx(0.265)
    assert row["break_even_steps"] == pytest.approx(30.0 / 0.265)
    assert row["compiled_over_eager"]["geometric_mean"] == pytest.approx(math.sqrt(0.8 * 0.7))
    assert row["loss_max_abs_diff"] == pytest.approx(1e-7)
    lo, hi = row["break_even_steps_interval"]
    ci = row["compiled_over_eager"]
    assert lo == pytest.approx(30.0 / (1.05 * (1 - ci["low"]))) and (hi is None or hi > lo)
    slower = [{**r, "measured": [2.0]} if r["mode"] == "compiled" else r for r in runs]
    assert summarize_k("tiny", slower, 8, compile_seconds=30.0)["break_even_steps"] is None


@pytest.mark.parametrize("argv", [["--torch_compile", "--tune"], ["--torch_compile_backend", "nope"]])
def test_bench_compile_flags_are_checked(tmp_path, capsys, argv):
    from accum_kit.cli import run

    assert run("bench", [*argv, "--output_dir", str(tmp_path / "b")]) == 2
    assert "error: --torch_compile" in capsys.readouterr().err
