"""Tests of ``accum-kit verify`` (the package accum_kit/verify/).

A real two-process run (``accum-kit verify`` under ``accelerate launch --config_file
accelerate_configs/cpu_ddp.yaml``, gloo, K=3 with a partial last window; a command of
conftest.py's shared ``ddp_pool`` launch; under FSDP2 one of its ``fsdp_pool``) checks the exit code and the JSON report: the toolkit's ``tokens``
normalisation matches the single-process big batch, mean-of-means does not, and
DDP's averaging shows as a sum-loss ratio of 1/2. The big-batch gradient norm in
the JSON is then recomputed here from the examples the report lists, with a
plain float64 PyTorch loss written in this file. Single-process runs call
``cli.run("verify", argv)`` in this process (no second import of torch) for the
exit codes 0, 1 and 2.

The informational ``trainer`` row (transformers' Trainer on the same windows)
is checked against label counts taken here from the examples the report
lists: for GPT-2 (``loss_type`` None) Trainer divides by every label before
the shift, so its update is ``N / (N + examples)`` of the exact one; for the
``llama_tiny`` preset (the next command of the same pool) it is exact.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from accum_kit import cli, verify
from accum_kit.launch import DEFAULT_GRADIENT_ACCUMULATION_STEPS
from accum_kit.job.models import build_model

K = 3
B = verify.DEFAULT_BATCH_SIZE
WORLD = 2
R = (K + 1) // 2  # micro-batches per process in the partial window (documented: ceil(K / 2))


def _finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


# --------------------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def launches(tmp_path_factory, ddp_pool, fsdp_pool):
    """Queue the two DDP runs (GPT-2 tiny and llama_tiny) on conftest.py's shared ``ddp_pool`` and the FSDP2 run
    on its ``fsdp_pool`` (each pool one 2-process launch); each fixture below waits for its own."""
    started = {}
    for name, pool, extra in (("tiny", ddp_pool, []), ("llama_tiny", ddp_pool, ["--model_preset", "llama_tiny"]),
                              ("fsdp", fsdp_pool, ["--accumulation_policy", "no_sync_no_reshard", "--no_trainer_row"])):
        out = tmp_path_factory.mktemp(f"verify_w2_{name}") / "verify.json"
        started[name] = (pool.submit("verify", ["--gradient_accumulation_steps", K, *extra, "--json", out]), out)
    return started


def _finished(launches, name):
    job, out = launches[name]
    res = job.result()
    assert res.returncode == 0, res.describe()
    assert out.exists(), f"no JSON written\n{res.describe()}"
    return res, json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_processes(launches):
    return _finished(launches, "tiny")


@pytest.fixture(scope="module")
def two_processes_llama(launches):
    return _finished(launches, "llama_tiny")


@pytest.fixture(scope="module")
def two_processes_fsdp(launches):
    return _finished(launches, "fsdp")


def test_fsdp2_gives_the_same_rows_and_verdicts(two_processes, two_processes_fsdp):
    """Under FSDP2 (parameters kept gathered through the window): tokens passes, mean-of-means and sum fail,
    and every row's gradient equals the DDP run's (the same examples and oracle)."""
    res, rep = two_processes_fsdp
    ddp = two_processes[1]
    assert rep["distributed_type"] == "FSDP" and rep["accumulation_policy"] == "no_sync_no_reshard"
    assert "accumulation policy no_sync_no_reshard" in res.stdout
    assert (rep["passed"], rep["exit_code"]) == (True, 0)
    for name in ("tokens", "mean-of-means", "sum"):
        row, twin = rep["rows"][name], ddp["rows"][name]
        assert row["passed"] == twin["passed"] and row["rank_spread"] < 1e-6, name
        assert row["rel_error"] == pytest.approx(twin["rel_error"], rel=1e-3, abs=1e-6), name
    assert rep["ddp_sum_ratio"] == pytest.approx(0.5, abs=1e-4)
    assert "FSDP2's reduce-scatter averages: sum-loss gradient" in res.stdout


def test_two_processes_tokens_pass_mean_of_means_fail(two_processes):
    res, rep = two_processes
    assert rep["world_size"] == WORLD and rep["distributed_type"] == "MULTI_CPU", rep["distributed_type"]
    assert rep["gradient_accumulation_steps"] == K
    assert rep["selected"] == "tokens" and rep["passed"] is True and rep["exit_code"] == 0
    # a full window, then a partial one
    w1, w2 = rep["windows"]
    assert (w1["partial"], w1["micro_batches_per_process"], w1["examples"]) == (False, K, K * B * WORLD)
    assert (w2["partial"], w2["micro_batches_per_process"], w2["examples"]) == (True, R, R * B * WORLD)
    rows = rep["rows"]
    tok, mom, sm = rows["tokens"], rows["mean-of-means"], rows["sum"]
    assert tok["passed"] is True and mom["passed"] is False and sm["passed"] is False
    for row in (tok, mom, sm):
        assert _finite(row["max_abs_error"], row["rel_error"], row["tolerance_used"], row["rank_spread"]), row
        assert row["rank_spread"] < 1e-6, f"{row['name']}: ranks hold different gradients"
        assert len(row["windows"]) == 2
    assert tok["tolerance_used"] <= 1 and tok["rel_error"] < rep["rtol"]
    # mean-of-means misses in both windows, by far more than the tolerance (variable lengths; partial window / K)
    assert all(w["rel_error"] > 100 * rep["rtol"] for w in mom["windows"]), mom["windows"]
    # DDP averages over the 2 processes: the sum loss gives half the big-batch sum gradient
    assert rep["ddp_sum_ratio"] == pytest.approx(0.5, abs=1e-4)
    assert rep["ddp_sum_residual"] < 1e-4
    assert all(w["rel_error"] == pytest.approx(0.5, abs=1e-4) for w in sm["windows"])
    dp = rows["sum (DataParallel)"]
    assert dp["skipped"] and "2 CUDA GPUs" in dp["skipped"] and dp["passed"] is None
    # the table is printed once (main process) and states the semantics
    assert res.stdout.count("accum-kit verify:") == 1, res.stdout
    assert "DDP averages: sum-loss gradient = big-batch sum gradient x 1/2 (measured ratio 0.5000" in res.stdout
    assert "verdict: tokens (--loss_normalization tokens) PASSES -> exit 0" in res.stdout
    json.dumps(rep, allow_nan=False)  # strict JSON: no NaN for the skipped row


def _token_mean_grad_norm(model, sequences) -> tuple[float, int]:
    """Plain float64 PyTorch: one padded batch, mean next-token loss over all target tokens, grad norm."""
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    labels = ids.masked_fill(mask == 0, -100)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="mean")
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
    return norm, int((labels[:, 1:] != -100).sum())


def test_oracle_and_accumulated_gradient_norms_recomputed_here(two_processes):
    _, rep = two_processes
    m = rep["model"]
    assert m["preset"] == "tiny"
    model = build_model("tiny", m["vocab_size"], m["n_positions"], seed=m["init_seed"]).double().eval()
    seen = []
    for w, tok_w, sum_w in zip(rep["windows"], rep["rows"]["tokens"]["windows"], rep["rows"]["sum"]["windows"]):
        seqs = w["input_ids"]
        assert len(seqs) == w["examples"]
        assert all(2 <= len(s) <= m["max_length"] for s in seqs)
        seen += [tuple(s) for s in seqs]
        norm, tokens = _token_mean_grad_norm(model, seqs)
        assert tokens == w["target_tokens"] == sum(len(s) - 1 for s in seqs)
        assert w["oracle_grad_norm"] == pytest.approx(norm, rel=1e-8)
        assert tok_w["grad_norm"] == pytest.approx(norm, rel=1e-5)  # what train_loop's optimizer saw
        assert sum_w["grad_norm"] == pytest.approx(norm * tokens / WORLD, rel=1e-5)  # DDP: sum / W
    assert len(seen) == len(set(seen)) == (K + R) * B * WORLD  # every example once: no duplicated padding
    lengths = {len(s) for s in seen}
    assert len(lengths) > 5, "examples should have many different lengths"


def _trainer_checks(rep, model_family_factor):
    """The trainer row of one report: informational, same windows, factor per window as predicted here."""
    tr = rep["rows"]["trainer"]
    assert tr["informational"] is True and tr["skipped"] is None
    assert rep["passed"] is True and rep["exit_code"] == 0  # whatever the trainer row says
    assert tr["summary"]["same_examples_as_tokens_row"] is True
    assert tr["rank_spread"] < 1e-6
    for w, tw in zip(rep["windows"], tr["windows"]):
        seqs = w["input_ids"]
        n = sum(len(s) - 1 for s in seqs)  # targets after the shift (no padding in these lists)
        labels = sum(len(s) for s in seqs)  # labels before the shift: one more per example
        assert tw["target_tokens"] == n and tw["labels_counted_before_shift"] == labels
        want = model_family_factor(n, labels)
        assert tw["factor"] == pytest.approx(want, rel=1e-6, abs=1e-6), (w["index"], tw["factor"], want)
        assert tw["norm_ratio"] == pytest.approx(want, rel=1e-5)
        assert tw["cosine"] == pytest.approx(1.0, abs=1e-6)
    return tr


def test_trainer_row_gpt2_counts_labels_before_the_shift(two_processes):
    res, rep = two_processes
    tr = _trainer_checks(rep, lambda n, labels: n / labels)
    assert all(tw["factor"] < 1 - 1e-3 for tw in tr["windows"])  # visibly small, not rounding
    s = tr["summary"]
    assert s["labels_counted_before_shift"] is True and s["exact"] is False
    assert s["loss_type"] is None and s["loss_shifts_labels"] is False and s["model_class"] == "GPT2LMHeadModel"
    assert "loss_type is None" in res.stdout and "N / (N + examples)" in res.stdout
    assert "trainer, partial window:" in res.stdout
    # the captured update itself: the exact gradient norm recomputed here x N / (N + examples)
    m = rep["model"]
    model = build_model("tiny", m["vocab_size"], m["n_positions"], seed=m["init_seed"]).double().eval()
    for w, tw in zip(rep["windows"], tr["windows"]):
        norm, n = _token_mean_grad_norm(model, w["input_ids"])
        assert tw["grad_norm"] == pytest.approx(norm * n / (n + len(w["input_ids"])), rel=1e-5)


def test_trainer_row_llama_is_exact(two_processes_llama):
    from accum_kit.job.models import build_llama_model

    res, rep = two_processes_llama
    assert rep["model"]["class"] == "LlamaForCausalLM" and rep["model"]["preset"] == "llama_tiny"
    assert rep["rows"]["tokens"]["passed"] and not rep["rows"]["mean-of-means"]["passed"]
    tr = _trainer_checks(rep, lambda n, labels: 1.0)
    assert abs(tr["summary"]["factor"] - 1) < 1e-6 and tr["summary"]["exact"] is True
    assert "exact: LlamaForCausalLM's loss_type is 'ForCausalLM'" in res.stdout
    m = rep["model"]
    model = build_llama_model("llama_tiny", m["vocab_size"], m["n_positions"], seed=m["init_seed"]).double().eval()
    for w, tw in zip(rep["windows"], tr["windows"]):
        norm, _ = _token_mean_grad_norm(model, w["input_ids"])
        assert tw["grad_norm"] == pytest.approx(norm, rel=1e-5)


# --------------------------------------------------------------------------- one process, in this process


def test_single_process_exit_0_and_json(one_process, tmp_path, capsys):
    out = tmp_path / "sub" / "v.json"
    assert cli.run("verify", ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["world_size"] == 1 and rep["windows"][1]["partial"]
    assert rep["gradient_accumulation_steps"] == DEFAULT_GRADIENT_ACCUMULATION_STEPS == 4  # the project's one default
    assert rep["rows"]["tokens"]["passed"] and rep["rows"]["tokens"]["tolerance_used"] <= 1
    assert not rep["rows"]["mean-of-means"]["passed"]
    # no DDP: the sum loss is the big-batch sum gradient
    assert rep["ddp_sum_ratio"] == pytest.approx(1.0, abs=1e-4) and rep["rows"]["sum"]["passed"]
    assert "1 process, no DDP: sum-loss gradient = big-batch sum gradient x 1" in text
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temporary file left behind"
    # the trainer row is there, 5-ish % small (GPT-2), and the exit code above is 0 all the same
    tr = rep["rows"]["trainer"]
    assert tr["informational"] and tr["summary"]["labels_counted_before_shift"] and tr["summary"]["factor"] < 0.99
    assert "trainer (informational, exit code unaffected)" in text


def test_trainer_row_leaves_the_callers_state_alone(one_process):
    """Trainer builds its own Accelerator (shared GradientState, num_steps=1) and seeds Python's RNG: both restored."""
    import random

    from accelerate.state import GradientState

    from accum_kit.launch import build_accelerator

    acc = build_accelerator(3)
    py = random.getstate()
    before = torch.get_rng_state()
    rep = verify.verify_accumulation(acc, per_device_train_batch_size=1, seed=4)
    assert rep.row("trainer").skipped is None and rep.passed
    assert acc.gradient_accumulation_steps == 3 and GradientState().num_steps == 3
    assert acc.sync_gradients
    assert random.getstate() == py and torch.equal(torch.get_rng_state(), before)


def test_mean_of_means_selected_exit_1(one_process, capsys):
    assert cli.run("verify", ["--loss_normalization", "mean", "--no_trainer_row"]) == 1
    out = capsys.readouterr().out
    assert "verdict: mean-of-means (--loss_normalization mean) FAILS -> exit 1" in out
    assert "trainer" not in out


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps"),
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
        (["--rtol", "0"], "--rtol"),
        (["--rtol", "nan"], "--rtol"),
        (["--tolerance", "1"], "--tolerance"),  # renamed to --rtol: the old flag is refused
        (["--atol", "-1"], "--atol"),
        (["--loss_normalization", "sum"], "--loss_normalization"),
        (["--gradient_accumulation_steps", "two"], "--gradient_accumulation_steps"),
        (["--model_name_or_path", "MISSING_DIR"], "--model_name_or_path"),
        (["--model_preset", "huge"], "--model_preset"),
        (["--model_preset", "llama_tiny", "--model_name_or_path", "MISSING_DIR"], "--model_preset"),
    ],
)
def test_bad_input_exit_2(one_process, tmp_path, capsys, argv, flag):
    argv = [str(tmp_path / a) if a == "MISSING_DIR" else a for a in argv]
    assert cli.run("verify", argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err, err


def test_registered_in_cli(one_process, capsys):
    assert cli.main(["verify", "--gradient_accumulation_steps", "0"]) == 2
    assert "verify" in cli._usage()


# --------------------------------------------------------------------------- Python API


def test_python_api_and_the_check_is_not_rigged(one_process):
    # K=1, one micro-batch of one example, no partial window: every normalisation is the same arithmetic,
    # so mean-of-means must pass too (the failure above is real, not built in).
    rep = verify.verify_accumulation(gradient_accumulation_steps=1, per_device_train_batch_size=1,
                                     partial_window=False, loss_normalization="mean", seed=5, trainer_row=False)
    assert rep.passed and rep.exit_code == 0 and len(rep.windows) == 1
    assert rep.row("tokens").passed and rep.row("mean-of-means").passed and rep.row("sum").passed
    d = rep.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["rows"]["mean-of-means"]["passed"] and d["world_size"] == 1
    text = rep.format()
    assert "no partial window (--no_partial_window)" in text and "mean-of-means" in text


def test_dataparallel_row_arithmetic(one_process):
    """Forces the DataParallel row on CPU. Without GPUs DataParallel calls the module directly, so this
    checks the row's loss wrapper and arithmetic (ratio 1), not multi-GPU scatter/gather."""
    rep = verify.verify_accumulation(gradient_accumulation_steps=2, dataparallel=True, seed=2, trainer_row=False)
    row = rep.row("sum (DataParallel)")
    assert row.skipped is None and row.passed
    assert rep.dataparallel_sum_ratio == pytest.approx(1.0, abs=1e-4)
    assert "DataParallel sums" in rep.format()


def test_local_model_with_dropout(one_process, tmp_path, capsys):
    """--model_name_or_path: a saved GPT-2 with the default dropout 0.1 still matches (dropout is switched off)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=96, n_positions=24, n_embd=32, n_layer=1, n_head=2)
    assert cfg.resid_pdrop > 0 and cfg.attn_pdrop > 0
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "m")
    out = tmp_path / "v.json"
    assert cli.run("verify", ["--model_name_or_path", str(tmp_path / "m"), "--json", str(out)]) == 0, capsys.readouterr()
    rep = json.loads(out.read_text())
    assert rep["model"]["vocab_size"] == 96 and rep["model"]["max_length"] == 24
    assert all(max(map(len, w["input_ids"])) <= 24 and max(max(s) for s in w["input_ids"]) < 96 for w in rep["windows"])
    assert rep["rows"]["tokens"]["passed"] and not rep["rows"]["mean-of-means"]["passed"]
    # Trainer puts the model in training mode: its copy's dropout is switched off, so its update is
    # deterministic and exactly N / (N + examples) of the oracle (GPT-2 counts labels before the shift)
    for w, tw in zip(rep["windows"], rep["rows"]["trainer"]["windows"]):
        n, labels = sum(len(s) - 1 for s in w["input_ids"]), sum(len(s) for s in w["input_ids"])
        assert tw["factor"] == pytest.approx(n / labels, rel=1e-6) and tw["cosine"] == pytest.approx(1, abs=1e-6)
