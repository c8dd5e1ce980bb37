"""train_loop leaves Accelerate's state clean for whatever runs next (one process, in-process).

Oracle: the window arithmetic of K alone: after a loop, micro-batch i of a
fresh accumulate() sequence must sync exactly when (i + 1) % K == 0.
"""

import pytest

import job_helpers as jh
from accum_kit import train_loop


def _later_sync_flags(acc, model, n=6):
    flags = []
    for _ in range(n):
        with acc.accumulate(model):
            flags.append(acc.sync_gradients)
    return flags


@pytest.mark.parametrize("k,steps", [(2, 2), (3, 1)])
def test_stopping_at_max_train_steps_releases_the_dataloader(accelerator, k, steps):
    # 4 micro-batches per epoch; steps * k of them run, so the loop breaks out of the dataloader.
    acc = accelerator(k)
    model, opt, dl = jh.prepared_tiny_lm(acc)
    result = train_loop(acc, model, opt, dl, max_train_steps=steps, progress=False)
    assert result.optimizer_steps == steps
    assert _later_sync_flags(acc, model) == [(i + 1) % k == 0 for i in range(6)]


def test_new_loop_starts_a_fresh_window(accelerator):
    # A first loop stops with Accelerate's micro-batch counter mid-count (K=3, 2 micro-batches run
    # under a hand-written accumulate); the next train_loop must still group micro-batches by K.
    acc = accelerator(3)
    model, opt, dl = jh.prepared_tiny_lm(acc, n_examples=12)  # 6 micro-batches: windows of 3, 3
    _later_sync_flags(acc, model, n=2)
    seen = []

    class Record:
        def on_backward_end(self, state):
            seen.append(state.boundary)

    train_loop(acc, model, opt, dl, num_train_epochs=1, callbacks=[Record()], progress=False)
    assert seen == [False, False, True, False, False, True]
