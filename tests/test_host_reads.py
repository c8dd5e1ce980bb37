"""Host reads: the loop reads no tensor value inside a window, and the logged figures only when they are shown.

The counter (tests/host_reads.py) wraps every tensor method that reads a value on the host; the first test
checks that it sees each of them, so that the counts of zero elsewhere (tests/test_exactness.py on one and two
processes, tests/test_fsdp.py, tests/test_deepspeed.py) mean something. The loop tests run one process in this
one: the bar and the callbacks ask for the figures at chosen steps, and the count says when the device was read.
"""

from __future__ import annotations

import math

import pytest
import torch

import test_exactness as ex
from host_reads import HostReads, loop_reads, owner_of


def test_the_counter_sees_every_way_of_reading_a_value():
    t = torch.arange(6.0)
    with HostReads() as reads:
        t.sum().item(), float(t[0]), int(t[1]), bool(t[2]), t.tolist(), t.numpy(), [0, 1, 2][t[1].long()]
        copy = t.cpu()  # a host copy: reading it, or a view of it, again reads no device
        copy.tolist(), float(copy[3]), copy[1:].tolist()
        t.to("cpu"), t.to(device="cpu"), t.to(torch.float64), t.to(t.device)  # by name only: the others place
        if t[4]:
            pass
        f"{t[5]:.1f}"  # format reads through item
    kinds = sorted(kind for _, kind, _ in reads.reads)
    assert kinds == sorted(["item", "__float__", "__int__", "__bool__", "tolist", "numpy", "__index__", "cpu",
                            "to(cpu)", "to(cpu)", "__bool__", "item"]), kinds
    assert all(owner_of(f"{k} {s}").startswith("tests/test_host_reads.py") for _, k, s in reads.reads)
    assert torch.Tensor.item is not None and float(torch.tensor(2.5)) == 2.5  # restored, and still reading


def _train(accelerator, k, steps_to_peek=(), logging_steps=10, progress=False):
    """One process, ``3 k`` micro-batches of 2 equal-length examples; a callback reads ``state.loss`` at
    ``steps_to_peek``. Returns (HostReads, LoopResult, {step: loss seen})."""
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel

    import accum_kit

    class Peek(accum_kit.LoopCallback):
        def __init__(self):
            self.seen = {}

        def on_step_end(self, state):
            if state.step in steps_to_peek:
                self.seen[state.step] = state.loss

    acc = accelerator(k)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**ex.MODEL_CONFIG))
    examples = [{"input_ids": e["input_ids"][:3], "labels": e["input_ids"][:3]} for e in ex.EXAMPLES[: 6 * k]]
    collate = lambda b: {key: torch.tensor([e[key] for e in b]) for key in ("input_ids", "labels")}  # noqa: E731
    pmodel, popt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       DataLoader(examples, batch_size=2, collate_fn=collate))
    peek = Peek()
    with HostReads() as reads:
        result = accum_kit.train_loop(acc, pmodel, popt, loader, callbacks=[peek, reads], progress=progress,
                                      logging_steps=logging_steps, max_grad_norm=1.0)
    return reads, result, peek.seen


def _copies(windows) -> list[int]:
    """Reads of the window figures per window (one copy each time they are asked for)."""
    return [sum(n for s, n in w.items() if "window_figures.py" in owner_of(s)) for w in windows]


def test_the_loop_reads_nothing_until_the_result_is_asked_for(accelerator, one_process):
    reads, result, _ = _train(accelerator, 2)
    inside, windows = loop_reads(reads.summary())
    assert len(windows) == 3 and not any(inside) and not any(windows), (inside, windows)
    assert result.log.reads == 0 and not any(f.is_read for f in result.figures)
    import pickle

    again = pickle.loads(pickle.dumps(result))  # how a notebook's worker returns it: read first, host numbers
    assert result.log.reads == 1 and all(f.is_read and f.tensor is None for f in again.figures)
    losses = result.train_loss  # that copy read the three windows
    assert result.log.reads == 1 and result.step_tokens == [2 * 2 * 2] * 3 and len(losses) == 3
    assert again.train_loss == losses and all(math.isfinite(x) for x in losses)


def test_the_figures_are_read_when_shown_all_unread_windows_in_one_copy(accelerator, one_process, capsys):
    """A callback reads ``state.loss`` at step 1; the bar shows the loss every 2 steps and at the last (3):
    one copy at each of steps 1, 2 and 3, none inside a window, and what each saw is what the result holds."""
    reads, result, seen = _train(accelerator, 2, steps_to_peek=(1,), logging_steps=2, progress=True)
    inside, windows = loop_reads(reads.summary())
    assert not any(inside), inside
    assert _copies(windows) == [1, 1, 1] and [sum(w.values()) for w in windows] == [1, 1, 1], windows
    assert seen == {1: result.train_loss[0]} and result.log.reads == 3
    bar = capsys.readouterr().err
    assert f"loss={result.train_loss[1]:.4f}" in bar and f"loss={result.train_loss[2]:.4f}" in bar


def test_one_copy_reads_every_unread_window_and_the_log_stays_bounded():
    from accum_kit.core.window_figures import FigureLog, WindowFigures

    log = FigureLog(max_unread=4)
    figures = [log.add(WindowFigures(torch.tensor([0.5 * i, 10.0 * i], dtype=torch.float64))) for i in range(10)]
    assert log.reads == 2 and [f.is_read for f in figures] == [True] * 8 + [False] * 2  # read at 4 and 8 waiting
    with HostReads() as reads:
        assert figures[9].read() == (4.5, 90) and figures[8].tokens == 80
    assert [k for _, k, _ in reads.reads] == ["tolist"] and log.reads == 3
    assert log.read_all(extra=[torch.tensor(2.0)]) == [2.0]  # what a tracker reads beside the figures


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_divided_loss_and_its_gradient_are_the_python_floats(accelerator, one_process, dtype):
    """``backward_loss`` divides by c kept on the device (no host read): the loss and the gradient it sends back
    are bit for bit those of dividing by c as a Python float, in every loss type (c = 2^17 does not fit float16:
    it is applied in float32, as a Python float is)."""
    from accum_kit.core.loss import WindowNormalizer

    norm = WindowNormalizer(accelerator(2))
    for c, summed in [(2.0 ** 17, 1234.567), (8.0, 0.0123), (1.0, 5.5)]:
        norm._set_divisor(torch.tensor(c, dtype=torch.float64))
        x = torch.tensor(summed, dtype=dtype, requires_grad=True)
        with HostReads() as reads:
            got = norm.backward_loss(x, torch.tensor(3))
        assert not reads.reads, reads.reads
        want = x / c
        g_got, = torch.autograd.grad(got, x, torch.tensor(0.3, dtype=dtype))
        g_want, = torch.autograd.grad(want, x, torch.tensor(0.3, dtype=dtype))
        assert got.dtype == dtype and torch.equal(got, want) and torch.equal(g_got, g_want), (c, got, want)


def test_the_tracker_logs_every_step_reading_once_per_logging_step():
    """TrackerLogger(logging_steps=2) over 3 steps: nothing logged at step 1, steps 1-2 at step 2 in one copy
    (losses, tokens and the gradient norms together), step 3 at the end; a norm given as a float (DeepSpeed's can
    be) is logged as it is. Values from the figures and norms handed in."""
    from types import SimpleNamespace

    from accum_kit.core.callbacks import LoopState
    from accum_kit.core.window_figures import FigureLog, WindowFigures
    from accum_kit.job.tracking import TrackerLogger

    logged = []
    acc = SimpleNamespace(log=lambda values, step: logged.append((step, values)))
    tracker = TrackerLogger(acc, SimpleNamespace(param_groups=[{"lr": 0.5}]), logging_steps=2)
    log, state = FigureLog(), LoopState(accumulation_steps=4)
    norms = [torch.tensor(1.5), torch.tensor(2.5), 3.5]
    tracker.on_train_begin(state)
    with HostReads() as reads:
        for step in (1, 2, 3):
            state.step, state.grad_norm = step, norms[step - 1]
            state.figures = log.add(WindowFigures(torch.tensor([0.25 * step, 100.0 * step], dtype=torch.float64)))
            tracker.on_step_begin(state)
            tracker.on_step_end(state)
            assert [s for s, _ in logged] == [[], [1, 2], [1, 2]][step - 1]
            assert len(reads.reads) == [0, 1, 1][step - 1], reads.reads
        tracker.on_train_end(state)
    assert [s for s, _ in logged] == [1, 2, 3] and len(reads.reads) == 2
    for step, values in logged:
        assert values["train/loss"] == 0.25 * step and values["train/window_tokens"] == 100 * step
        assert values["train/grad_norm"] == step + 0.5 and values["train/learning_rate"] == 0.5
        assert values["train/gradient_accumulation_steps"] == 4 and values["train/tokens_per_second"] > 0
