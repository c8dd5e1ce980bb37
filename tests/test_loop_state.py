"""train_loop leaves Accelerate's state clean for whatever runs next (one process, in-process).

Oracle: the window arithmetic of K alone: after a loop, micro-batch i of a
fresh accumulate() sequence must sync exactly when (i + 1) % K == 0.
"""

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from accum_kit import train_loop


def _prepared(acc, n_examples=8):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=None, eos_token_id=None))
    data = [{"input_ids": torch.randint(0, 50, (8,))} for _ in range(n_examples)]
    for d in data:
        d["labels"] = d["input_ids"].clone()
    return acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=2))


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
    model, opt, dl = _prepared(acc)
    result = train_loop(acc, model, opt, dl, max_train_steps=steps, progress=False)
    assert result.optimizer_steps == steps
    assert _later_sync_flags(acc, model) == [(i + 1) % k == 0 for i in range(6)]


def test_new_loop_starts_a_fresh_window(accelerator):
    # A first loop stops with Accelerate's micro-batch counter mid-count (K=3, 2 micro-batches run
    # under a hand-written accumulate); the next train_loop must still group micro-batches by K.
    acc = accelerator(3)
    model, opt, dl = _prepared(acc, n_examples=12)  # 6 micro-batches: windows of 3, 3
    _later_sync_flags(acc, model, n=2)
    seen = []

    class Record:
        def on_backward_end(self, state):
            seen.append(state.boundary)

    train_loop(acc, model, opt, dl, num_train_epochs=1, callbacks=[Record()], progress=False)
    assert seen == [False, False, True, False, False, True]
