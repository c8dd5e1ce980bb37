"""Exact resume through the loop API: train_loop(..., checkpointer=..., resume_from=...).

One run of tests/ckpt_worker.py on 2 gloo processes (a script run of conftest.py's
shared ``ddp_pool`` launch) and one in a plain process, concurrently. Every scenario trains once without interruption, saving a
checkpoint after every optimizer step, then resumes from some of them in a
fresh Accelerator with freshly built objects. Expected values: the
uninterrupted run (bitwise), and for SGD without shuffling the independent
single-process oracle of tests/test_exactness.py (one big batch per window).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import job_helpers as jh
import test_exactness as ex

WORKER = jh.REPO / "tests" / "ckpt_worker.py"
TIMEOUT_S = 300
DROPOUT = dict(ex.MODEL_CONFIG, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
SCHEDULE = [[0, 1], [1, 3], [5, 2]]


def _sc(name, *, K=3, epochs=2, max_train_steps=None, resume_from=(), **kw):
    base = {"name": name, "model_config": DROPOUT, "examples": ex.make_examples(44), "K": K, "B": 2,
            "epochs": epochs, "max_train_steps": max_train_steps, "optimizer": "adamw", "lr": 1e-2,
            "scheduler": "cosine", "max_grad_norm": 1.0, "shuffle": True, "generator": False,
            "resume_from": list(resume_from)}
    return {**base, **kw}


# 44 examples, B=2: 11 micro-batches per process on 2 processes (K=3: windows 3,3,3,2 -> 4 steps per epoch),
# 22 on one (windows of 3 x 7 and 1 -> 8 steps per epoch). Shuffling on, dropout 0.1, AdamW, cosine schedule.
SCENARIOS = {
    2: [
        # 3 epochs: mid-epoch (2), epoch boundary (4: the partial window closed epoch 0), mid-epoch of the 2nd
        # epoch (6) and of the 3rd (10), and the last step (12: nothing left to run)
        _sc("epochs_dropout", epochs=3, resume_from=(2, 4, 6, 10, 12)),
        # --max_train_steps that stops inside epoch 2 (the 3rd); the DataLoader has its own generator
        _sc("max_steps_generator", max_train_steps=10, generator=True, resume_from=(5, 9)),
        # the oracle scenario: test_exactness's data and model, SGD, no shuffling, no clipping
        _sc("oracle_sgd", model_config=ex.MODEL_CONFIG, examples=ex.EXAMPLES, optimizer="sgd", lr=ex.LR,
            scheduler="constant", max_grad_norm=None, shuffle=False, resume_from=(1, 2)),
        # batch-size warm-up (K 1, 3, 2) with linear LR scaling: resumed inside the K=3 phase (2), right
        # after the switch to K=2 at an epoch start (5: 11 micro-batches = 1 + 3 + 3 + 3 + 1), and mid-phase (6)
        _sc("schedule_lr", K=1, schedule=SCHEDULE, lr_scaling="linear", resume_from=(2, 5, 6)),
    ],
    # one process: the RandomSampler has no generator and seeds each epoch from the global torch RNG
    1: [_sc("one_process", epochs=3, resume_from=(4, 8, 20))],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ddp_pool):
    """One process (a subprocess) and 2 processes (a script run of conftest.py's shared ``ddp_pool``) at once."""
    root = tmp_path_factory.mktemp("ckpt_loop")
    started = {}
    for world, scenarios in SCENARIOS.items():
        spec = root / f"spec{world}.json"
        spec.write_text(json.dumps({"pad_id": ex.PAD_ID, "scenarios": scenarios}))
        out = root / f"w{world}"
        if world == 1:
            started[world] = (jh.start([sys.executable, str(WORKER), str(spec), str(out)], jh.clean_env(), root,
                                       f"w{world}"), out)
        else:
            assert world == ddp_pool.num_processes
            started[world] = (ddp_pool.submit("ckpt_worker", [spec, out], script=WORKER), out)
    loaded = {}
    for world, (handle, out) in started.items():
        res = handle.result() if world != 1 else jh.finish(handle, TIMEOUT_S)  # a pool command, or a process
        assert res.returncode == 0, res.describe()
        loaded[world] = {sc["name"]: {p.stem: torch.load(p, weights_only=False)
                                      for p in (out / sc["name"]).glob("*.pt")} for sc in SCENARIOS[world]}
    return loaded


def _cases():
    return [(w, sc["name"], step) for w, scs in SCENARIOS.items() for sc in scs for step in sc["resume_from"]]


@pytest.mark.parametrize("world,name,step", _cases())
def test_resumed_run_equals_uninterrupted_bitwise(runs, world, name, step):
    full, resumed = runs[world][name]["full"], runs[world][name][f"resumed_{step}"]
    assert resumed["resumed_from_step"] == step
    assert resumed["train_loss"] == full["train_loss"], "per-step losses (restored + new) differ"
    assert resumed["step_tokens"] == full["step_tokens"]
    assert resumed["micro_batches"] == full["micro_batches"]
    assert resumed["epochs"] == full["epochs"]
    assert len(resumed["steps"]) == len(full["steps"]) - step
    for k, want in enumerate(full["steps"][step:]):  # parameters after every step run after the resume
        for key in want:
            assert torch.equal(resumed["steps"][k][key], want[key]), f"{key} after step {step + k + 1}"


def test_scenarios_cover_partial_windows_and_both_resume_points(runs):
    full = runs[2]["epochs_dropout"]["full"]
    assert len(full["train_loss"]) == 12 and full["micro_batches"] == 33  # 3 epochs x (3 + 3 + 3 + 2)
    assert full["epochs"] == 3
    generator = runs[2]["max_steps_generator"]["full"]
    assert len(generator["train_loss"]) == 10 and generator["epochs"] == 3  # stops inside epoch 2
    one = runs[1]["one_process"]["full"]
    assert len(one["train_loss"]) == 24 and one["micro_batches"] == 66 and one["epochs"] == 3
    # where each checkpoint resumes the data, [epoch, micro-batches done in it], by arithmetic: 11 (2 processes,
    # windows 3 3 3 2) or 22 (1 process, windows of 3 x 7 and 1) micro-batches per epoch; each scenario resumes
    # part-way into the 3rd epoch (index 2) at least once, and epochs_dropout also after its very last step
    at = {(w, sc["name"]): [runs[w][sc["name"]][f"resumed_{s}"]["resumed_at"] for s in sc["resume_from"]]
          for w, scs in SCENARIOS.items() for sc in scs if sc["epochs"] == 3 or sc["max_train_steps"] == 10}
    assert at == {(2, "epochs_dropout"): [[0, 6], [1, 0], [1, 6], [2, 6], [3, 0]],
                  (2, "max_steps_generator"): [[1, 3], [2, 3]], (1, "one_process"): [[0, 12], [1, 0], [2, 12]]}


def test_resume_without_restoring_the_shuffle_would_differ(runs):
    """Sensitivity: the epochs draw different orders, so replaying an earlier epoch's order would be wrong."""
    for world, name, per_epoch in ((2, "epochs_dropout", 4), (1, "one_process", 8)):
        tokens = runs[world][name]["full"]["step_tokens"]
        epochs = [tuple(tokens[e * per_epoch:(e + 1) * per_epoch]) for e in range(3)]
        assert len(set(epochs)) == 3, f"{name}: two epochs saw the same order"


@pytest.mark.parametrize("step", [1, 2])
def test_resumed_sgd_run_matches_single_process_oracle(runs, step):
    """The resumed run's parameters after each step == one big batch per window on one process."""
    sc = next(s for s in SCENARIOS[2] if s["name"] == "oracle_sgd")
    full, resumed = runs[2]["oracle_sgd"]["full"], runs[2]["oracle_sgd"][f"resumed_{step}"]
    windows = ex.run_windows(2, {"K": sc["K"], "epochs": sc["epochs"], "max_train_steps": None})
    params, losses = ex.oracle_run(full["init"], windows, "tokens", sc["K"], 2)
    assert len(windows) == 4 and len(windows[1]) < sc["K"] * 2  # 2 epochs of windows 3, 2 (partial)
    ex.assert_params_match(resumed["steps"], params[step:], f"resumed from step {step}")
    assert resumed["train_loss"] == pytest.approx([l["tokens"] for l in losses], rel=ex.LOSS_RTOL)


def test_schedule_resume_follows_the_schedule_and_scales_the_learning_rate(runs):
    """K per step follows the schedule, restored history included; the linear rule multiplies the
    cosine schedule's rate by K / K_first from the switch on, in the uninterrupted and the resumed runs."""
    import math

    full = runs[2]["schedule_lr"]["full"]
    # 11 micro-batches per epoch: windows 1, 3, 3, 3, 1 (epoch 0; K=3 from step 1), then K=2 from step 5
    assert full["step_accumulation_steps"] == [1, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2]
    assert full["micro_batches"] == 22
    steps, warmup = len(full["lrs"]), 2  # the worker's num_warmup_steps; one scheduler step per process
    for s, (k, lr) in enumerate(zip(full["step_accumulation_steps"], full["lrs"])):
        shape = s / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))
        assert lr == pytest.approx(1e-2 * k * shape, rel=1e-9, abs=1e-15), f"step {s + 1}: lr {lr}, K {k}"
    for step in (2, 5, 6):
        resumed = runs[2]["schedule_lr"][f"resumed_{step}"]
        assert resumed["step_accumulation_steps"] == full["step_accumulation_steps"]
        assert resumed["lrs"] == full["lrs"][step:]
        assert resumed["base_lrs"] == full["base_lrs"] == [pytest.approx(2e-2)]  # 1e-2 x K 2 / K 1 at the end
