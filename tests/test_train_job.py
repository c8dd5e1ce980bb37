"""The train job end to end: ``accelerate launch ... -m accum_kit train`` and ``accum_kit.job.train.main``.

Data: a small ``--train_file`` made of real CPython standard-library sources
(the job's default corpus is the whole stdlib, too slow to tokenise in a test).
Expected values come from the flags by arithmetic, from the saved files read
back with plain ``transformers``, or from the corpus recomputed here with the
same byte tokenizer; never from the summary code itself.

Cost: one command on conftest.py's shared 2-process ``ddp_pool``, the FSDP2 launches, three small
subprocess runs, and in-process ``main(argv)`` calls for the rest.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

import job_helpers as jh

PRESET = "tiny"
BLOCK = 64
B, K, WORLD, STEPS = 2, 3, 2, 8
MAX_TRAIN, MAX_EVAL = 200, 32
SEED = 42  # the job's default --seed
BYTE_VOCAB = 384  # ByT5Tokenizer: 256 bytes + 3 specials + 125 extra ids


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A module directory: the corpus, a datasets cache shared by every run of this module."""
    root = tmp_path_factory.mktemp("train_job")
    jh.write_corpus(root / "stdlib_corpus.txt")
    (root / "hf_datasets_cache").mkdir()
    return root


@pytest.fixture(scope="module")
def corpus(work) -> Path:
    return work / "stdlib_corpus.txt"


def job_flags(output_dir, *extra, train_file=None, preset=PRESET):
    flags = ["--model_preset", preset, "--block_size", str(BLOCK), "--output_dir", str(output_dir),
             "--learning_rate", "3e-3", "--num_warmup_steps", "0", "--logging_steps", "4"]
    if train_file is not None:
        flags += ["--train_file", str(train_file)]
    return flags + [str(x) for x in extra]


@pytest.fixture
def inproc(work, monkeypatch):
    """In-process ``main(argv)``: no launcher variables, offline hub, a private datasets cache.

    Accelerate keeps process-wide singleton state; it is reset after every test.
    """
    jh.isolate_in_process(monkeypatch, work / "hf_datasets_cache")
    yield monkeypatch
    jh.reset_accelerate_state()


def run_main(capsys, argv):
    from accum_kit.cli import run

    code = run("train", [str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def load_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "train_summary.json").read_text())


# --------------------------------------------------------------------------- independent data / model


def byte_tokenizer():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def split_lines(corpus: Path, percent: int = 5):
    """(validation rows, train rows): run_clm's split of the file's lines (each with its line break), validation first."""
    lines = jh.text_rows(corpus)
    n_val = max(1, len(lines) * percent // 100)
    return lines[:n_val], lines[n_val:]


def packed_blocks(lines, block=BLOCK):
    """Every row tokenised (bytes + </s>), concatenated, cut into full blocks (one map batch: < 1000 lines)."""
    assert len(lines) < 1000, "the packing recomputation assumes one datasets map batch"
    ids = [i for line in lines for i in byte_tokenizer()(line)["input_ids"]]
    return [ids[i : i + block] for i in range(0, len(ids) // block * block, block)]


def lm_loss(model, blocks) -> float:
    """Token-mean next-token loss of ``model`` over equal-length blocks (one batch, float64 mean)."""
    ids = torch.tensor(blocks)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].double()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


def fresh_tiny_model(vocab=BYTE_VOCAB, n_positions=BLOCK, seed=SEED):
    """A tiny GPT-2 as the job initialises it: GPT2Config, no dropout, torch seeded right before."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=n_positions, n_layer=2, n_embd=64, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=1,
                        pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


# --------------------------------------------------------------------------- 2 processes, accelerate launch


@pytest.fixture(scope="module")
def ddp_run(work, corpus, ddp_pool):
    """The job on 2 DDP processes: a command of conftest.py's shared ``ddp_pool`` (one launch for many commands)."""
    out = work / "ddp_out"
    assert ddp_pool.num_processes == WORLD
    res = ddp_pool.submit("train", job_flags(out, "--max_train_steps", STEPS, "--per_device_train_batch_size", B,
                                             "--gradient_accumulation_steps", K, "--max_train_samples", MAX_TRAIN,
                                             "--max_eval_samples", MAX_EVAL, "--with_tracking", "--report_to",
                                             "tensorboard", train_file=corpus),
                          datasets_cache=work / "hf_datasets_cache").result()
    assert res.returncode == 0, res.describe()
    return res, out


def test_ddp_job_summary(ddp_run):
    res, out = ddp_run
    s = load_summary(out)
    required = {"world_size", "gradient_accumulation_steps", "per_device_train_batch_size", "effective_batch_size",
                "optimizer_steps", "micro_batches_per_process", "train_loss", "eval_loss_before", "eval_loss_after",
                "tokens_per_second", "seconds_per_optimizer_step", "dataset", "model_parameters"}
    assert required <= s.keys(), f"missing: {sorted(required - s.keys())}"
    assert s["world_size"] == WORLD
    assert s["distributed_type"] == "DistributedType.MULTI_CPU"
    assert s["gradient_accumulation_steps"] == K
    assert s["per_device_train_batch_size"] == B
    assert s["effective_batch_size"] == 12  # 2 examples x 3 micro-batches x 2 processes
    assert s["optimizer_steps"] == STEPS
    # 200 examples / (2 x 2) = 50 micro-batches per process > 8 x 3: the epoch never ends.
    assert s["train_examples"] == MAX_TRAIN and MAX_TRAIN // (B * WORLD) > STEPS * K
    assert s["micro_batches_per_process"] == STEPS * K
    assert len(s["train_loss"]) == STEPS and all(math.isfinite(x) for x in s["train_loss"])
    assert s["tokens_per_second"] > 0 and s["seconds_per_optimizer_step"] > 0
    # Every window counts the target tokens of both processes: 8 steps x 12 full blocks x 63 targets.
    # (Two lone processes would each count half of that.)
    assert s["tokens_per_second"] * s["train_seconds"] == pytest.approx(STEPS * 12 * (BLOCK - 1), rel=1e-9)
    assert s["dataset"] == f"file:{out.parent / 'stdlib_corpus.txt'}"
    assert s["eval_examples"] == MAX_EVAL
    assert math.isfinite(s["eval_loss_before"]) and s["eval_loss_after"] < s["eval_loss_before"] - 0.3


def test_ddp_job_tensorboard_matches_the_summary(ddp_run):
    _, out = ddp_run
    s = load_summary(out)
    tb = jh.tensorboard_scalars(out / "accum_kit")
    # every optimizer step, from the main process only, equal (float32 event storage) to train_summary.json
    assert sorted(tb["train/loss"]) == list(range(1, STEPS + 1))
    for step, loss in enumerate(s["train_loss"], start=1):
        assert tb["train/loss"][step] == pytest.approx(loss, rel=1e-6)
    assert tb["eval/loss"] == pytest.approx({0: s["eval_loss_before"], STEPS: s["eval_loss_after"]}, rel=1e-6)
    # 12 full blocks of 63 targets per window over both processes (a lone process would log half)
    assert set(tb["train/window_tokens"].values()) == {12 * (BLOCK - 1)}
    lrs = [tb["train/learning_rate"][k] for k in sorted(tb["train/learning_rate"])]
    assert lrs[0] == pytest.approx(3e-3, rel=1e-6) and lrs[-1] < lrs[0]  # cosine decay, no warm-up
    assert all(v > 0 for v in tb["train/grad_norm"].values()) and len(tb["train/grad_norm"]) == STEPS
    assert all(v > 0 for v in tb["train/tokens_per_second"].values())
    assert s["tracking"] == "tensorboard" and s["mixed_precision"] == "no"


def test_ddp_job_saved_model_and_tokenizer(ddp_run, corpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res, out = ddp_run
    s = load_summary(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == s["model_parameters"]
    assert (model.config.n_layer, model.config.n_embd) == (2, 64)  # the tiny preset
    assert model.config.vocab_size == len(tok) == BYTE_VOCAB
    assert tok("def f():\n")["input_ids"] == byte_tokenizer()("def f():\n")["input_ids"]

    # The validation split recomputed here from the file: the first 5% of non-blank lines, packed.
    val_lines, _ = split_lines(corpus)
    blocks = packed_blocks(val_lines)
    assert len(blocks) >= MAX_EVAL
    blocks = blocks[:MAX_EVAL]
    # eval_loss_after is the loss of the saved model; eval_loss_before that of the seeded initial model.
    assert lm_loss(model, blocks) == pytest.approx(s["eval_loss_after"], rel=1e-5)
    assert lm_loss(fresh_tiny_model(), blocks) == pytest.approx(s["eval_loss_before"], rel=1e-5)


def test_ddp_job_leaves_no_staging(ddp_run):
    res, out = ddp_run
    assert jh.staging_leftovers(out) == []
    assert {"config.json", "model.safetensors", "train_summary.json"} <= {p.name for p in out.iterdir()}
    assert "Traceback" not in res.stderr


# --------------------------------------------------------------------------- 2 processes, FSDP2


FSDP_POLICY = jh.FSDP_JOB_POLICY  # the policy that changes FSDP2's defaults most
FSDP_CKPT_STEP = jh.FSDP_REFERENCE_EVERY


def _train_argv(corpus, output_dir, *extra) -> list:
    """The FSDP2 job's ``train`` flags (``jh.fsdp_job_argv`` without its ``-m accum_kit train``), for ``fsdp_pool``."""
    argv = jh.fsdp_job_argv(corpus, output_dir, *extra)
    assert argv[:3] == ["-m", "accum_kit", "train"]
    return argv[3:]
assert (jh.FSDP_JOB_STEPS, jh.FSDP_JOB_K, jh.FSDP_JOB_B) == (STEPS, K, B), "the FSDP2 job has the DDP job's flags"


@pytest.fixture(scope="module")
def fsdp_runs(work, fsdp_reference, fsdp_pool):
    """The DDP job's flags under accelerate_configs/cpu_fsdp.yaml, saving every 4 steps (conftest.py's
    ``fsdp_reference``, shared with test_fsdp_faults.py); then the same job resumed from step_4 into a second
    output directory; and the same job preempted by SIGTERM to accelerate launch after step 2, then resumed
    from ``latest``. Returns ``(uninterrupted, resumed, preempted)`` (result, dir) and, last, the
    resumed-from-latest result."""
    env = jh.clean_env(HF_DATASETS_CACHE=str(fsdp_reference.datasets_cache))
    corpus, config = fsdp_reference.corpus, jh.FSDP_CONFIG
    # --profile_comm (FSDP2's collectives recorded) changes no number: the resumed run, without it, must agree
    full, out = fsdp_reference.result(), fsdp_reference.output_dir
    assert full.returncode == 0, full.describe()
    resumed_out = work / "fsdp_resumed"
    resumed = fsdp_pool.submit("train", _train_argv(corpus, resumed_out, "--resume_from_checkpoint",
                                                    out / f"step_{FSDP_CKPT_STEP}"),
                               datasets_cache=fsdp_reference.datasets_cache).result()
    assert resumed.returncode == 0, resumed.describe()
    preempted_out = work / "fsdp_preempted"
    preempt_argv = jh.fsdp_job_argv(corpus, preempted_out, "--checkpointing_steps", FSDP_CKPT_STEP,
                                    "--logging_steps", 1)
    started = jh.start(jh.accelerate_launch_cmd(*preempt_argv, config=config), env, work, "fsdp_preempted")
    jh.wait_for_text(work / "fsdp_preempted.stderr", "step 2:", started[1])
    os.kill(started[1].pid, signal.SIGTERM)  # the accelerate launch process: torchrun forwards it to the workers
    preempted = jh.finish(started, 300)
    latest = fsdp_pool.submit("train", [*preempt_argv[3:], "--resume_from_checkpoint", "latest"],
                              datasets_cache=fsdp_reference.datasets_cache).result()
    assert latest.returncode == 0, latest.describe()
    return (full, out), (resumed, resumed_out), (preempted, preempted_out), latest


def test_fsdp_job_trains_as_the_ddp_job_and_says_it_was_sharded(fsdp_runs, ddp_run):
    """Same flags, same seed: FSDP2 (parameters sharded, kept gathered per window) and DDP compute the same
    losses; the summary records the sharding; the full model saved from the shards loads and matches."""
    from transformers import AutoModelForCausalLM

    (_, out), *_ = fsdp_runs
    s, ddp = load_summary(out), load_summary(ddp_run[1])
    assert s["distributed_type"] == "DistributedType.FSDP" and s["world_size"] == WORLD
    assert s["fsdp"] == {"version": 2, "mesh": {"dp_replicate_size": 1, "dp_shard_size": WORLD},
                         "accumulation_policy": FSDP_POLICY, "reshard_after_forward": False,
                         "state_dict_type": "SHARDED_STATE_DICT", "mixed_precision_policy": None}
    assert s["accumulation_policy"] == FSDP_POLICY and ddp["accumulation_policy"] == "no_sync" and not ddp["fsdp"]
    assert s["train_loss"] == pytest.approx(ddp["train_loss"], rel=1e-5)
    assert s["model_parameters"] == ddp["model_parameters"]
    sharded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    replicated = AutoModelForCausalLM.from_pretrained(ddp_run[1]).state_dict()
    assert sharded.keys() == replicated.keys()
    for k in replicated:
        torch.testing.assert_close(sharded[k], replicated[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_fsdp_job_resumes_from_its_sharded_checkpoint_exactly(fsdp_runs):
    (_, out), (resumed, resumed_out), *_ = fsdp_runs
    ckpt = out / f"step_{FSDP_CKPT_STEP}"
    assert {"pytorch_model_fsdp_0", "optimizer_0", "checkpoint_complete", "loop_state.json"} <= {
        p.name for p in ckpt.iterdir()}, "not a sharded (torch distributed checkpoint) save"
    full, again = load_summary(out), load_summary(resumed_out)
    assert again["resumed_from_step"] == FSDP_CKPT_STEP
    assert again["train_loss"] == full["train_loss"]  # bitwise: restored history and recomputed steps
    assert again["eval_loss_after"] == full["eval_loss_after"]
    assert "Traceback" not in resumed.stderr


def test_fsdp_job_preempted_by_sigterm_saves_a_sharded_checkpoint_and_resumes_from_latest_exactly(fsdp_runs):
    from accum_kit.core.checkpoint import complete_checkpoints

    (_, out), _, (preempted, preempted_out), latest = fsdp_runs
    assert preempted.returncode != 0, preempted.describe()  # torchrun re-raises the signal: accelerate launch exits 1
    lines = [line for line in preempted.stderr.splitlines() if "preempted by SIGTERM" in line]
    assert len(lines) == WORLD, preempted.describe()  # one per rank
    again, full = load_summary(preempted_out), load_summary(out)
    n = again["resumed_from_step"]  # the resumed run continued in the same folder: "latest" was the preemption's
    assert 2 <= n < STEPS and f"step_{n}" in lines[0]  # saved at the first window boundary after the signal
    assert "pytorch_model_fsdp_0" in {p.name for p in (preempted_out / f"step_{n}").iterdir()}
    assert f"step_{n}" in [p.name for p in complete_checkpoints(preempted_out)] and "Traceback" not in latest.stderr
    assert again["train_loss"] == full["train_loss"]  # bitwise: restored history and recomputed steps
    assert again["eval_loss_after"] == full["eval_loss_after"]


def test_fsdp_job_reports_collectives_and_memory_held(fsdp_runs):
    """--profile_comm under FSDP2: a reduce-scatter per unit per window (no_sync), at most one all-gather per unit
    per window (parameters kept gathered: the evaluation before training leaves the units that are not resharded
    after forward gathered, so the first window gathers only the others); memory: the full fp32 gradient and the
    gathered parameters held between micro-batches, as predicted."""
    (_, out), *_ = fsdp_runs
    s = load_summary(out)
    comm, mem = s["comm"], s["memory"]
    units = comm["fsdp_units"]
    assert sum(u["parameters"] for u in units) == s["model_parameters"]
    assert comm["reduce_scatter_calls"] == STEPS * len(units) and comm["syncs"] == STEPS
    assert comm["skipped_syncs"] == STEPS * (K - 1)
    kept = sum(not u["reshard_after_forward"] for u in units)
    assert (STEPS - 1) * len(units) <= comm["all_gather_calls"] <= STEPS * len(units)
    assert comm["spread"]["reduce_scatter_calls"]["min"] == comm["spread"]["reduce_scatter_calls"]["max"]
    assert kept == len(units), "no_sync_no_reshard keeps every unit gathered after forward"
    full = 4 * s["model_parameters"]
    assert mem["policy"] == FSDP_POLICY and mem["gradient_bytes_peak"]["min"] == mem["gradient_bytes_peak"]["max"] == full
    assert mem["gathered_parameter_bytes_peak"]["max"] == full and mem["process_peak_bytes"]["min"] > full
    assert abs(mem["measured_over_predicted"] - 1) <= 0.10
    # TensorBoard, per step: one reduce-scatter per unit, the whole fp32 gradient, and the run's all-gathers
    tb = jh.tensorboard_scalars(out / "accum_kit")
    assert tb["comm/reduce_scatter_calls"] == {step: len(units) for step in range(1, STEPS + 1)}
    assert set(tb["comm/reduce_scatter_bytes"].values()) == {full}
    assert sum(tb["comm/all_gather_calls"].values()) == comm["all_gather_calls"] and "comm/allreduce_calls" not in tb


def test_ddp_job_holds_the_full_gradient_between_micro_batches(ddp_run):
    mem = load_summary(ddp_run[1])["memory"]
    full = 4 * load_summary(ddp_run[1])["model_parameters"]
    assert mem["gradient_bytes_peak"] == {"min": full, "median": full, "max": full} and mem["by_kind"] == {"grad": full}
    assert mem["measured_over_predicted"] == 1.0
    # the predicted peak by part: fp32 parameters, gradients, AdamW's two moments, DDP's buckets (a gradient copy)
    parts = mem["predicted_peak_by_part"]
    assert (parts["parameters"], parts["gradients"], parts["optimizer_state"], parts["communication_buffers"]) == (
        full, full, 2 * full, full)
    assert len(mem["process_peak_bytes_by_rank"]) == len(mem["peak_measured_over_predicted_by_rank"]) == WORLD


# --------------------------------------------------------------------------- 1 process, in-process


def test_single_process_padded_epoch(inproc, capsys, tmp_path, corpus):
    """--packing false, one epoch of 50 examples: 25 micro-batches, K=3 -> 9 steps, the last one partial."""
    out = tmp_path / "padded"
    n, b, k = 50, 2, 3
    code, _, err = run_main(capsys, job_flags(
        out, "--packing", "false", "--max_train_steps", "0", "--num_train_epochs", "1",
        "--max_train_samples", n, "--per_device_train_batch_size", b, "--gradient_accumulation_steps", k,
        "--max_eval_samples", MAX_EVAL, train_file=corpus,
    ))
    assert code == 0, err[-4000:]
    s = load_summary(out)
    assert s["world_size"] == 1 and s["distributed_type"] == "DistributedType.NO"
    assert s["packing"] is False
    assert s["micro_batches_per_process"] == 25
    assert s["optimizer_steps"] == 9 == len(s["train_loss"])
    assert all(math.isfinite(x) for x in s["train_loss"])
    assert s["effective_batch_size"] == b * k
    # One non-blank line (with its line break) per example (truncated to the block, at least 8 tokens); the first
    # 50 train examples are all seen once, so the target tokens counted over the epoch are known without the order.
    _, train_lines = split_lines(corpus)
    train_lines = [line for line in train_lines if line.strip()]
    lengths = [len(ids) for ids in byte_tokenizer()(train_lines, truncation=True, max_length=BLOCK)["input_ids"]]
    lengths = [x for x in lengths if x >= 8][:n]
    assert len(set(lengths)) > 1, "the examples should have different lengths (padding exercised)"
    targets = sum(x - 1 for x in lengths)  # padding is not a target
    assert s["tokens_per_second"] * s["train_seconds"] == pytest.approx(targets, rel=1e-9)
    assert s["eval_loss_after"] < s["eval_loss_before"]
    assert jh.staging_leftovers(out) == []


def test_single_process_schedule_reports_k_batch_and_scaled_lr_per_step(inproc, capsys, tmp_path, corpus):
    """--accumulation_schedule 0:1,2:2,4:3 --lr_scaling linear, constant LR: per step K 1,1,2,2,3,3, so
    window tokens K x 2 x 63, effective batch 2K and learning rate 3e-3 x K, in the summary and TensorBoard."""
    from host_reads import HostReads, loop_reads, owner_of
    import accum_kit.job.train as train_module

    reads, loop = HostReads(), train_module.train_loop

    def counted_loop(*args, **kwargs):  # the job's own loop, with the host-read counter as one more callback
        with reads:
            return loop(*args, **{**kwargs, "callbacks": [*kwargs["callbacks"], reads]})

    inproc.setattr(train_module, "train_loop", counted_loop)
    out = tmp_path / "scheduled"
    code, _, err = run_main(capsys, job_flags(
        out, "--accumulation_schedule", "0:1,2:2,4:3", "--lr_scaling", "linear", "--lr_scheduler_type", "constant",
        "--max_train_steps", 6, "--per_device_train_batch_size", 2, "--max_train_samples", MAX_TRAIN,
        "--max_eval_samples", MAX_EVAL, "--with_tracking", "--report_to", "tensorboard", train_file=corpus))
    assert code == 0, err[-4000:]
    ks = [1, 1, 2, 2, 3, 3]
    s = load_summary(out)
    assert s["accumulation_schedule"] == [[0, 1], [2, 2], [4, 3]] and s["lr_scaling"] == "linear"
    assert s["gradient_accumulation_steps"] == 1  # K at step 0
    assert s["gradient_accumulation_steps_per_step"] == ks
    assert s["effective_batch_size_per_step"] == [2 * k for k in ks]
    assert s["micro_batches_per_process"] == sum(ks) < MAX_TRAIN // 2  # the epoch never ends
    tb = jh.tensorboard_scalars(out / "accum_kit")
    for step, k in enumerate(ks, start=1):
        assert tb["train/gradient_accumulation_steps"][step] == k
        assert tb["train/effective_batch_size"][step] == 2 * k
        assert tb["train/window_tokens"][step] == k * 2 * (BLOCK - 1)  # full packed blocks: 63 targets each
        assert tb["train/learning_rate"][step] == pytest.approx(3e-3 * k, rel=1e-6)
    assert s["tokens_per_second"] * s["train_seconds"] == pytest.approx(sum(ks) * 2 * (BLOCK - 1), rel=1e-9)
    # Host reads of the job's loop (tests/host_reads.py): none inside a window; per window one, the checkpointer's
    # collective stop flag (SIGTERM on any process); the losses, tokens and gradient norms in one copy at logging
    # step 4 (TensorBoard, the log line and the bar share it) and at the end (the bar's last loss, then the
    # tracker's last norms).
    inside, windows = loop_reads(reads.summary())
    assert not any(inside), inside
    stop, figures = "accum_kit/core/checkpoint.py:_stop_requested", "accum_kit/core/window_figures.py:read_together"
    want = [{stop: 1}] * 3 + [{stop: 1, figures: 1}, {stop: 1}, {stop: 1, figures: 2}]
    assert [{owner_of(site): n for site, n in w.items()} for w in windows] == want, windows


def test_finetune_from_saved_ddp_model(inproc, capsys, tmp_path, ddp_run, corpus):
    """--model_name_or_path: the 2-process job's output loads, and evaluates to the loss it reported."""
    _, ddp_out = ddp_run
    before = load_summary(ddp_out)
    out = tmp_path / "finetuned"
    code, _, err = run_main(capsys, [
        "--model_name_or_path", ddp_out, "--block_size", BLOCK, "--output_dir", out, "--train_file", corpus,
        "--max_train_steps", 2, "--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 1,
        "--max_eval_samples", MAX_EVAL, "--num_warmup_steps", 0,
    ])
    assert code == 0, err[-4000:]
    s = load_summary(out)
    assert s["model"] == str(ddp_out)
    assert s["model_parameters"] == before["model_parameters"]
    assert s["eval_loss_before"] == pytest.approx(before["eval_loss_after"], rel=1e-5)
    assert s["optimizer_steps"] == 2


# --------------------------------------------------------------------------- bad input: exit 2, nothing written


@pytest.fixture
def bad_files(tmp_path, corpus):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n   \n\t\n")
    # ~1 KB of real text: a few blocks of 64 bytes, fewer than one global batch of 16 x 2 = 32.
    small = "".join(line + "\n" for line in jh.text_lines(corpus)[:30])[:1100]
    (tmp_path / "small.txt").write_text(small)
    return tmp_path


BAD_INPUT = {
    # name: (flags, flag the error must name, text the message must contain)
    "k_zero": (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps", "got 0"),
    "k_negative": (["--gradient_accumulation_steps", "-1"], "--gradient_accumulation_steps", "got -1"),
    "batch_zero": (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size", "got 0"),
    "empty_file": (["--train_file", "{tmp}/empty.txt"], "--train_file", ""),
    "blank_file": (["--train_file", "{tmp}/blank.txt"], "--train_file", ""),
    "missing_file": (["--train_file", "{tmp}/no_such_file.txt"], "--train_file", "no_such_file.txt"),
    "fewer_than_one_batch": (["--train_file", "{tmp}/small.txt", "--per_device_train_batch_size", "16"],
                             "--per_device_train_batch_size", "one global batch of 32"),
    "unknown_preset": (["--model_preset", "huge"], "--model_preset", "huge"),
    "unreachable_hub_dataset": (["--dataset_name", "no-such-user/no-such-dataset"], "--dataset_name",
                                "no-such-user/no-such-dataset"),
    "missing_model_path": (["--model_name_or_path", "{tmp}/no_such_model"], "--model_name_or_path", "no_such_model"),
    "output_dir_is_a_file": (["--output_dir", "{tmp}/stdlib_corpus_copy.txt"], "--output_dir", "not a directory"),
    # the argv of these cases already has --gradient_accumulation_steps 2
    "schedule_disagrees_with_k": (["--accumulation_schedule", "0:1,4:2"], "--gradient_accumulation_steps",
                                  "--accumulation_schedule, whose K at step 0 is 1"),
    "schedule_without_step_0": (["--accumulation_schedule", "3:2"], "--accumulation_schedule", "no K for step 0"),
    "lr_scaling_without_schedule": (["--lr_scaling", "linear"], "--lr_scaling", "no --accumulation_schedule"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_exits_2_naming_the_flag_and_writes_nothing(inproc, capsys, bad_files, corpus, case):
    flags, flag, detail = BAD_INPUT[case]
    flags = [f.replace("{tmp}", str(bad_files)) for f in flags]
    out = bad_files / "out"
    (bad_files / "stdlib_corpus_copy.txt").write_text("not a directory\n")
    data = [] if {"--train_file", "--dataset_name"} & set(flags) else ["--train_file", corpus]
    argv = job_flags(out, "--gradient_accumulation_steps", 2, "--max_train_steps", 2, *data) + flags
    code, _, err = run_main(capsys, argv)
    errors = error_lines(err)
    assert code == 2, f"exit {code}\n{err[-4000:]}"
    assert len(errors) == 1, err[-4000:]
    assert errors[0].startswith(f"error: {flag}: ") and ". Fix: " in errors[0], errors[0]
    assert detail in errors[0]
    assert not out.exists()
    assert jh.staging_leftovers(out) == []
    if case == "output_dir_is_a_file":
        assert (bad_files / "stdlib_corpus_copy.txt").read_text() == "not a directory\n"


def test_script_and_launcher_disagree_on_k(inproc, capsys, tmp_path, corpus):
    inproc.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
    out = tmp_path / "out"
    code, _, err = run_main(capsys, job_flags(out, "--gradient_accumulation_steps", 3, train_file=corpus))
    assert code == 2
    assert error_lines(err) and error_lines(err)[0].startswith("error: --gradient_accumulation_steps: ")
    assert not out.exists()


@pytest.fixture
def saved_tiny_model(tmp_path):
    """A tiny model saved with save_pretrained (n_positions = 64), with or without its tokenizer."""
    model_dir = tmp_path / "saved_tiny"
    fresh_tiny_model().save_pretrained(model_dir)
    return model_dir


def test_model_dir_without_tokenizer_names_model_flag(inproc, capsys, tmp_path, corpus, saved_tiny_model):
    out = tmp_path / "out"
    code, _, err = run_main(capsys, ["--model_name_or_path", saved_tiny_model, "--train_file", corpus,
                                     "--block_size", BLOCK, "--output_dir", out, "--max_train_steps", 1])
    assert code == 2
    assert error_lines(err)[0].startswith("error: --model_name_or_path: "), err[-2000:]
    assert not out.exists()


def test_block_size_longer_than_loaded_model_positions(inproc, capsys, tmp_path, corpus, saved_tiny_model):
    byte_tokenizer().save_pretrained(saved_tiny_model)
    out = tmp_path / "out"
    code, _, err = run_main(capsys, ["--model_name_or_path", saved_tiny_model, "--train_file", corpus,
                                     "--block_size", 2 * BLOCK, "--output_dir", out, "--max_train_steps", 1,
                                     "--gradient_accumulation_steps", 1])
    assert code == 2
    assert error_lines(err)[0].startswith("error: --block_size: "), err[-2000:]
    assert not out.exists()


# --------------------------------------------------------------------------- command line


def test_cli_help_lists_train(capsys):
    from accum_kit.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:1] == ["train"] for line in out.splitlines()), out
    assert main([]) == 2  # no command: usage, and a failure exit


def test_train_help_lists_job_flags(capsys):
    from accum_kit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--gradient_accumulation_steps", "--per_device_train_batch_size", "--model_preset", "--train_file"):
        assert flag in out


def test_python_m_accum_kit_unknown_command_exits_2(tmp_path):
    res = jh.run([sys.executable, "-m", "accum_kit", "frobnicate"], jh.clean_env(), tmp_path, "unknown", timeout=120)
    assert res.returncode == 2, res.describe()
    assert "unknown command 'frobnicate'" in res.stderr
    assert "train" in res.stderr  # the usage lists the commands


def test_examples_train_script_exits_2_on_bad_input(tmp_path):
    out = tmp_path / "out"
    res = jh.run([sys.executable, str(jh.REPO / "examples" / "train.py"), "--gradient_accumulation_steps", "0",
                  "--output_dir", str(out)], jh.clean_env(), tmp_path, "example", timeout=120)
    assert res.returncode == 2, res.describe()
    assert "error: --gradient_accumulation_steps: must be >= 1 (got 0)" in res.stderr
    assert not out.exists()
