"""The causal-LM loss computed in the output layer in chunks (accum_kit.core.loss.CausalLMLoss), in one process.

Oracle: the cross-entropy of the full logits in float64 (plain torch, ``F.cross_entropy`` of
``hidden @ W.T + b``, or the model's logits shifted by hand), never accum_kit's own logits path. The
multi-process engines (DDP, FSDP2, HSDP, ZeRO, tp / cp, compile, checkpointing) run this loss by default
in their exactness tests against the float64 big batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from accum_kit.core.linear_cross_entropy import chunk_tokens, chunked_linear_cross_entropy, held_bytes
from accum_kit.core.loss import CausalLMLoss, logits_causal_lm_loss
from accum_kit.errors import UsageError

ATOL, RTOL = 1e-6, 1e-5  # the project's fp32 criterion against float64


def plain64(h, W, b, t):
    """Summed cross-entropy of the full float64 logits, -100 ignored."""
    z = h.double() @ W.double().t() + (b.double() if b is not None else 0)
    return F.cross_entropy(z, t, ignore_index=-100, reduction="sum")


def grads(fn, *tensors):
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in tensors[:3]]
    loss = fn(*leaves, tensors[3])
    loss.backward()
    return loss.detach(), [x.grad if x is not None else None for x in leaves]


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_and_gradients_equal_the_float64_logits(chunk, bias):
    g = torch.Generator().manual_seed(0)
    N, h, V = 50, 16, 300
    hid, W = torch.randn(N, h, generator=g), torch.randn(V, h, generator=g) * 0.3
    b = torch.randn(V, generator=g) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = -100
    ref, ref_g = grads(plain64, hid.double(), W.double(), None if b is None else b.double(), t)
    got, got_g = grads(lambda hh, ww, bb, tt: chunked_linear_cross_entropy(hh, ww, tt, bb, chunk=chunk), hid, W, b, t)
    assert got.dtype == torch.float32
    assert abs(float(got) - float(ref)) <= 1e-6 * abs(float(ref))
    for mine, oracle in zip(got_g, ref_g):
        if oracle is None:
            assert mine is None
            continue
        assert mine.dtype == torch.float32
        assert torch.allclose(mine.double(), oracle, atol=ATOL, rtol=RTOL), float((mine.double() - oracle).abs().max())


def test_every_label_ignored_gives_zero_loss_zero_gradients_and_no_nan():
    hid, W = torch.randn(6, 4, requires_grad=True), torch.randn(10, 4, requires_grad=True)
    loss = chunked_linear_cross_entropy(hid, W, torch.full((6,), -100), chunk=4)
    loss.backward()
    assert float(loss) == 0.0
    assert torch.count_nonzero(hid.grad) == 0 and torch.count_nonzero(W.grad) == 0


def test_under_bf16_autocast_it_equals_the_autocast_logits_path():
    """Under autocast the matmul runs in bf16 in both paths; the loss then differs by rounding only."""
    g = torch.Generator().manual_seed(1)
    N, h, V = 96, 32, 500
    hid, W, t = torch.randn(N, h, generator=g), torch.randn(V, h, generator=g) * 0.2, torch.randint(0, V, (N,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(hid, W).float(), t, reduction="sum")
        got = chunked_linear_cross_entropy(hid, W, t, chunk=40)
    exact = float(plain64(hid, W, None, t))
    assert abs(float(got) - float(ref)) <= 1e-5 * abs(float(ref))
    assert abs(float(got) - exact) <= 2 * abs(float(ref) - exact) + 1e-5 * exact  # no worse than the logits path


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an op produced while the mode was on."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def gpt2(vocab=512, bias=False, dtype=torch.float32):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=vocab, n_positions=64,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=not bias))
    if bias:  # an untied output layer with a bias
        m.lm_head = torch.nn.Linear(32, vocab, bias=True)
        torch.nn.init.normal_(m.lm_head.bias)
    return m.to(dtype)


def batch_of(vocab, b=4, s=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :9] = -100  # a masked prompt
    labels[-1, s * 2 // 3:] = -100  # padding
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def shifted_ce64(model64, batch):
    """The oracle: the float64 model's logits, shifted by hand, summed cross-entropy."""
    logits = model64(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("bias", [False, True])
def test_causal_lm_loss_in_the_output_layer_equals_the_float64_logits(bias):
    model = gpt2(bias=bias)
    model64 = copy.deepcopy(model).double()
    batch = batch_of(512)
    loss_fn = CausalLMLoss(chunk=24)
    summed, n = loss_fn(model, batch)
    summed.backward()
    oracle = shifted_ce64(model64, batch)
    oracle.backward()
    assert loss_fn.used == {"fused_linear_cross_entropy": "auto", "implementation": "chunked", "reason": None,
                            "chunk_tokens": 24}
    assert int(n) == int((batch["labels"][:, 1:] != -100).sum())
    assert abs(float(summed) - float(oracle)) <= 1e-6 * float(oracle)
    for (name, p), p64 in zip(model.named_parameters(), model64.parameters()):  # token-mean gradients, as a step sees
        assert torch.allclose(p.grad.double() / int(n), p64.grad / int(n), atol=ATOL, rtol=RTOL), name
    # the model's own forward is untouched when no labels are handed over
    with torch.no_grad():
        assert model(input_ids=batch["input_ids"]).logits.shape == (4, 32, 512)


def test_no_full_vocabulary_tensor_is_made_and_the_logits_path_makes_one():
    b, s, V, chunk = 4, 64, 512, 16  # b s V = 131072 elements; the output weight V h = 16384
    model, batch = gpt2(vocab=V), batch_of(V, b, s)
    fused, logits = LargestTensor(), LargestTensor()
    with fused:
        CausalLMLoss(chunk=chunk)(model, batch)[0].backward()
    with logits:
        logits_causal_lm_loss(model, batch)[0].backward()
    assert logits.largest >= b * (s - 1) * V  # the counter sees the logits when they exist
    # the largest tensor left is a block's MLP activation (b s 4h = 32768 elements), a quarter of the logits
    assert fused.largest <= max(V * 32, chunk * V, b * s * 4 * 32) <= b * s * V // 4


def test_held_bytes_formula_counts_what_the_loss_saves():
    """What the loss keeps for its backward, from autograd's saved tensors, against :func:`held_bytes`."""
    N, h, V = 40, 16, 200
    hid, W = torch.randn(N, h, requires_grad=True), torch.randn(V, h, requires_grad=True)
    b = torch.randn(V, requires_grad=True)
    saved = {}

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_linear_cross_entropy(hid, W, torch.randint(0, V, (N,)), b, chunk=8)
    assert sum(saved.values()) == held_bytes(N, h, V, bias=True)


def test_deepcopy_of_the_model_switches_its_own_layer():
    model, batch = gpt2(), batch_of(512)
    loss_fn = CausalLMLoss()
    loss_fn(model, batch)  # installs the switch on model's output layer
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2.0)  # the twin must use its own weight
        a, b = loss_fn(model, batch)[0], loss_fn(twin, batch)[0]
        ref = float(shifted_ce64(copy.deepcopy(twin).double(), batch))
    assert abs(float(b) - ref) <= 1e-6 * ref and abs(float(a) - float(b)) > 1e-3 * ref


def test_models_it_cannot_serve_fall_back_under_auto_and_fail_when_asked_for():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                           final_logit_softcapping=30.0))
    batch = batch_of(64, 2, 8)
    auto = CausalLMLoss()
    summed, _ = auto(gemma, batch)
    assert auto.used["implementation"] == "logits" and "final_logit_softcapping" in auto.used["reason"]
    assert torch.allclose(summed, logits_causal_lm_loss(gemma, batch)[0])
    with pytest.raises(UsageError, match="--fused_linear_cross_entropy: chunked cannot run.*final_logit_softcapping"):
        CausalLMLoss("chunked")(gemma, batch)


def test_a_model_that_changes_the_layers_result_is_refused_on_its_first_call():
    from transformers import GPT2LMHeadModel

    class Scaled(GPT2LMHeadModel):  # rescales the logits after the output layer, with no config field saying so
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 0.5
            return out

    model = gpt2()
    model.__class__ = Scaled
    with pytest.raises(UsageError, match="does not return its output layer's result unchanged"):
        CausalLMLoss()(model, batch_of(512))


def test_bad_settings_name_the_flag():
    with pytest.raises(UsageError, match="--fused_linear_cross_entropy: unknown value 'yes'"):
        CausalLMLoss("yes")
    with pytest.raises(UsageError, match="--fused_linear_cross_entropy_chunk"):
        CausalLMLoss(chunk=0)


def test_default_chunk_keeps_a_chunks_logits_within_64_mib():
    assert chunk_tokens(50257) == 333 and 333 * 50257 * 4 <= 64 * 2**20 < 334 * 50257 * 4
    assert chunk_tokens(10**9) == 1


def test_a_model_compiled_alone_runs_the_fused_loss_outside_its_graph():
    """One process, torch.compile of the whole model (no DDP): the output layer's loss runs eagerly at a graph
    break; the loss and gradients equal the eager model's."""
    model, batch = gpt2(), batch_of(512, 2, 16)
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    loss_fn = CausalLMLoss(chunk=8)
    got, want = loss_fn(compiled, batch)[0], loss_fn(twin, batch)[0]
    got.backward()
    want.backward()
    assert loss_fn.used["implementation"] == "chunked"
    assert torch.equal(got.detach(), want.detach())
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7, rtol=1e-6)
