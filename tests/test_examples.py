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


def test_raw_ddp_loop_equals_one_process_big_batch(example_results):
    """Plain-DDP reference loop: first step == one process's big batch; all-reduce only at window ends.

    The oracle rebuilds the same initial model in this (single) process, puts
    both ranks' first-window micro-batches into ONE batch and takes the
    token-mean loss and its gradient with plain PyTorch. A wrong rescale
    (e.g. 1 / N instead of W / N) changes every gradient by a factor of 2; a
    missing sync leaves each rank with its own half-batch gradient; a sync on
    every micro-batch shows in the all-reduce record.
    """
    import math

    import torch

    from accum_kit.data import build_tokenizer
    from accum_kit.loss import causal_lm_loss
    from accum_kit.models import build_model
    from conftest import RAW_DDP_STEPS

    r0, r1 = ok(example_results["raw_ddp_loop"])
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
