"""``--auto_find_batch_size``: real allocation failures under a real address-space limit, real processes.

tests/auto_batch_worker.py runs the train job after setting ``RLIMIT_AS`` inside one process at a chosen moment
(so torch's CPU allocator really fails: "DefaultCPUAllocator: can't allocate memory"). Three runs, started together:

- ``restarted``: 2 DDP processes under ``accelerate launch --max_restarts 2``; only rank 1 gets the limit, just before
  the optimizer step of the third window, in the first attempt only; a checkpoint every 2 steps. The group restarts
  with half the micro-batch and twice K, resumes from ``step_2`` and finishes;
- ``by_hand``: the same job started at that micro-batch and K (a command of conftest.py's ``ddp_pool``);
- ``one_process``: one process without a launcher, a micro-batch of 2; the limit in the backward of the first window
  (first attempt), then in the forward (second attempt, a micro-batch of 1): the job re-executes itself once, then
  exits 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import job_helpers as jh

WORKER = jh.REPO / "tests" / "auto_batch_worker.py"
B, K, WORLD, STEPS = 4, 1, 2, 4  # started at 4 x 1; settles on 2 x 2
FLAGS = ["--model_preset", "mini", "--block_size", "64", "--max_train_steps", str(STEPS), "--max_train_samples", "200",
         "--max_eval_samples", "16", "--num_warmup_steps", "0", "--logging_steps", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ddp_pool):
    work = tmp_path_factory.mktemp("auto_batch")
    corpus = jh.write_corpus(work / "corpus.txt")
    cache = work / "hf_cache"
    env = jh.clean_env(HF_DATASETS_CACHE=str(cache), AUTO_BATCH_RANK="1", AUTO_BATCH_AT="optimizer:2:0")
    restarted = jh.start(jh.accelerate_launch_cmd("--max_restarts", "2", WORKER, "--train_file", corpus, *FLAGS,
                                                  "--per_device_train_batch_size", B, "--gradient_accumulation_steps", K,
                                                  "--checkpointing_steps", "2", "--auto_find_batch_size",
                                                  "--output_dir", work / "restarted"), env, work, "restarted")
    one = jh.start([sys.executable, str(WORKER), "--train_file", str(corpus), *FLAGS, "--per_device_train_batch_size",
                    "2", "--gradient_accumulation_steps", "2", "--auto_find_batch_size", "--output_dir",
                    str(work / "one_process")],
                   jh.clean_env(HF_DATASETS_CACHE=str(work / "hf_cache_one"), AUTO_BATCH_AT="backward:0:0,forward:0:1"),
                   work, "one_process")
    by_hand = ddp_pool.submit("train", ["--train_file", corpus, *FLAGS, "--per_device_train_batch_size", B // 2,
                                        "--gradient_accumulation_steps", K * 2, "--output_dir", work / "by_hand"],
                              datasets_cache=work / "hf_cache_hand")
    return {"work": work, "restarted": jh.finish(restarted, 400), "one_process": jh.finish(one, 300),
            "by_hand": by_hand.result()}


def _summary(work: Path, name: str) -> dict:
    return json.loads((work / name / "train_summary.json").read_text())


def _params(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# --------------------------------------------------------------------------- without a launch


def test_resplit_divides_by_the_smallest_prime_and_keeps_the_product():
    from accum_kit.core.auto_batch import resplit

    for batch in range(2, 200):
        smallest = next(d for d in range(2, batch + 1) if batch % d == 0)
        assert resplit(batch, 3) == (batch // smallest, 3 * smallest, smallest)
    chain, b, k = [12], 12, 1
    while b > 1:
        b, k, _ = resplit(b, k)
        chain.append(b)
        assert b * k == 12
    assert chain == [12, 6, 3, 1]


def test_a_real_allocation_failure_is_recognised_and_a_lost_peer_is_not():
    from accum_kit.core.auto_batch import is_allocation_failure, requested_bytes

    with pytest.raises(RuntimeError) as failed:
        torch.empty(2**60, dtype=torch.uint8)  # more than any machine's address space: the allocator fails for real
    assert is_allocation_failure(failed.value) and requested_bytes(failed.value) == 2**60
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2457: Connection reset by peer")
    assert not is_allocation_failure(lost)
    assert is_allocation_failure(MemoryError())
    cuda = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"
    assert requested_bytes(RuntimeError(cuda)) == 2 * 2**30


def test_several_processes_without_restarts_are_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    from accum_kit.cli import run

    for name in (*jh.LAUNCHER_VARS, "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "out"
    assert run("train", ["--auto_find_batch_size", "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--auto_find_batch_size" in err and "--max_restarts" in err, err
    assert not out.exists()


def test_a_restart_takes_the_state_file_and_scales_every_k_of_a_schedule(tmp_path, monkeypatch):
    from accum_kit.core.auto_batch import STATE_FILE, settle
    from accum_kit.errors import UsageError
    from accum_kit.job.config import TrainConfig

    pair = lambda b, k: {"per_device_train_batch_size": b, "gradient_accumulation_steps": k}  # noqa: E731
    (tmp_path / STATE_FILE).write_text(json.dumps({"started_at": pair(12, 1), "current": pair(3, 4), "attempts": [],
                                                   "gave_up": None}))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    cfg = TrainConfig(output_dir=str(tmp_path), per_device_train_batch_size=12, accumulation_schedule="0:1,5:2,9:3",
                      auto_find_batch_size=True)
    auto = settle(cfg, 2, True, None)
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (3, 4) == (auto.batch, auto.k)
    assert cfg.accumulation_schedule == {0: 4, 5: 8, 9: 12}  # 12 x K examples per process and window, as asked
    (tmp_path / STATE_FILE).write_text(json.dumps({"started_at": pair(12, 1), "current": pair(5, 2), "attempts": [],
                                                   "gave_up": None}))
    with pytest.raises(UsageError, match="no re-split"):  # 5 x 2 does not hold 12 x 1
        settle(TrainConfig(output_dir=str(tmp_path), per_device_train_batch_size=12, gradient_accumulation_steps=1,
                           auto_find_batch_size=True), 2, True, None)


def test_deepspeed_refuses_with_its_reason():
    from accum_kit.engines.deepspeed import ZeroEngine
    from accum_kit.errors import UsageError

    with pytest.raises(UsageError, match="--auto_find_batch_size.*DeepSpeed's engine fixes the micro-batch"):
        ZeroEngine(deepspeed_plugin=object()).check_job(auto_find_batch_size=True)


# --------------------------------------------------------------------------- real launches


def test_one_rank_failing_in_the_optimizer_step_restarts_the_group_with_half_the_micro_batch(runs):
    res = runs["restarted"]
    assert res.returncode == 0, res.describe()
    lines = [line for line in res.stderr.splitlines() if "auto_find_batch_size: rank" in line]
    assert len(lines) == 1, res.describe()  # one line, from the rank that failed
    assert "rank 1 failed to allocate" in lines[0], lines
    assert "in the optimizer step (micro-batch 2 of this process, from 0; 2 optimizer steps done)" in lines[0], lines
    assert f"per_device_train_batch_size {B} x gradient_accumulation_steps {K}" in lines[0], lines
    assert "exitcode: 85" in res.stderr, res.describe()  # the dedicated code, in torchrun's report
    summary = _summary(runs["work"], "restarted")
    assert (summary["per_device_train_batch_size"], summary["gradient_accumulation_steps"]) == (B // 2, K * 2)
    assert summary["effective_batch_size_per_step"] == [B * K * WORLD] * STEPS
    block = summary["auto_find_batch_size"]
    assert block["started_at"] == {"per_device_train_batch_size": B, "gradient_accumulation_steps": K}
    assert block["settled"] == {"per_device_train_batch_size": B // 2, "gradient_accumulation_steps": K * 2}
    assert block["restarts"] == 1 and len(block["attempts"]) == 1
    failure = block["attempts"][0]
    assert (failure["rank"], failure["where"], failure["optimizer_step"]) == (1, "optimizer step", 2)
    assert failure["restart_seconds"] > 0 and block["seconds_lost"] >= failure["restart_seconds"]
    # the checkpoint after the restart counts the new micro-batches: 4 windows x 8 examples over 2 processes of 2
    state = json.loads((runs["work"] / "restarted" / "step_4" / "loop_state.json").read_text())
    assert (state["per_device_batch_size"], state["gradient_accumulation_steps"]) == (B // 2, K * 2)
    assert state["batches_done_in_epoch"] == STEPS * B * K * WORLD // (WORLD * (B // 2))


def test_the_restarted_run_equals_the_run_started_at_the_settled_micro_batch(runs):
    """Steps 1-2 ran at 4 x 1 and steps 3-4 at 2 x 2, the by-hand run all at 2 x 2: the same examples per window,
    summed in another order. Losses agree to float rounding; AdamW divides each coordinate's update by its own
    gradient scale, so a few near-zero-gradient coordinates carry that rounding into the parameters (measured:
    6 of 196,608 entries of the largest matrix above 1e-6, the largest 2e-5)."""
    assert runs["by_hand"].returncode == 0, runs["by_hand"].describe()
    got, want = _summary(runs["work"], "restarted"), _summary(runs["work"], "by_hand")
    assert len(got["train_loss"]) == len(want["train_loss"]) == STEPS
    for a, b in zip(got["train_loss"], want["train_loss"]):
        assert math.isclose(a, b, rel_tol=1e-6), (got["train_loss"], want["train_loss"])
    assert math.isclose(got["eval_loss_after"], want["eval_loss_after"], rel_tol=1e-5)
    pa, pb = _params(runs["work"] / "restarted"), _params(runs["work"] / "by_hand")
    assert pa.keys() == pb.keys()
    assert max((pa[k] - pb[k]).abs().max().item() for k in pa) < 1e-4


def test_a_resume_accepts_only_the_exact_re_split(runs):
    from accum_kit.core.checkpoint import check_resumable
    from accum_kit.errors import UsageError

    step_2 = runs["work"] / "restarted" / "step_2"  # saved by the first attempt at 4 x 1
    common = dict(world_size=WORLD, engine="multi_cpu")
    assert check_resumable(step_2, gradient_accumulation_steps=2, per_device_batch_size=2, resplit=True,
                           **common)["resplit"] == 2
    assert check_resumable(step_2, gradient_accumulation_steps=4, per_device_batch_size=1, resplit=True,
                           **common)["resplit"] == 4
    for k, b, resplit in ((1, 2, True), (3, 2, True), (2, 2, False), (4, 3, True)):
        with pytest.raises(UsageError):
            check_resumable(step_2, gradient_accumulation_steps=k, per_device_batch_size=b, resplit=resplit, **common)


def test_one_process_re_executes_itself_and_refuses_when_one_example_does_not_fit(runs):
    res = runs["one_process"]
    assert res.returncode == 2, res.describe()
    lines = [line for line in res.stderr.splitlines() if "auto_find_batch_size: rank" in line]
    assert len(lines) == 1 and "in the backward (" in lines[0] and "next attempt: 1 x 4" in lines[0], res.describe()
    error = [line for line in res.stderr.splitlines() if "error: --auto_find_batch_size" in line]
    assert len(error) == 1 and "even a micro-batch of 1 example does not fit" in error[0], res.describe()
    assert "in the forward (" in error[0] and "bytes" in error[0], error
    assert not (runs["work"] / "one_process" / "train_summary.json").exists()
