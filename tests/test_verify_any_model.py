"""``verify_accumulation`` on models, losses and data other than verify's causal LM, and BatchNorm (in this process).

Each check compares verify's report with an oracle computed here in plain
float64 PyTorch from the example indices the report lists: a classifier on
scikit-learn's digits (summed cross-entropy, items = examples) and a tiny T5
(seq2seq, labels not shifted). Both show where per-micro-batch means fail and
where they cannot: with equal items per micro-batch only the partial window
(scaled by r / K) misses; with variable items the full window misses too.
BatchNorm in training mode: verify's finding against a deviation computed
here, the exit code unaffected; the loop's one warning. The two-process runs
of the same code are the digits rungs in the shared examples launch
(tests/test_examples_vision.py).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import job_helpers as jh
from accum_kit import LoopCallback, UsageError, classification_loss, seq2seq_loss, train_loop
from accum_kit.core.batchnorm import BatchNormAccumulationWarning
from accum_kit.verify import verify_accumulation

K, B = 3, 4
R = (K + 1) // 2  # micro-batches in the partial window


@pytest.fixture(scope="module")
def digits():
    """The first 64 digits as ``{"pixel_values": (1, 8, 8) float32, "labels": int64}``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images[:64], dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target[:64], dtype=torch.long)
    return [{"pixel_values": x[i], "labels": y[i]} for i in range(64)]


class SmallCNN(torch.nn.Module):
    def __init__(self, norm="group"):
        super().__init__()
        layer = torch.nn.BatchNorm2d(8) if norm == "batch" else torch.nn.GroupNorm(2, 8)
        self.body = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), layer, torch.nn.ReLU(),
                                        torch.nn.MaxPool2d(2))
        self.head = torch.nn.Linear(8 * 4 * 4, 10)

    def forward(self, pixel_values):
        return self.head(self.body(pixel_values).flatten(1))


def _cnn(norm="group", seed=0):
    torch.manual_seed(seed)
    return SmallCNN(norm)


def _norm(grads) -> float:
    return math.sqrt(sum(float(g.pow(2).sum()) for g in grads))


def _classifier_grad(model, examples, per_micro_batch=None, train_batchnorm=False):
    """float64 gradient, written here: mean cross-entropy over ``examples`` (labels -100 not counted).

    ``per_micro_batch``: instead, the mean over consecutive groups of that many
    examples of each group's own mean (what per-micro-batch means optimise).
    ``train_batchnorm``: BatchNorm normalises each forward with its own statistics.
    """
    m = _copy64(model, train_batchnorm)
    groups = [examples] if per_micro_batch is None else [examples[i:i + per_micro_batch]
                                                        for i in range(0, len(examples), per_micro_batch)]
    total = 0.0
    for g in groups:
        x = torch.stack([e["pixel_values"] for e in g]).double()
        y = torch.stack([e["labels"] for e in g])
        total = total + F.cross_entropy(m(x), y, ignore_index=-100, reduction="mean")
    (total / len(groups)).backward()
    return [p.grad for p in m.parameters()]


def _copy64(model, train_batchnorm=False):
    import copy

    m = copy.deepcopy(model).double().eval()
    for mod in m.modules():
        if train_batchnorm and isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
            mod.train()
    return m


# --------------------------------------------------------------------------- classification


def test_classifier_exact_and_mean_of_means_misses_only_the_partial_window(one_process, digits):
    model = _cnn()
    rep = verify_accumulation(model=model, loss_fn=classification_loss, dataset=digits, gradient_accumulation_steps=K,
                              per_device_train_batch_size=B)
    assert rep.passed and rep.exit_code == 0
    assert [w.examples for w in rep.windows] == [K * B, R * B] and [w.target_tokens for w in rep.windows] == [K * B, R * B]
    assert rep.windows[0].indices == list(range(K * B))  # the dataset's first examples, in order
    tok, mom = rep.row("tokens"), rep.row("mean-of-means")
    for w, tw in zip(rep.windows, tok.windows):
        want = _norm(_classifier_grad(model, [digits[i] for i in w.indices]))
        assert w.oracle_grad_norm == pytest.approx(want, rel=1e-9)  # verify's oracle == this one
        assert tw["grad_norm"] == pytest.approx(want, rel=1e-5)  # what the optimizer saw in train_loop
    # Equal items per micro-batch: the mean of means IS the item mean in the full window ...
    assert mom.windows[0]["rel_error"] < 1e-5
    # ... and the partial window of R micro-batches is still divided by K: R / K of the exact gradient
    assert mom.windows[1]["rel_error"] == pytest.approx(1 - R / K, rel=1e-4)
    assert not mom.passed and rep.row("sum").passed and rep.ddp_sum_ratio == pytest.approx(1.0, abs=1e-6)
    assert rep.row("trainer").skipped and rep.batchnorm is None
    text = rep.format()
    assert "compared with" in text and "big-batch item mean" in text and f"{K * B} items" in text


def test_classifier_with_unlabelled_examples_mean_of_means_fails_in_the_full_window(one_process, digits):
    # labels -100 on some examples: micro-batches hold different numbers of items
    data = [dict(e, labels=torch.tensor(-100)) if i % 4 == 1 or i in (8, 9, 10) else e for i, e in enumerate(digits)]
    model = _cnn(seed=1)
    rep = verify_accumulation(model=model, loss_fn=classification_loss, dataset=data, gradient_accumulation_steps=K,
                              per_device_train_batch_size=B, loss_normalization="mean")
    assert rep.exit_code == 1 and not rep.passed  # the selected row (mean) fails: exit semantics of the CLI
    assert rep.row("tokens").passed
    w1 = rep.windows[0]
    examples = [data[i] for i in w1.indices]
    assert w1.target_tokens == sum(int(e["labels"]) != -100 for e in examples) < K * B
    mom = rep.row("mean-of-means").windows[0]
    assert mom["rel_error"] > 1e-2  # a real miss in the full window
    # and what that row computed is exactly the mean of per-micro-batch means, computed here
    assert mom["grad_norm"] == pytest.approx(_norm(_classifier_grad(model, examples, per_micro_batch=B)), rel=1e-5)


def test_bad_workloads_are_refused_naming_the_argument(one_process, digits):
    with pytest.raises(UsageError, match="dataset: has 10 examples; verify needs 20"):
        verify_accumulation(model=_cnn(), loss_fn=classification_loss, dataset=digits[:10],
                            gradient_accumulation_steps=K, per_device_train_batch_size=B)
    with pytest.raises(UsageError, match="dataset: .* has no len"):
        verify_accumulation(model=_cnn(), loss_fn=classification_loss, dataset=iter(digits),
                            gradient_accumulation_steps=K, per_device_train_batch_size=B)
    with pytest.raises(UsageError, match="loss_fn: .* is not callable"):
        verify_accumulation(model=_cnn(), loss_fn="cross_entropy", dataset=digits, gradient_accumulation_steps=K,
                            per_device_train_batch_size=B)
    with pytest.raises(UsageError, match="no config.vocab_size"):  # no dataset: verify's token data needs an LM
        verify_accumulation(model=_cnn(), gradient_accumulation_steps=K, per_device_train_batch_size=B)


# --------------------------------------------------------------------------- seq2seq


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=48, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg)


def _seq2seq_data(n):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        src = torch.randint(2, 48, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g)
        tgt = torch.randint(2, 48, (1 + (7 * i) % 11,), generator=g)  # 1..11 target tokens
        out.append({"input_ids": src, "labels": tgt})
    return out


def _pad_seq2seq(examples):
    def pad(seqs, value):
        width = max(len(s) for s in seqs)
        return torch.stack([torch.cat([s, s.new_full((width - len(s),), value)]) for s in seqs])

    ids = pad([e["input_ids"] for e in examples], 0)
    return {"input_ids": ids, "attention_mask": (pad([torch.ones_like(e["input_ids"]) for e in examples], 0)),
            "labels": pad([e["labels"] for e in examples], -100)}


def test_seq2seq_labels_not_shifted_against_an_independent_oracle(one_process):
    model, data = _t5(), _seq2seq_data(16)
    k, b = 2, 2
    rep = verify_accumulation(model=model, loss_fn=seq2seq_loss, dataset=data, collate_fn=_pad_seq2seq,
                              gradient_accumulation_steps=k, per_device_train_batch_size=b)
    assert rep.passed and rep.row("tokens").passed and not rep.row("mean-of-means").passed
    for w, tw, mw in zip(rep.windows, rep.row("tokens").windows, rep.row("mean-of-means").windows):
        examples = [data[i] for i in w.indices]
        assert w.target_tokens == sum(len(e["labels"]) for e in examples)  # every label counts: nothing shifted
        # oracle written here: one padded batch, float64, logits t against label t (T5 shifts labels itself)
        m = _copy64(model)
        batch = _pad_seq2seq(examples)
        logits = m(**batch).logits
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1), ignore_index=-100).backward()
        want = _norm([p.grad for p in m.parameters() if p.grad is not None])
        assert w.oracle_grad_norm == pytest.approx(want, rel=1e-7)  # T5LayerNorm takes its variance in float32
        assert tw["grad_norm"] == pytest.approx(want, rel=1e-5)
    assert rep.row("mean-of-means").windows[0]["rel_error"] > 1e-3  # variable target lengths: the full window misses


# --------------------------------------------------------------------------- BatchNorm


def test_batchnorm_is_a_finding_not_a_failure(one_process, digits):
    model = _cnn("batch", seed=2)
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    k = 4
    rep = verify_accumulation(model=model, loss_fn=classification_loss, dataset=digits, gradient_accumulation_steps=k,
                              per_device_train_batch_size=B)
    assert rep.passed and rep.exit_code == 0  # the exact rows run in eval mode (running statistics) and pass
    assert rep.row("tokens").passed
    f = rep.batchnorm
    assert f["layers"] == ["body.1"] and len(f["windows"]) == 2 and f["fixes"]
    row = rep.row("batchnorm (train mode)")
    assert row.informational and [w["rel_error"] for w in row.windows] == [w["rel_error"] for w in f["windows"]]
    r = (k + 1) // 2
    for n_micro, w, got in zip((k, r), rep.windows, f["windows"]):
        examples = [digits[i] for i in w.indices]
        exact = _classifier_grad(model, examples, train_batchnorm=True)  # one batch: its own statistics
        # accumulated here: per micro-batch statistics; every example labelled, so the mean of the micro-batch
        # means is the summed loss / all items, what train_loop optimises
        per = _classifier_grad(model, examples, per_micro_batch=B, train_batchnorm=True)
        want = _norm([a - b for a, b in zip(per, exact)]) / _norm(exact)
        assert len(examples) == n_micro * B
        assert got["rel_error"] == pytest.approx(want, rel=1e-3)
        assert got["rel_error"] > 1e-3  # BatchNorm really moves it
    text = rep.format()
    assert "finding (informational, exit code unaffected): 1 BatchNorm layer(s) (body.1)" in text
    assert "fix: GroupNorm" in text
    assert "PASSES -> exit 0" in text
    for name, v in model.state_dict().items():  # the caller's model, running statistics included, is untouched
        assert torch.equal(v, buffers[name]), name
    # A model given in eval mode (as from_pretrained returns it) trains all the same: train_loop calls model.train()
    jh.reset_accelerate_state()
    evald = verify_accumulation(model=model.eval(), loss_fn=classification_loss, dataset=digits,
                                gradient_accumulation_steps=k, per_device_train_batch_size=B)
    assert evald.batchnorm["windows"] == f["windows"]
    # K=1 on one process: every window is one forward, the big batch itself; nothing to measure
    jh.reset_accelerate_state()
    one = verify_accumulation(model=model, loss_fn=classification_loss, dataset=digits, gradient_accumulation_steps=1,
                              per_device_train_batch_size=B, trainer_row=False)
    assert one.passed and one.batchnorm is None and "batchnorm (train mode)" not in [r.name for r in one.rows]


def test_batchnorm_finding_says_when_it_is_within_rounding():
    from accum_kit.verify.batchnorm import FIXES, finding_lines

    def lines(rel):
        finding = {"layers": ["bn"], "windows": [{"rel_error": rel, "cosine": 1.0, "norm_ratio": 1.0}],
                   "rel_error": rel, "fixes": list(FIXES)}
        return "\n".join(finding_lines(finding, 1, 64, 2, rtol=1e-4))

    assert "within the tolerance" in lines(5e-7) and "within the tolerance" not in lines(2e-2)
    assert "128 in a full window of K=1 on 2 process(es)" in lines(2e-2)


class _FreezeBatchNorm(LoopCallback):
    def __init__(self, model):
        self.model = model

    def on_train_begin(self, state):
        for m in self.model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.eval()


def _loop_warnings(accelerator, k, norm, digits, freeze=False):
    acc = accelerator(k)
    model = _cnn(norm)
    loader = torch.utils.data.DataLoader(digits[:16], batch_size=4)
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train_loop(acc, model, opt, loader, num_train_epochs=1, loss_fn=classification_loss, progress=False,
                   callbacks=[_FreezeBatchNorm(model)] if freeze else ())
    return [w for w in seen if issubclass(w.category, BatchNormAccumulationWarning)]


def test_loop_warns_once_when_batchnorm_trains_under_accumulation(accelerator, digits):
    found = _loop_warnings(accelerator, 2, "batch", digits)  # 4 micro-batches, 2 windows: still one warning
    assert len(found) == 1, [str(w.message) for w in found]
    msg = str(found[0].message)
    assert "1 BatchNorm layer(s)" in msg and "K=2" in msg and "GroupNorm" in msg and "docs/batchnorm.md" in msg
    assert found[0].filename == __file__  # points at the caller of train_loop
    assert not _loop_warnings(accelerator, 1, "batch", digits)  # K=1: no accumulation
    assert not _loop_warnings(accelerator, 2, "group", digits)  # no BatchNorm
    assert not _loop_warnings(accelerator, 2, "batch", digits, freeze=True)  # frozen by a callback: eval mode
