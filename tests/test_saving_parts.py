"""The FSDP2 bench's split of a step into parts, against sums done by hand; no launch."""

from __future__ import annotations

import pytest

from accum_kit.bench.saving_parts import PARTS, saving_parts, window_parts
from accum_kit.profiler.records import MicroBatchTimes, PostBackwardTime, ProfileRecords, StepTimes


def _window(rec: ProfileRecords, tag: str, step: int, micro0: int, fwd, bwd, hooks, acc, opt: float, total: float):
    for i, (f, b, h, a) in enumerate(zip(fwd, bwd, hooks, acc)):
        for unit, share in enumerate((0.25, 0.75)):  # two units' hooks per micro-batch
            rec.post_backwards.append(PostBackwardTime(step, micro0 + i, "no_sync", tag, unit, False, 0.0, h * share))
        rec.micro_batches.append(MicroBatchTimes(step, micro0 + i, False, "no_sync", tag, f, b, None, a, None))
    rec.steps.append(StepTimes(step, "no_sync", tag, opt, total))


def test_parts_add_up_to_the_step_and_differences_say_where_the_time_went():
    base, pol = ProfileRecords(), ProfileRecords()
    _window(base, "s", 0, 0, fwd=[1.0, 1.0], bwd=[3.0, 3.0], hooks=[1.0, 1.0], acc=[0.0, 0.0], opt=0.5, total=9.0)
    _window(base, "s", 1, 2, fwd=[1.0, 1.0], bwd=[3.0, 3.0], hooks=[1.0, 1.0], acc=[0.0, 0.0], opt=0.5, total=9.5)
    _window(pol, "n", 0, 0, fwd=[1.0, 1.0], bwd=[2.2, 3.0], hooks=[0.0, 1.0], acc=[0.0, 0.2], opt=0.5, total=8.0)
    b, p = window_parts(base), window_parts(pol)
    # by hand: base forward 2, hooks 2, autograd 6 - 2 = 4, optimizer 0.5, step (9 + 9.5) / 2, rest step - 8.5
    assert b == pytest.approx({"forward": 2.0, "hooks": 2.0, "autograd": 4.0, "accumulation": 0.0, "optimizer": 0.5,
                               "rest": 0.75, "step": 9.25})
    assert p == pytest.approx({"forward": 2.0, "hooks": 1.0, "autograd": 4.2, "accumulation": 0.2, "optimizer": 0.5,
                               "rest": 0.3, "step": 8.0})
    for parts in (b, p):
        assert sum(parts[k] for k in ("forward", "hooks", "autograd", "optimizer", "rest")) == pytest.approx(parts["step"])
    d = saving_parts(b, p)
    assert list(d) == list(PARTS) and d["hooks"] == pytest.approx(1.0) and d["autograd"] == pytest.approx(-0.2)
    assert d["step"] == pytest.approx(1.25)
    assert saving_parts(b, None) is None and window_parts(ProfileRecords()) is None
