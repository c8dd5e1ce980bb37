"""Loop callbacks fail loudly when misspelled; the foreach gradient rescale equals a plain multiplication."""

from __future__ import annotations

import pytest
import torch

from accum_kit.core.callbacks import HOOKS, CallbackList, LoopCallback, LoopState
from accum_kit.core.loss import scale_grads_


class Counting(LoopCallback):
    def __init__(self):
        self.calls = []

    def on_step_end(self, state):
        self.calls.append(("on_step_end", state.step))


class DuckTyped:
    def __init__(self):
        self.calls = []

    def on_train_begin(self, state):
        self.calls.append("on_train_begin")


class Misspelled(LoopCallback):
    def on_step_ended(self, state):  # not a hook: would be skipped silently without the check
        pass


class NoPrefix:
    def onstep_end(self, state):
        pass


class NoHooks:
    def step(self, state):
        pass


def test_hooks_are_called_in_order_and_only_where_defined():
    a, b = Counting(), DuckTyped()
    hooks = CallbackList([a, None, b])
    state = LoopState(step=3)
    for name in HOOKS:
        hooks(name, state)
    assert a.calls == [("on_step_end", 3)]
    assert b.calls == ["on_train_begin"]


@pytest.mark.parametrize("bad, needle", [
    (Misspelled(), "'on_step_ended' (did you mean 'on_step_end'?)"),
    (NoPrefix(), "'onstep_end' (did you mean 'on_step_end'?)"),
    (NoHooks(), "defines none of the loop hooks"),
])
def test_bad_callbacks_raise_type_error(bad, needle):
    with pytest.raises(TypeError) as info:
        CallbackList([bad])
    assert needle in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scale_grads_matches_a_plain_multiplication(dtype):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in [(3, 4), (5,), (2, 2, 2)]]
    params.append(torch.nn.Parameter(torch.zeros(2, dtype=torch.float32)))  # a second dtype group
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no grad: skipped
    scale = 0.123456789
    want = [None if p.grad is None else (p.grad.double() * scale).to(p.dtype) for p in params]
    scale_grads_(params, scale)
    for p, w in zip(params, want):
        if w is None:
            assert p.grad is None
        else:
            tol = {torch.bfloat16: 1e-2, torch.float32: 1e-6}.get(p.dtype, 1e-12)
            torch.testing.assert_close(p.grad.double(), w.double(), rtol=tol, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_a_tensor_scale_gives_the_bits_of_the_python_float(dtype):
    """The window rescale stays on the device (a float64 scalar tensor): every gradient equals, bit for bit, what
    the Python float gives, and that is a plain multiplication by the float rounded as the kernel rounds it
    (written out here: float64 for float64; float32 for float32; on the CPU, a 16-bit type's own rounding)."""
    g = torch.Generator().manual_seed(1)
    factor_type = {torch.float64: torch.float64, torch.float32: torch.float32}.get(dtype, dtype)
    for scale in [0.123456789, 3.0 / 7.0, 1e-3 / 3.0, 2.0 ** -20 * 1.1]:  # none exact in float32
        grads = [torch.randn(shape, generator=g).to(dtype) for shape in [(64, 3), (7,)]]
        factor = torch.tensor(scale, dtype=torch.float64).to(factor_type).to(torch.promote_types(dtype, torch.float32))
        want = [(x.to(factor.dtype) * factor).to(dtype) for x in grads]
        for given in (torch.tensor(scale, dtype=torch.float64), scale):
            params = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
            for p, x in zip(params, grads):
                p.grad = x.clone()
            scale_grads_(params, given)
            for p, w in zip(params, want):
                assert torch.equal(p.grad, w), (dtype, scale, type(given).__name__)
