"""Mixed precision: fp16 with a GradScaler in ``tokens`` mode, the loss divisor c, and ``verify --mixed_precision``.

fp16. Accelerate builds no GradScaler and runs no fp16 autocast on a CPU
(``Accelerator.scaler`` is None, ``native_amp`` False; accelerate 1.15), so
this test drives both itself around the library's arithmetic: the loss
function is :func:`accum_kit.causal_lm_loss` under ``torch.autocast("cpu",
torch.float16)``, and a ``torch.amp.GradScaler("cpu")`` is handed to the
Accelerator before ``prepare``, so that Accelerate's own code paths use it:
``accelerator.backward`` calls ``scaler.scale(loss).backward()`` and the
prepared optimizer calls ``scaler.step`` / ``scaler.update`` and reports
``step_was_skipped``. Everything between (train_loop, WindowNormalizer's
loss divisor c and the ``K W c / N`` rescale) is the library's.

"Before" is the same library code with c fixed at 1 (``power_of_two``
patched to return 1.0): it back-propagates the summed losses and rescales by
``K W / N``, which is the arithmetic before the divisor existed. On long
sequences (150-256 tokens) the summed loss times the initial scale 2^16
overflows fp16 in backward and the scaler skips every step; with c none is
skipped, and each update equals a float64 big-batch oracle (written here,
plain PyTorch) within the fp16 tolerance sqrt(m) u = 8 x 2^-11 (derived in
accum_kit/verify/compare.py and tests/test_exactness.py).
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

import accum_kit
from accum_kit import cli, loss as loss_module
from job_helpers import pad_collate

K, B, LR = 2, 2, 0.1
FP16_RTOL = math.sqrt(64) * 2.0 ** -11  # sqrt(m) u, u = 2^-11 (fp16 keeps 11 significant bits)
BF16_RTOL = math.sqrt(64) * 2.0 ** -8
CONFIG = dict(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=256,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)


def _examples(n=16, low=150, high=256, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(2, CONFIG["vocab_size"] - 1) for _ in range(rng.randint(low, high))]
        out.append({"input_ids": ids, "labels": ids})
    return out


class _Steps(accum_kit.LoopCallback):
    """Parameters before and after every optimizer step, and whether the scaler skipped it."""

    def __init__(self, model, optimizer, scaler):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.before, self.after, self.skipped, self.scales = [], [], [], []

    def _params(self):
        return {k: v.detach().double().clone() for k, v in self.model.named_parameters()}

    def on_step_begin(self, state):
        self.before.append(self._params())

    def on_step_end(self, state):
        self.after.append(self._params())
        if self.scaler is not None:
            self.skipped.append(bool(self.optimizer.step_was_skipped))
            self.scales.append(self.scaler.get_scale())


def _fp16_loss(model, batch):
    with torch.autocast("cpu", dtype=torch.float16):
        return accum_kit.causal_lm_loss(model, batch)


def _run(examples, *, fp16: bool, old_arithmetic: bool, monkeypatch):
    """One single-process train_loop run; returns (_Steps, LoopResult, initial parameters)."""
    with monkeypatch.context() as m:
        if old_arithmetic:
            m.setattr(loss_module, "power_of_two", lambda x: 1.0)  # c = 1: summed losses, K W / N rescale
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(**CONFIG))
        init = {k: v.detach().double().clone() for k, v in model.named_parameters()}
        acc = accum_kit.build_accelerator(K)
        assert acc.scaler is None  # CPU: Accelerate builds none, so the test brings its own
        scaler = torch.amp.GradScaler("cpu") if fp16 else None
        acc.scaler = scaler  # before prepare: AcceleratedOptimizer and accelerator.backward use it
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        pmodel, popt, dl = acc.prepare(model, opt, DataLoader(examples, batch_size=B, collate_fn=pad_collate(0)))
        steps = _Steps(model, popt, scaler)
        result = accum_kit.train_loop(acc, pmodel, popt, dl, loss_fn=_fp16_loss if fp16 else None,
                                      callbacks=[steps], progress=False)
        acc.scaler = None
        acc.free_memory()
    return steps, result, init


def _oracle_gradient(params: dict, examples) -> dict:
    """float64 plain PyTorch: gradient of the token-mean next-token loss of ONE window (unpadded examples)."""
    model = GPT2LMHeadModel(GPT2Config(**CONFIG)).double()
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(params[k])
    total, tokens = 0.0, 0
    for ex in examples:
        ids = torch.tensor([ex["input_ids"]])
        logits = model(input_ids=ids).logits[0, :-1]
        total = total + F.cross_entropy(logits, ids[0, 1:], reduction="sum")
        tokens += ids.size(1) - 1
    (total / tokens).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _rel(got: dict, want: dict) -> float:
    err = math.sqrt(sum(float((got[k] - want[k]).pow(2).sum()) for k in want))
    return err / math.sqrt(sum(float(want[k].pow(2).sum()) for k in want))


def _nearest_power_of_two(x: float) -> float:
    """Exact oracle (rationals): 2^k with 2^k <= x < 2^(k+1), or 2^(k+1) when x > 2^(k+1/2), i.e. x^2 > 2^(2k+1)."""
    from fractions import Fraction

    q = Fraction(x)
    if q <= 1:
        return 1.0
    k = q.numerator.bit_length() - q.denominator.bit_length()
    k = k if Fraction(2) ** k <= q else k - 1  # now 2^k <= q < 2^(k+1)
    return 2.0 ** (k + 1) if q * q > Fraction(2) ** (2 * k + 1) else 2.0 ** k


def test_power_of_two():
    """c, as a number and as a tensor computed on the device (no host read), is the power of two nearest x on a
    log scale (an exact rational oracle), also next to 2^(k + 1/2), where a rounded log2 can fall either way."""
    p2 = loss_module.power_of_two
    assert [p2(x) for x in (0.0, 1.0, 1.4, 1.5, 3.0, 5.0, 6.0, 200.0)] == [1, 1, 1, 2, 4, 4, 8, 256]
    convergents = [(99, 70), (239, 169), (577, 408), (1393, 985), (3363, 2378), (8119, 5741), (19601, 13860)]
    xs = [n / d * 2.0 ** k for n, d in convergents for k in range(0, 40, 3)]  # near sqrt(2) 2^k, from both sides
    xs += [math.sqrt(2.0) * 2.0 ** k for k in range(1, 60, 7)]  # the float just above sqrt(2) 2^k
    rng = random.Random(0)
    xs += [rng.randint(0, 10 ** 7) / rng.randint(1, 64) for _ in range(2000)] + [0.0, 0.5, 1.0, 2.0, 1e300]
    want = [_nearest_power_of_two(x) for x in xs]
    assert [p2(x) for x in xs] == want
    assert p2(torch.tensor(xs, dtype=torch.float64)).tolist() == want


def test_fp16_scaler_skips_steps_with_summed_losses_and_none_with_the_divisor(monkeypatch):
    examples = _examples()
    old, _, _ = _run(examples, fp16=True, old_arithmetic=True, monkeypatch=monkeypatch)
    new, result, init = _run(examples, fp16=True, old_arithmetic=False, monkeypatch=monkeypatch)
    steps = len(examples) // (K * B)
    assert len(old.skipped) == len(new.skipped) == steps
    print(f"fp16 GradScaler(init_scale 2^16), {steps} steps: skipped before (c = 1) {sum(old.skipped)} "
          f"(scales {old.scales}), after (c = 2^round(log2 tokens per micro-batch)) {sum(new.skipped)} "
          f"(scales {new.scales})")
    assert sum(old.skipped) >= 1, f"the summed-loss arithmetic did not overflow: {old.skipped}, {old.scales}"
    assert old.scales[-1] < 2.0 ** 16  # the scaler backed off
    assert not any(new.skipped) and new.scales == [2.0 ** 16] * steps, (new.skipped, new.scales)
    # every update equals the float64 big-batch gradient at the run's own pre-step parameters
    per_window, errors = K * B, []
    for s in range(steps):
        window = examples[s * per_window:(s + 1) * per_window]
        got = {k: (new.before[s][k] - new.after[s][k]) / LR for k in init}
        rel = _rel(got, _oracle_gradient(new.before[s], window))
        errors.append(rel)
        assert rel <= FP16_RTOL, f"step {s + 1}: normwise {rel:.2e} > fp16 tolerance {FP16_RTOL:.2e}"
        assert 1e-6 < rel, f"step {s + 1}: {rel:.2e} looks like fp32: did fp16 autocast run?"
    assert all(math.isfinite(x) for x in result.train_loss)
    print(f"fp16 + divisor: normwise deviation from the float64 oracle per step {['%.2e' % e for e in errors]}, "
          f"tolerance {FP16_RTOL:.2e}")


def test_divisor_leaves_fp32_bit_identical(monkeypatch):
    """c is a power of two: dividing the loss by it and multiplying the gradients back is exact."""
    examples = _examples(n=8, low=20, high=40, seed=1)
    old, _, _ = _run(examples, fp16=False, old_arithmetic=True, monkeypatch=monkeypatch)
    new, _, _ = _run(examples, fp16=False, old_arithmetic=False, monkeypatch=monkeypatch)
    assert len(new.after) == len(examples) // (K * B)
    for a, b in zip(old.after, new.after):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_verify_rejects_unknown_precision(capsys):
    assert cli.run("verify", ["--mixed_precision", "fp8"]) == 2
    assert "--mixed_precision" in capsys.readouterr().err


def test_verify_bf16_two_processes(tmp_path, ddp_pool):
    """``accum-kit verify --mixed_precision bf16`` on 2 DDP processes (a command of conftest.py's ``ddp_pool``)."""
    out = tmp_path / "verify.json"
    res = ddp_pool.submit("verify", ["--gradient_accumulation_steps", "3", "--mixed_precision", "bf16",
                                     "--json", out]).result()
    assert res.returncode == 0, res.describe()
    rep = json.loads(out.read_text())
    assert rep["world_size"] == 2 and rep["mixed_precision"] == "bf16" and rep["autocast"] is True
    assert rep["normwise"] is True and rep["rtol"] == pytest.approx(BF16_RTOL)
    tok, mom = rep["rows"]["tokens"], rep["rows"]["mean-of-means"]
    assert rep["passed"] is True and tok["passed"] is True and mom["passed"] is False
    print(f"verify bf16, 2 processes: tokens rel err per window {[w['rel_error'] for w in tok['windows']]}, "
          f"tolerance {rep['rtol']:.3g}; mean-of-means {[w['rel_error'] for w in mom['windows']]}")
    assert all(1e-5 < w["rel_error"] <= rep["rtol"] for w in tok["windows"]), tok["windows"]  # bf16 really ran
    assert all(w["rel_error"] > rep["rtol"] for w in mom["windows"]), mom["windows"]
    assert "tolerance (bf16): pass iff ||g - g_oracle|| / ||g_oracle|| <= rtol 0.0312" in res.stdout
    assert "bf16 autocast" in res.stdout
