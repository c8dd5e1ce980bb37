"""The digits rungs on 2 gloo processes, from the shared examples launch (see conftest.example_results).

``image_classification``: verify on the user's CNN, loss and data, re-checked
here against a float64 oracle computed in this process from the example
indices the report lists; the training learns. ``batchnorm``: the deviation
table's pattern (BatchNorm and SyncBatchNorm's arithmetic miss the big batch,
GroupNorm and SyncBatchNorm at K=1 do not), DDP's buffer broadcasts per
window, and whose running statistics the saved model carries, each measured
two ways (a wrapped broadcast and compared buffers; saved file and replays).
"""

from __future__ import annotations

import math
import runpy

import pytest
import torch
import torch.nn.functional as F

import job_helpers as jh
from conftest import DIGITS_EPOCHS, ok

RUNG = jh.REPO / "examples" / "by_feature" / "image_classification.py"


def test_image_classification_verifies_the_users_model_and_learns(example_results):
    r0, r1 = ok(example_results["image_classification"])
    v = r0["verify"]
    assert r0["world_size"] == r1["world_size"] == v["world_size"] == 2
    assert {**v, "seconds": 0} == {**r1["verify"], "seconds": 0}  # one report, broadcast (each rank times itself)
    assert v["passed"] is True and r0["exit_code"] == 0 and v["batchnorm"] is None  # GroupNorm: nothing to find
    K, B, W = v["gradient_accumulation_steps"], v["per_device_train_batch_size"], 2
    R = (K + 1) // 2
    rows = v["rows"]
    assert rows["tokens"]["passed"] and rows["tokens"]["rank_spread"] < 1e-6
    # one label per image: every micro-batch holds B items, so only the partial window's R / K scaling misses
    mom = rows["mean-of-means"]["windows"]
    assert mom[0]["rel_error"] < 1e-5 and mom[1]["rel_error"] == pytest.approx(1 - R / K, rel=1e-4)
    assert v["ddp_sum_ratio"] == pytest.approx(1 / W, abs=1e-5)  # DDP averages the summed loss's gradient
    assert rows["trainer"]["skipped"]

    # Oracle written here: the same initial CNN in float64, one batch of each window's images, mean cross-entropy.
    rung = runpy.run_path(str(RUNG), run_name="rung")
    train, _ = rung["load_digits_splits"](20, 0)
    torch.manual_seed(0)
    model = rung["DigitsCNN"]("groupnorm").double().eval()
    assert [w["examples"] for w in v["windows"]] == [K * B * W, R * B * W]
    for w, tw in zip(v["windows"], rows["tokens"]["windows"]):
        x = torch.stack([train[i]["pixel_values"] for i in w["indices"]]).double()
        y = torch.stack([train[i]["labels"] for i in w["indices"]])
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
        assert w["target_tokens"] == len(w["indices"])  # items = examples
        assert w["oracle_grad_norm"] == pytest.approx(norm, rel=1e-9)
        assert tw["grad_norm"] == pytest.approx(norm, rel=1e-5)  # what the optimizer saw on both processes
    assert sorted(i for w in v["windows"] for i in w["indices"]) == list(range((K + R) * B * W))  # each image once

    # The training: the window loss is all-reduced, windows hold K x B x W images except each epoch's last
    assert r0["train_loss"] == r1["train_loss"] and r0["epochs"] == DIGITS_EPOCHS
    per_epoch = r0["optimizer_steps"] // DIGITS_EPOCHS
    # every training image once per epoch; Accelerate's even_batches repeats a few to fill the last micro-batches
    assert 0 <= sum(r0["step_items"][:per_epoch]) - r0["train_examples"] < B * W
    assert max(r0["step_items"]) == K * B * W
    assert r0["accuracy_before"] < 0.3 and r0["accuracy"] > 0.85, r0  # 10 classes: chance is 0.1
    assert r0["eval_loss_after"] < r0["eval_loss_before"] - 1.0
    assert r0["eval_examples"] == 360 and r0["accuracy"] == r1["accuracy"]


def test_batchnorm_deviation_table(example_results):
    r0, r1 = ok(example_results["batchnorm"])
    assert r0["world_size"] == 2 and r0["table"] == r1["table"]
    table = {row["norm"]: row for row in r0["table"]}
    assert list(table) == ["batchnorm", "syncbatchnorm", "groupnorm"]
    for norm, row in table.items():
        ks = [d["K"] for d in row["at_init"]]
        assert ks == [1, 4] and [d["B"] for d in row["at_init"]] == [64, 16]  # effective batch 128 throughout
        for d in row["at_init"] + row["trained"]:
            assert d["exact_rows_pass"], (norm, d)  # in eval mode every model accumulates exactly
            per_k = {"batchnorm": (1e-3, math.inf), "groupnorm": (0, 1e-5),
                     "syncbatchnorm": ((0, 1e-5) if d["K"] == 1 else (1e-3, math.inf))}[norm]
            assert per_k[0] < d["rel_error"] < per_k[1], (norm, d)


def test_batchnorm_running_statistics_under_ddp(example_results):
    r0, r1 = ok(example_results["batchnorm"])
    s = r0["running"]
    assert s == r1["running"]  # computed from every rank's records, gathered
    K, steps = s["K"], s["optimizer_steps"]
    # DDP broadcasts rank 0's buffers before a forward iff the previous forward synchronised gradients:
    # once per window, before its first micro-batch. The first window follows the evaluation (no_grad): none.
    assert s["broadcasts_per_window"] == [0] + [1] * (steps - 1)
    assert s["broadcast_at_micro_batch"] == [0]
    assert s["broadcast_tensors"] == [6]  # running mean, variance and batch count of both BatchNorm layers
    assert s["sync_each_batch_broadcasts_per_window"] == [K - 1, K]  # every forward follows a synchronised one
    assert s["k1_broadcasts_per_window"] == [1, 1, 1]  # K=1: every micro-batch is a synchronised window
    # Second measurement: the buffers the first BatchNorm layer holds just before each forward, rank 0 vs rank 1
    assert s["buffers_equal_across_ranks_at_micro_batch"] == [0]
    # The saved model (main process) carries rank 0's statistics; rank 1 ends elsewhere
    assert s["saved_vs_rank0"] == 0.0 and s["saved_vs_rank1"] > 1e-6
    assert s["saved"]["num_batches_tracked"] == s["micro_batches_per_process"]  # one update per micro-batch
    # ... which are BatchNorm's update rule over rank 0's own micro-batches only (replayed from their statistics)
    assert s["rank0_vs_replay_rank0_only"] < 1e-5
    assert s["rank0_vs_replay_every_rank"] > 1e-4  # other ranks' micro-batches are not in them
    assert s["rank1_vs_replay_rank0_then_own_last_window"] < 1e-5
    assert s["after_eval_rank1_vs_rank0"] == 0.0  # the evaluation's first forward broadcast rank 0's again
    assert s["weight_of_last_window"] == pytest.approx(1 - (1 - s["momentum"]) ** K)
