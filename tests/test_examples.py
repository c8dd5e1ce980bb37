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
