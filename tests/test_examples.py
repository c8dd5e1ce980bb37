"""The examples ladder, each run on 2 gloo processes in one shared launch (see conftest.example_results).

Every assertion could fail: losses must fall, the ranks must agree, and each
feature's own figure is checked against an independent computation.
"""

from __future__ import annotations

import pytest
from conftest import ok


def test_custom_loop_trains_on_two_processes(example_results):
    r0, r1 = ok(example_results["custom_loop"])
    assert r0["world_size"] == r1["world_size"] == 2
    assert len(r0["train_loss"]) == 8
    assert r0["train_loss"] == r1["train_loss"]  # the window loss is all-reduced: every rank logs the same
    assert r0["eval_loss_after"] < r0["eval_loss_before"] - 0.1, r0


def test_custom_loop_with_gradient_checkpointing_trains_as_without(example_results):
    """examples/custom_loop.py --gradient_checkpointing (applied in accelerator.prepare, the loop unchanged): the
    plan records it and the losses and eval losses are those of the run without, up to rounding."""
    for got, want in zip(ok(example_results["custom_loop_gc"]), ok(example_results["custom_loop"])):
        assert got["gradient_checkpointing"] and not want["gradient_checkpointing"]
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-6)
        assert got["eval_loss_after"] == pytest.approx(want["eval_loss_after"], rel=1e-6)


def test_custom_loop_with_use_peft_trains_the_adapters_only(example_results):
    """examples/custom_loop.py --use_peft --lora_r 4: the same loop on a peft PeftModel; the trainable parameters are
    the adapters on each block's c_attn, r (d + 3 d) per block counted by hand; the ranks agree and the loss falls."""
    from accum_kit.job.models import PRESETS

    r0, r1 = ok(example_results["custom_loop_lora"])
    d, L = PRESETS["tiny"]["n_embd"], PRESETS["tiny"]["n_layer"]
    assert r0["trainable_parameters"] == L * 4 * (d + 3 * d)
    assert r0["train_loss"] == r1["train_loss"] and len(r0["train_loss"]) == 8
    assert r0["eval_loss_after"] < r0["eval_loss_before"], r0


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
@pytest.mark.parametrize("grad_sync", ["ddp", "manual_allreduce", "manual_allreduce_flat"])
def test_raw_ddp_loop_equals_one_process_big_batch(example_results, grad_sync):
    """Plain-DDP reference loop: first step == one process's big batch; all-reduce only at window ends.

    The oracle rebuilds the same initial model in this (single) process, puts
    both ranks' first-window micro-batches into ONE batch and takes the
    token-mean loss and its gradient with plain PyTorch. A wrong rescale
    (e.g. 1 / N instead of W / N) changes every gradient by a factor of 2; a
    missing sync leaves each rank with its own half-batch gradient; a sync on
    every micro-batch shows in the all-reduce record. The same loop without
    DDP (``--grad_sync manual_allreduce`` / ``manual_allreduce_flat``: the
    gradients averaged by hand after the window's last backward) must give
    the same first step, with one all-reduce per parameter tensor of the
    oracle's model, or one in all, per window.
    """
    import math

    import torch

    from accum_kit.job.data import build_tokenizer
    from accum_kit.core.loss import causal_lm_loss
    from accum_kit.job.models import build_model
    from conftest import RAW_DDP_STEPS

    r0, r1 = ok(example_results["raw_ddp_loop" if grad_sync == "ddp" else f"raw_ddp_loop_{grad_sync}"])
    K, steps, block_size = 4, RAW_DDP_STEPS, 128  # the example's defaults
    assert r0["world_size"] == r1["world_size"] == 2
    assert len(r0["train_loss"]) == steps and r0["train_loss"] == r1["train_loss"]
    assert r0["train_loss"][-1] < r0["train_loss"][0] - 0.3, r0["train_loss"]  # it learns
    c0, c1 = r0["checks"], r1["checks"]

    # DDP all-reduced only in the backward of each window's last micro-batch, the same buckets every time.
    ends = {s * K + K - 1 for s in range(steps)}
    for c in (c0, c1):
        assert set(c["allreduce_micro_steps"]) == ends, c["allreduce_micro_steps"]
        assert len(c["allreduce_micro_steps"]) % steps == 0

    # Oracle: one process, one big batch of both ranks' first windows.
    model = build_model("tiny", len(build_tokenizer()), n_positions=block_size, seed=0)
    per_window = {"manual_allreduce": len(list(model.parameters())), "manual_allreduce_flat": 1}.get(grad_sync)
    if per_window is not None:  # by hand: one collective per parameter tensor (tied weights once), or one in all
        assert len(c0["allreduce_micro_steps"]) == len(c1["allreduce_micro_steps"]) == per_window * steps
    assert math.isclose(sum(p.double().sum().item() for p in model.parameters()), c0["initial_param_sum"],
                        rel_tol=1e-9, abs_tol=1e-9)
    windows = [torch.tensor(micro) for c in (c0, c1) for micro in c["first_window_input_ids"]]
    assert len(windows) == 2 * K and not torch.equal(windows[0], windows[K])  # the ranks saw different data
    ids = torch.cat(windows)
    summed, n_tokens = causal_lm_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    loss = summed / n_tokens
    loss.backward()
    assert math.isclose(loss.item(), r0["train_loss"][0], rel_tol=1e-5), (loss.item(), r0["train_loss"][0])
    scale = max(p.grad.norm().item() for p in model.parameters())
    for name, p in model.named_parameters():
        norm0, sum0 = c0["first_step_grads"][name]
        assert c1["first_step_grads"][name] == [norm0, sum0], name  # both ranks step with the same gradient
        assert math.isclose(norm0, p.grad.norm().item(), rel_tol=1e-4, abs_tol=1e-6 * scale), name
        assert math.isclose(sum0, p.grad.sum().item(), rel_tol=1e-4, abs_tol=1e-5 * scale), name


def test_profile_comm_counts_every_gradient_once_per_sync(example_results):
    """The comm profile's counts against numbers worked out here, not by the profiler.

    Windows in no_sync mode all-reduce once (on their last micro-batch); the
    A/B windows run with sync_each_batch all-reduce on each of their K
    micro-batches. Every sync sends every fp32 gradient once, so bytes =
    syncs x 4 x (parameter count of a freshly built model of the same preset).
    """
    import torch.distributed as dist

    from accum_kit.job.data import build_tokenizer
    from accum_kit.job.models import build_model
    from conftest import PROFILE_COMM_STEPS

    r0, r1 = ok(example_results["profile_comm"])
    K, steps, n_ab = 4, PROFILE_COMM_STEPS, 2  # the example's default K, the spec's --max_train_steps and --ab_steps
    assert (r0["K"], r0["steps"], r0["ab_steps_each"]) == (K, steps, n_ab)
    assert r0["train_loss"] == r1["train_loss"]
    assert r0["eval_loss_after"] < r0["eval_loss_before"] - 0.1, r0
    model = build_model("tiny", len(build_tokenizer()), n_positions=128)  # the example's preset and --block_size
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    # DDP puts up to 1 MiB of gradients in its first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES) and
    # 25 MiB in the others: one bucket per sync for a model this small.
    assert grad_bytes < dist._DEFAULT_FIRST_BUCKET_BYTES
    buckets = 1
    no_sync_windows = steps - n_ab
    expected = {
        "syncs": no_sync_windows,  # one per optimizer step
        "micro_batches": no_sync_windows * K,
        "skipped_syncs": no_sync_windows * (K - 1),
        "allreduce_calls": no_sync_windows * buckets,
        "allreduce_bytes": no_sync_windows * grad_bytes,
        "allreduce_calls_per_sync": buckets,
    }
    expected_ab = {"syncs": n_ab * K, "micro_batches": n_ab * K, "skipped_syncs": 0,
                   "allreduce_calls": n_ab * K * buckets, "allreduce_bytes": n_ab * K * grad_bytes,
                   "allreduce_calls_per_sync": buckets}
    assert {k: r0[k] for k in expected} == expected
    assert r0["skipped_syncs"] == r0["micro_batches"] - r0["syncs"]
    assert r0["ab_sync_each_batch"] == expected_ab
    for proc in r0["comm"]["per_process"]:  # every process counted the same
        assert {k: proc[k] for k in expected} == expected, proc
    assert r0["comm"]["seconds_per_step_sync_each_batch"] > 0 and r0["comm"]["seconds_per_step_no_sync"] > 0


def test_checkpointing_resume_replays_the_uninterrupted_run(example_results):
    full, resumed = ok(example_results["checkpointing"]), ok(example_results["checkpointing_resumed"])
    assert [c.rsplit("/", 1)[-1] for c in full[0]["checkpoints"]] == ["step_3", "step_6"]
    assert full[0]["resumed_from_step"] is None and resumed[0]["resumed_from_step"] == 3
    for f, r in zip(full, resumed):  # every rank
        assert len(r["train_loss"]) == 8
        assert r["train_loss"] == f["train_loss"]  # steps 1-3 restored, 4-8 recomputed: bitwise equal
        assert r["final_parameters_sha256"] == f["final_parameters_sha256"]
    assert full[0]["final_parameters_sha256"] == full[1]["final_parameters_sha256"]  # DDP replicas agree
    assert full[0]["eval_loss_after"] < full[0]["eval_loss_before"] - 0.1


def test_schedule_windows_follow_the_schedule(example_results):
    """by_feature/schedule.py: each step's K, micro-batches and window tokens, from the schedule text alone.

    Packed blocks of 128 tokens are all targets but the first (127 per example); a window of K
    micro-batches of 4 examples on each of 2 processes therefore counts K x 4 x 2 x 127 tokens.
    """
    from conftest import SCHEDULE

    r0, r1 = ok(example_results["schedule"])
    pairs = sorted((int(a), int(b)) for a, b in (p.split(":") for p in SCHEDULE.split(",")))
    ks = [max((s, k) for s, k in pairs if s <= step)[1] for step in range(8)]
    assert ks == [1, 1, 2, 2, 2, 4, 4, 4]
    for r in (r0, r1):
        assert r["world_size"] == 2 and len(r["train_loss"]) == 8
        assert r["step_accumulation_steps"] == ks
        assert r["micro_batches"] == sum(ks)  # per process: the windows grew as scheduled
        assert r["step_tokens"] == [k * 4 * 2 * 127 for k in ks]
    assert r0["train_loss"] == r1["train_loss"]
    assert r0["eval_loss_after"] < r0["eval_loss_before"] - 0.1, r0
