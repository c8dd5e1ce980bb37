"""The examples ladder, each run on 2 gloo processes in one shared launch (see conftest.example_results).

Every assertion could fail: losses must fall, the ranks must agree, and each
feature's own figure is checked against an independent computation.
"""

from __future__ import annotations

from conftest import ok


def test_custom_loop_trains_on_two_processes(example_results):
    r0, r1 = ok(example_results["custom_loop"])
    assert r0["world_size"] == r1["world_size"] == 2
    assert len(r0["train_loss"]) == 8
    assert r0["train_loss"] == r1["train_loss"]  # the window loss is all-reduced: every rank logs the same
    assert r0["eval_loss_after"] < r0["eval_loss_before"] - 0.1, r0


def test_mean_vs_tokens_logs_the_exact_token_mean_and_shows_the_bias(example_results):
    r0, r1 = ok(example_results["mean_vs_tokens"])
    assert r0["world_size"] == 2 and r0["train_loss"] == r1["train_loss"]
    steps = len(r0["train_loss"])
    assert steps == 8
    # Recompute both averages from the raw per-micro-batch (step, S, n) records of both ranks.
    records = [rec for per_rank in r0["micro_batches"] for rec in per_rank]
    assert len(records) == 2 * 8 * 4  # 2 processes x 8 steps x K=4 micro-batches
    for step in range(steps):
        window = [(s, n) for k, s, n in records if k == step]
        exact = sum(s for s, _ in window) / sum(n for _, n in window)
        mom = sum(s / n for s, n in window) / len(window)
        assert abs(r0["train_loss"][step] - exact) <= 1e-6 * exact  # the loop logs (and optimises) the token mean
        assert abs(r0["mean_of_means"][step] - mom) <= 1e-9 * mom
    # Variable lengths make the two differ: the bias the example exists to show.
    gaps = [abs(a - b) for a, b in zip(r0["token_mean"], r0["mean_of_means"])]
    assert max(gaps) > 1e-3, gaps
def test_verify_exactness_on_the_users_model(example_results):
    r0, r1 = ok(example_results["verify_exactness"])
    v0, v1 = r0["verify"], r1["verify"]
    assert v0["world_size"] == r0["world_size"] == r1["world_size"] == 2
    assert v0 == v1  # one report, broadcast to every rank
    rows = {r["name"]: r for r in v0["rows"]}
    assert rows["tokens"]["passed"] is True and v0["passed"] is True
    assert rows["tokens"]["rel_error"] < v0["rtol"] and rows["tokens"]["tolerance_used"] <= 1
    # per-micro-batch means over variable-length sequences miss the big-batch gradient by far more than rtol
    assert rows["mean-of-means"]["passed"] is False
    assert rows["mean-of-means"]["rel_error"] > 100 * v0["rtol"], rows["mean-of-means"]
    # DDP averages gradients over processes (PyTorch DDP notes): a sum loss yields 1/world_size of the sum gradient
    assert abs(v0["ddp_sum_ratio"] - 1 / 2) < 1e-3, v0["ddp_sum_ratio"]
    # the training part still trains, and the verification before it did not disturb it
    assert r0["eval_loss_after"] < r0["eval_loss_before"] - 0.1, r0
    assert r0["train_loss"] == r1["train_loss"]
    base = ok(example_results["custom_loop"])[0]
    assert r0["train_loss"] == base["train_loss"], "verify changed the training that follows it"
