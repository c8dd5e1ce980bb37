"""Accumulation schedules in train_loop on one process (in-process): windows, K switches, learning rate, resume check.

Oracles: the schedule's definition (the window after N steps holds the K of
the largest key <= N micro-batches, or what is left of the epoch), written
out here; and the learning-rate rules of Goyal et al. 2017 (linear) and
Krizhevsky 2014 (square root). The 2-process exactness of every window is in
tests/test_exactness.py, resume in tests/test_checkpoint_loop.py.
"""

import math

import pytest

import job_helpers as jh
from accum_kit import train_loop
from accum_kit.core.checkpoint import check_resumable
from accum_kit.errors import UsageError
from accum_kit.outputs import atomic_write_json


class Record:
    def __init__(self, optimizer):
        self.optimizer, self.boundaries, self.lrs, self.ks, self.batches = optimizer, [], [], [], []

    def on_backward_end(self, state):
        self.boundaries.append(state.boundary)

    def on_step_begin(self, state):
        self.lrs.append(self.optimizer.param_groups[0]["lr"])

    def on_step_end(self, state):
        self.ks.append(state.accumulation_steps)
        self.batches.append(state.effective_batch_size)


def _expected(m, schedule, epochs):
    """(boundary flag per micro-batch, K per step) from the schedule's definition."""
    flags, ks = [], []
    for _ in range(epochs):
        size = 0
        for j in range(m):
            k = schedule[max(s for s in schedule if s <= len(ks))]
            size += 1
            end = size == k or j == m - 1
            flags.append(end)
            if end:
                ks.append(k)
                size = 0
    return flags, ks


@pytest.mark.parametrize("rule,factor", [("none", lambda r: 1.0), ("linear", lambda r: r), ("sqrt", math.sqrt)])
def test_windows_and_learning_rate_follow_the_schedule(accelerator, rule, factor):
    # 8 micro-batches per epoch, 2 epochs; K 2 -> 3 after 2 steps -> 1 after 4 (K goes down as well)
    schedule = {0: 2, 2: 3, 4: 1}
    acc = accelerator(2)
    model, opt, dl = jh.prepared_tiny_lm(acc, 16)
    rec = Record(opt)
    result = train_loop(acc, model, opt, dl, num_train_epochs=2, callbacks=[rec], progress=False,
                        accumulation_schedule=schedule, lr_scaling=rule)
    flags, ks = _expected(8, schedule, 2)
    assert ks == [2, 2, 3, 3] + [1] * 8  # epoch 0: windows 2, 2, 3, 1 (a partial K=3 window) | 8 x 1
    assert rec.boundaries == flags
    assert result.step_accumulation_steps == rec.ks == ks
    assert result.optimizer_steps == len(ks)  # the epoch-based step count under the schedule
    assert rec.batches == [2 * k for k in ks]  # B x K x P with B=2, P=1
    assert rec.lrs == pytest.approx([0.1 * factor(k / 2) for k in ks], rel=1e-12)
    assert result.accumulation_schedule == [[0, 2], [2, 3], [4, 1]]


def test_epoch_count_without_a_schedule_is_unchanged(accelerator):
    acc = accelerator(3)
    model, opt, dl = jh.prepared_tiny_lm(acc, 14)  # 7 micro-batches: ceil(7 / 3) = 3 steps per epoch
    result = train_loop(acc, model, opt, dl, num_train_epochs=2, progress=False)
    assert result.step_accumulation_steps == [3] * 6


@pytest.mark.parametrize("schedule,flag", [({2: 1}, "--accumulation_schedule"), ({0: 0}, "--accumulation_schedule (K at step 0)"),
                                           ({0: 1, -1: 2}, "--accumulation_schedule (step)")])
def test_bad_schedule_names_the_flag(accelerator, schedule, flag):
    acc = accelerator(1)
    model, opt, dl = jh.prepared_tiny_lm(acc, 4)
    with pytest.raises(UsageError) as err:
        train_loop(acc, model, opt, dl, progress=False, accumulation_schedule=schedule)
    assert err.value.flag == flag


def test_resume_check_compares_the_schedules_k_at_the_saved_step(tmp_path):
    atomic_write_json(tmp_path / "loop_state.json", {"optimizer_steps": 5, "gradient_accumulation_steps": 2,
                                                     "world_size": 2, "per_device_batch_size": 4})
    kw = dict(gradient_accumulation_steps=1, world_size=2, per_device_batch_size=4)
    assert check_resumable(tmp_path, **kw, accumulation_schedule={0: 1, 5: 2})["optimizer_steps"] == 5
    with pytest.raises(UsageError) as err:
        check_resumable(tmp_path, **kw, accumulation_schedule={0: 1, 6: 2})  # K at step 5 is 1, saved 2
    assert err.value.flag == "--accumulation_schedule" and "K after step 5 is 2" in err.value.fix
    with pytest.raises(UsageError) as err:
        check_resumable(tmp_path, **kw)  # without the schedule: the flag's K 1 vs the saved 2
    assert err.value.flag == "--gradient_accumulation_steps"
