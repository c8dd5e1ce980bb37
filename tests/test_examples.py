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
