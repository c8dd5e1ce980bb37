"""torch.compile under accumulation: exact, no_sync honoured, no recompiles after warm-up, verify compiled.

(Flags refused or turned into settings, without compiling: tests/test_compile_flags.py.)

Two launches of tests/dist_worker.py run side by side (one module fixture), 2
gloo processes each, and compile with small backends so that the module stays
affordable on 2 shared CPU cores:

- DDP (accelerate_configs/cpu_ddp.yaml): ``no_sync`` and ``sync_each_batch``,
  each compiled with ``aot_eager`` and beside its eager twin; then, in the same
  processes (dist_worker's ``cli_runs``, each as if in a fresh process: dynamo
  and Accelerate reset), ``accum-kit verify --torch_compile_backend eager``, the
  train job with ``--torch_compile_backend eager --checkpointing_steps``, and
  the train job resumed from that checkpoint (``--resume_from_checkpoint latest``).
- FSDP2 (accelerate_configs/cpu_fsdp.yaml): ``no_sync`` compiled per block with
  ``aot_eager`` beside its eager twin, and ``no_sync_no_reshard`` compiled.

Meanwhile this process measures the floor and runs a one-process
``accum-kit verify --torch_compile_backend eager`` in-process.

Backends: ``aot_eager`` (dynamo's graph capture plus AOTAutograd's
functionalised forward and backward graphs, the part of inductor that rewrites
the arithmetic, without generating C++) where the numbers are checked;
``eager`` (dynamo only) where the check is about dynamo: recompiles, which
dynamo alone decides (its guards run before any backend), and that verify's
plumbing runs compiled. inductor is measured in docs/compile.md.

Cost: the smallest GPT-2 that has a transformer block for FSDP2 to shard and
compile per block (1 layer, width 16, ``use_cache=False``: training never
reads the KV cache, and building one only adds graph to trace); the
exactness scenarios pad every micro-batch to the longest example and compile
static shapes once (``dynamic=False``): AOTAutograd traces symbolic shapes
about 3 times slower here (5.8 s against 17.5 s of CPU for this model). Token
counts still vary from micro-batch to micro-batch (padding is masked), which
is what the normalisation depends on; the train job (``--packing false``)
covers lengths that vary under symbolic shapes.

Expected values come from outside accum_kit: parameters from the plain
single-process big-batch oracle of tests/test_exactness.py, collective counts
from the eager twin (DDP comm hook; torch.distributed.reduce_scatter_single
wrapped by the worker), verify's gradient norms from a plain float64 loss
written in tests/test_verify.py, recompiles from torch's own compile
callbacks, window sizes from the schedule's arithmetic done here.

Tolerance: the floor is measured here, on one process: the same padded batch
(the first window of 3 micro-batches), one SGD step, compiled vs eager; the
compiled multi-process run must then match the oracle within
``ex.ATOL + FLOOR_FACTOR * floor`` per step (docs/compile.md gives the values).
"""

from __future__ import annotations

import contextlib
import io
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
MODEL_CONFIG = {**ex.MODEL_CONFIG, "n_layer": 1, "use_cache": False}
PAD_TO = max(len(e["input_ids"]) for e in ex.EXAMPLES)  # one shape for every micro-batch: one static compile
VERIFY_K = 3


def _sc(name, compiled, **kw):
    # 1 MB buckets (the smallest compiled DDP accepts): the whole model in one bucket, for both twins
    return {**ex._sc(name, 3, **kw), "torch_compile_backend": BACKEND if compiled else None, "bucket_cap_mb": 1,
            "torch_compile_dynamic": False}


DDP_SCENARIOS = [_sc("comp_k3", True), _sc("eager_k3", False),
                 _sc("comp_k3_sync_each", True, sync_each_batch=True), _sc("eager_k3_sync_each", False, sync_each_batch=True)]
FSDP_SCENARIOS = [{**_sc("comp_k3_fsdp", True), "policy": "no_sync"}, {**_sc("eager_k3_fsdp", False), "policy": "no_sync"},
                  {**_sc("comp_k3_fsdp_no_reshard", True), "policy": "no_sync_no_reshard"}]
# activation checkpointing compiled: the whole model with transformers' checkpoints (DDP), Accelerate's checkpoint
# wrapper compiled per block (FSDP2); twins of comp_k3 and comp_k3_fsdp
CHECKPOINTED = {"comp_k3_gc": "comp_k3", "comp_k3_fsdp_gc": "comp_k3_fsdp"}
DDP_SCENARIOS.append({**_sc("comp_k3_gc", True), "gradient_checkpointing": True})
FSDP_SCENARIOS.append({**_sc("comp_k3_fsdp_gc", True), "policy": "no_sync", "gradient_checkpointing": True})
COMPILED = ["comp_k3", "comp_k3_sync_each", "comp_k3_fsdp", "comp_k3_fsdp_no_reshard", *CHECKPOINTED]
# LoRA adapters (peft) on a frozen model, compiled: the whole PeftModel under DDP, per block under FSDP2
LORA_COMPILED = {"comp_lora_k3": "ddp", "comp_lora_k3_fsdp": "fsdp"}
DDP_SCENARIOS.append({**_sc("comp_lora_k3", True), "lora": jh.LORA, "momentum": jh.LORA_MOMENTUM})
FSDP_SCENARIOS.append({**_sc("comp_lora_k3_fsdp", True), "policy": "no_sync", "lora": jh.LORA,
                       "momentum": jh.LORA_MOMENTUM})

# The train job: variable lengths (--packing false), K 2 then 3 (schedule), 60 examples: 15 micro-batches per
# process and epoch; evaluation before and after. The first run stops after 4 steps and saves step_4; the second
# resumes from it (latest) and runs to step 8 (into epoch 2). Evaluation runs first, so each run's first training
# window recompiles for grad mode (warm-up). A 1-layer, 16-wide GPT-2 (--config_name; ByT5's 384 byte tokens).
JOB_SAMPLES, JOB_B, JOB_SCHEDULE, JOB_STEPS, JOB_CKPT = 60, 2, {0: 2, 2: 3}, 8, 4
JOB_MODEL = dict(vocab_size=384, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=1, eos_token_id=1,
                 pad_token_id=0)  # ByT5: pad 0, eos 1


def _job_flags(root, corpus):
    return ["--config_name", root / "job_model", "--block_size", "32", "--packing", "false",
            "--per_device_train_batch_size", JOB_B, "--max_train_samples", JOB_SAMPLES, "--max_eval_samples", "10",
            "--accumulation_schedule", ",".join(f"{s}:{k}" for s, k in JOB_SCHEDULE.items()),
            "--torch_compile_backend", "eager", "--logging_steps", "4", "--train_file", corpus,
            "--output_dir", root / "job"]


def _cli_runs(root, corpus):
    """verify on 2 processes, the train job to step 4 (checkpoint), then resumed from it: after the scenarios."""
    job = _job_flags(root, corpus)
    summary = str(root / "job" / "train_summary.json")
    return [
        {"name": "verify", "command": "verify", "argv": ["--torch_compile_backend", "eager", "--gradient_accumulation_steps",
                                                         VERIFY_K, "--no_trainer_row", "--json", root / "verify_w2.json"]},
        {"name": "job", "command": "train", "collect": summary,
         "argv": [*job, "--max_train_steps", JOB_CKPT, "--checkpointing_steps", JOB_CKPT]},
        {"name": "job_resumed", "command": "train", "collect": summary,
         "argv": [*job, "--max_train_steps", JOB_STEPS, "--resume_from_checkpoint", "latest"]},
    ]


def _worker_cmd(root, name, scenarios, config, **extra):
    spec = {"model_config": MODEL_CONFIG, "seed": ex.SEED, "lr": ex.LR, "pad_id": ex.PAD_ID, "pad_to": PAD_TO,
            "examples": ex.EXAMPLES, "scenarios": scenarios, **extra}
    (root / f"{name}.json").write_text(json.dumps(spec, default=str))
    return jh.accelerate_launch_cmd(ex.WORKER, root / f"{name}.json", root / name, config=config)


def compile_floor(backend: str = BACKEND) -> float:
    """Largest |parameter| difference after one SGD step on one process: compiled vs eager, same padded batch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from accum_kit.core.loss import causal_lm_loss

    batch = jh.pad_collate(ex.PAD_ID, PAD_TO)([e for micro in ex.windows_for(1, 3)[0] for e in micro])
    params = []
    for compiled in (False, True):
        torch.manual_seed(ex.SEED)
        model = GPT2LMHeadModel(GPT2Config(**MODEL_CONFIG))
        run = torch.compile(model, backend=backend, dynamic=False) if compiled else model
        summed, n = causal_lm_loss(run, batch)
        (summed / n).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= ex.LR * p.grad
        params.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    torch._dynamo.reset()
    return max((params[0][k] - params[1][k]).abs().max().item() for k in params[0])


def verify_in_process(root) -> dict:
    """``accum-kit verify --torch_compile_backend eager`` on this one process; with torch's own frame count."""
    from torch._dynamo.utils import counters

    from accum_kit.cli import run

    out = root / "verify_w1.json"
    frames = counters["frames"]["ok"]
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        for var in (*jh.LAUNCHER_VARS, "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE"):
            mp.delenv(var, raising=False)
        jh.reset_accelerate_state()
        try:
            code = run("verify", ["--torch_compile_backend", "eager", "--gradient_accumulation_steps", str(VERIFY_K),
                                  "--no_trainer_row", "--json", str(out)])
        finally:
            jh.reset_accelerate_state()
    result = {"exit_code": code, "stdout": stdout.getvalue(), "frames_compiled": counters["frames"]["ok"] - frames}
    torch._dynamo.reset()
    result["report"] = json.loads(out.read_text()) if out.exists() else None
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import GPT2Config

    root = tmp_path_factory.mktemp("compile")
    corpus = jh.write_corpus(root / "corpus.txt")
    GPT2Config(**JOB_MODEL).save_pretrained(root / "job_model")
    # the workers run as scripts from tests/: this checkout's accum_kit, whatever else is installed
    env = jh.clean_env(HF_DATASETS_CACHE=str(root / "hf_cache"), PYTHONPATH=str(jh.REPO))
    started = {
        "ddp": jh.start(_worker_cmd(root, "ddp", DDP_SCENARIOS, jh.DDP_CONFIG, cli_runs=_cli_runs(root, corpus)),
                        env, root / "logs", "ddp"),
        "fsdp": jh.start(_worker_cmd(root, "fsdp", FSDP_SCENARIOS, FSDP_CONFIG), env, root / "logs", "fsdp"),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        floor = compile_floor()
        verify_w1 = verify_in_process(root)
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
    for name in ("job", "job_resumed"):
        out[name] = json.loads((root / "ddp" / f"{name}.json").read_text())
    out["verify_w2"] = json.loads((root / "verify_w2.json").read_text())
    out["verify_w1"] = verify_w1
    out["floor"] = floor
    return out


def _tolerance(floor: float) -> float:
    return ex.ATOL + FLOOR_FACTOR * floor


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_run_matches_the_big_batch_within_the_measured_floor(runs, name):
    run = runs[name]
    assert len(ex.windows_for(W, 3)[-1]) < 3 * W, "scenario lacks a partial window"
    for info in run["ranks"]:
        settings = info["compile_settings"]
        assert settings["backend"] == BACKEND and settings["regional"] == ("fsdp" in name), settings
        assert settings["dynamic"] is False, "the scenarios compile one static shape"
        # compiled: a torch.compile wrapper (DDP), or blocks compiled in place (FSDP2); a later scenario of the
        # same launch may reuse the first one's compiled code (same code, guards hold) and count no compile
        if settings["regional"]:
            assert info["modules_compiled_in_place"] > 0, "no module compiled in place"
        else:
            assert info["model_class"] == "OptimizedModule", "not compiled"
        assert info["accumulation_policy"] == run["scenario"].get("policy", "sync_each_batch" if "sync_each" in name
                                                                  else "no_sync")
    params, losses = ex.oracle_run(run["init"], ex.windows_for(W, 3), "tokens", 3, W, model_config=MODEL_CONFIG)
    tol = _tolerance(runs["floor"])
    worst = max(ex.max_excess(got, want)[0] for got, want in zip(run["steps"], params))
    assert len(run["steps"]) == len(params)
    assert worst <= tol, f"{name}: largest |param - oracle| {worst:.2e} > {tol:.2e} (floor {runs['floor']:.2e})"
    tokens = [l["tokens_count"] for l in losses]
    assert len(set(tokens)) > 1, "token counts should vary from window to window"
    for info in run["ranks"]:
        assert info["step_tokens"] == tokens
        assert info["train_loss"] == pytest.approx([l["tokens"] for l in losses], rel=ex.LOSS_RTOL)
    print(f"\n{name}: largest |param - oracle| {worst:.2e}, floor {runs['floor']:.2e}, tolerance {tol:.2e}")


@pytest.mark.parametrize("compiled,eager", [("comp_k3", "eager_k3"), ("comp_k3_sync_each", "eager_k3_sync_each")])
def test_compiled_ddp_all_reduces_where_eager_does(runs, compiled, eager):
    for got, want in zip(runs[compiled]["ranks"], runs[eager]["ranks"]):
        assert got["comm_hook_registered"] and want["comm_hook_registered"]
        calls = [m["allreduce_calls"] for m in got["micro"]]
        assert calls == [m["allreduce_calls"] for m in want["micro"]], f"rank {got['rank']}: {calls}"
        assert [c > 0 for c in calls] == [m["sync"] for m in got["micro"]], (calls, [m["sync"] for m in got["micro"]], [m["boundary"] for m in got["micro"]])
        assert got["stray_allreduce_calls"] == 0


def test_compiled_fsdp_reduce_scatters_where_eager_does(runs):
    for got, want, no_reshard in zip(runs["comp_k3_fsdp"]["ranks"], runs["eager_k3_fsdp"]["ranks"],
                                     runs["comp_k3_fsdp_no_reshard"]["ranks"]):
        assert got["is_fsdp2"] and no_reshard["is_fsdp2"]
        calls = [m["reduce_scatter_calls"] for m in got["micro"]]
        assert calls == [m["reduce_scatter_calls"] for m in want["micro"]], f"rank {got['rank']}: {calls}"
        assert [c > 0 for c in calls] == [m["boundary"] for m in got["micro"]]
        # no_sync_no_reshard keeps the gathered parameters over the window; it still reduce-scatters on boundaries only
        assert [m["reduce_scatter_calls"] > 0 for m in no_reshard["micro"]] == [m["boundary"] for m in no_reshard["micro"]]


def _schedule(micro_batches: int, steps: int) -> tuple[list[int], list[int]]:
    """(K per optimizer step, micro-batches per window) of the job: K from the schedule's largest key <= the
    number of steps done; a window ends after K micro-batches or at the end of the epoch (a partial window)."""
    ks, sizes, left = [], [], micro_batches
    while len(sizes) < steps:
        ks.append(JOB_SCHEDULE[max(s for s in JOB_SCHEDULE if s <= len(sizes))])
        sizes.append(min(ks[-1], left))
        left = left - sizes[-1] or micro_batches
    return ks, sizes


def _no_recompile_after_warmup(comp):
    assert comp["backend"] == "eager" and not comp["regional"] and comp["dynamic"] is True
    assert comp["compiles"] > 0 and comp["graphs"] > 0 and comp["compile_seconds"] > 0, "compiled nothing"
    assert comp["recompiles_after_warmup"] == 0, json.dumps(comp["recompile_reasons"], indent=1)


def test_a_recompile_after_warmup_is_counted_with_its_reason_and_phase():
    """The positive control of the two tests below: without it, a watch that never left warm-up would pass them.
    In this process, a function compiled with ``backend="eager", dynamic=False`` and driven through
    CompileWatch's loop hooks: step 1 (warm-up) compiles it for shape (4, 8); step 2 runs that shape again (no
    compile) and then shape (6, 8), which dynamo must recompile (its guards are on the static sizes). Expected
    from dynamo's own counter (a second unique graph), not from the watch."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    from accum_kit.engines.compiling import CompileWatch

    torch._dynamo.reset()
    watch = CompileWatch(warmup_steps=1)
    try:
        fn = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
        graphs0 = counters["stats"]["unique_graphs"]
        watch.on_micro_batch_begin(SimpleNamespace(step=0))
        fn(torch.ones(4, 8))
        watch.on_step_end(SimpleNamespace(step=1))  # the end of warm-up
        watch.on_micro_batch_begin(SimpleNamespace(step=1))
        fn(torch.ones(4, 8))
        assert watch.summary()["recompiles"] == 0 and counters["stats"]["unique_graphs"] - graphs0 == 1
        fn(torch.ones(6, 8))  # another static shape: dynamo recompiles
        assert counters["stats"]["unique_graphs"] - graphs0 == 2, "dynamo did not recompile: no control"
        s = watch.summary()
    finally:
        watch.close()
        torch._dynamo.reset()
    assert s["compiles"] == 2 and s["recompiles"] == 1 and s["recompiles_after_warmup"] == 1, s
    (reason,) = s["recompile_reasons"]
    assert reason["phase"] == "optimizer step 2", reason
    assert "size mismatch" in reason["reason"] and "expected 4, actual 6" in reason["reason"], reason


@pytest.mark.parametrize("name", list(CHECKPOINTED))
def test_compiled_checkpointed_run_trains_as_its_compiled_twin(runs, name):
    """Checkpointing inside the compiled model: the plan recorded it and the losses are the compiled twin's (the
    update within the compiled tolerance of the big batch: the test above). No Python hook runs in a compiled
    recompute, so recompute is not counted here (it is under every eager engine)."""
    run, twin = runs[name], runs[CHECKPOINTED[name]]
    for info, plain in zip(run["ranks"], twin["ranks"]):
        assert info["gradient_checkpointing"] and not plain["gradient_checkpointing"]
        gap = max(abs(a - b) / abs(b) for a, b in zip(info["train_loss"], plain["train_loss"]))
        assert len(info["train_loss"]) == len(plain["train_loss"]) and gap <= ex.LOSS_RTOL, gap
    print(f"\n{name}: largest loss gap to {CHECKPOINTED[name]} {gap:.1e}")


def test_no_recompile_after_warmup_across_windows_eval_and_a_k_change(runs):
    summary = runs["job"]
    ks, sizes = _schedule(JOB_SAMPLES // (JOB_B * W), JOB_CKPT)  # 15 micro-batches per process and epoch
    assert summary["gradient_accumulation_steps_per_step"] == ks and len(set(ks[1:])) > 1, "no K change after warm-up"
    assert summary["micro_batches_per_process"] == sum(sizes) and summary["checkpoints"] == [f"step_{JOB_CKPT}"]
    _no_recompile_after_warmup(summary["compile"])
    comp = summary["compile"]
    print(f"\njob: {comp['compiles']} compiles, {comp['graphs']} graphs, {comp['recompiles']} recompiles "
          f"(all in warm-up: {[r['reason'] for r in comp['recompile_reasons']]})")


def test_no_recompile_after_warmup_when_resumed_from_a_checkpoint(runs):
    summary = runs["job_resumed"]
    per_epoch = JOB_SAMPLES // (JOB_B * W)
    ks, sizes = _schedule(per_epoch, JOB_STEPS)
    assert summary["resumed_from_step"] == JOB_CKPT and summary["resumed_from"].endswith(f"step_{JOB_CKPT}")
    assert summary["gradient_accumulation_steps_per_step"] == ks and summary["epochs"] == 2
    assert summary["micro_batches_per_process"] == sum(sizes), "windows after the resume"
    resumed = sizes[JOB_CKPT:]
    assert any(n < k for n, k in zip(resumed[1:], ks[JOB_CKPT + 1:])), "no partial window after the resume's warm-up"
    # a fresh dynamo (as in a new process): the resumed run compiles again, all of it in its first window
    _no_recompile_after_warmup(summary["compile"])
    comp = summary["compile"]
    assert all(r["phase"] in ("before training", f"optimizer step {JOB_CKPT + 1}") for r in comp["recompile_reasons"])
    print(f"\nresumed job: {comp['compiles']} compiles, {comp['graphs']} graphs, {comp['recompiles']} recompiles "
          f"(phases {[r['phase'] for r in comp['recompile_reasons']]})")


# --------------------------------------------------------------------------- verify compiled


def _verify_report_checks(rep, world):
    """A compiled verify report: compiled by dynamo, passes as an eager one does, its norms recomputed here."""
    import test_verify as tv
    from accum_kit.job.models import build_model

    comp = rep["compile"]
    assert comp is not None and comp["backend"] == "eager" and comp["dynamic"] is True and not comp["regional"]
    assert comp["compiles"] > 0 and comp["recompiles"] == 0, comp["recompile_reasons"]
    assert rep["world_size"] == world and rep["gradient_accumulation_steps"] == VERIFY_K
    assert rep["passed"] and rep["rows"]["tokens"]["passed"] and not rep["rows"]["mean-of-means"]["passed"]
    m = rep["model"]
    model = build_model(m["preset"], m["vocab_size"], m["n_positions"], seed=m["init_seed"]).double().eval()
    for w, tok_w, sum_w in zip(rep["windows"], rep["rows"]["tokens"]["windows"], rep["rows"]["sum"]["windows"]):
        norm, tokens = tv._token_mean_grad_norm(model, w["input_ids"])
        assert tokens == w["target_tokens"]
        assert tok_w["grad_norm"] == pytest.approx(norm, rel=1e-5)  # what the compiled model's optimizer saw
        assert sum_w["grad_norm"] == pytest.approx(norm * tokens / world, rel=1e-5)
    assert len(rep["windows"]) == 2 and rep["windows"][1]["partial"]


def test_verify_compiled_on_one_process(runs):
    v = runs["verify_w1"]
    assert v["exit_code"] == 0, v["stdout"]
    assert v["frames_compiled"] > 0, "torch's dynamo compiled no frame"
    _verify_report_checks(v["report"], world=1)
    assert "compiled: torch.compile backend eager" in v["stdout"]


def test_verify_compiled_on_two_processes(runs):
    _verify_report_checks(runs["verify_w2"], world=W)
    assert runs["verify_w2"]["ddp_sum_ratio"] == pytest.approx(1 / W, abs=1e-4)


@pytest.mark.parametrize("name", list(LORA_COMPILED))
def test_compiled_lora_run_is_the_float64_big_batch_of_the_same_peft_model(runs, name):
    """A compiled PeftModel (the whole model under DDP, its blocks under FSDP2): each adapter parameter within the
    fp32 criterion of the float64 single-process PeftModel after every step, each frozen one bitwise unchanged,
    optimizer state for the adapters only (tests/lora_oracle.py); under DDP all-reduces on boundaries only."""
    import lora_oracle

    run = runs[name]
    for info in run["ranks"]:
        settings = info["compile_settings"]
        assert settings["backend"] == BACKEND and settings["regional"] == (LORA_COMPILED[name] == "fsdp"), settings
        if LORA_COMPILED[name] == "ddp":
            assert info["model_class"] == "OptimizedModule", "not compiled"
            calls = [m["allreduce_calls"] for m in info["micro"]]
            assert [c > 0 for c in calls] == [m["boundary"] for m in info["micro"]], calls
        else:
            assert info["modules_compiled_in_place"] > 0, "no module compiled in place"
    worst = lora_oracle.assert_lora_run(run, W, f"compiled {name}", model_config=MODEL_CONFIG)
    print(f"\ncompiled {name}: largest |adapter - float64 oracle| {worst:.2e}")
