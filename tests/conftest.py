"""Shared fixtures. ``example_results``: every example of the ladder, run once on 2 gloo processes;
``fsdp_reference``: the uninterrupted FSDP2 train job, run once for the modules that check or break it;
``ddp_pool`` / ``fsdp_pool``: one 2-process DDP / FSDP2 launch each, running the accum-kit commands of several
modules (the reference among them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import command_pool  # noqa: E402
import job_helpers as jh  # noqa: E402

EXAMPLES_TIMEOUT_S = 420
RAW_DDP_STEPS = 6  # raw_ddp_loop's --max_train_steps in the shared launch
RAW_GRAD_SYNCS = ("ddp", "manual_allreduce", "manual_allreduce_flat")  # raw_ddp_loop's --grad_sync, one run each
PROFILE_COMM_STEPS = 8  # profile_comm's: 1 warm-up, 2 x 2 A/B windows, 3 more
SCHEDULE = "0:1,2:2,5:4"  # by_feature/schedule.py's --accumulation_schedule (8 steps: K 1, 1, 2, 2, 2, 4, 4, 4)
DIGITS_EPOCHS = 3  # by_feature/image_classification.py's --num_train_epochs in the shared launch


def example_specs(corpus: Path) -> list[dict]:
    """Each example with the flags the tests give it: its own small defaults, plus a small local corpus."""
    ex = jh.REPO / "examples"
    corpus_flags = ["--train_file", str(corpus)]
    return [
        {"name": "custom_loop", "path": str(ex / "custom_loop.py"), "argv": [*corpus_flags, "--max_train_steps", "8"]},
        {"name": "custom_loop_gc", "path": str(ex / "custom_loop.py"),
         "argv": [*corpus_flags, "--max_train_steps", "8", "--gradient_checkpointing"]},
        {"name": "custom_loop_lora", "path": str(ex / "custom_loop.py"),
         "argv": [*corpus_flags, "--max_train_steps", "8", "--use_peft", "--lora_r", "4"]},
        {"name": "mean_vs_tokens", "path": str(ex / "by_feature" / "mean_vs_tokens.py"), "argv": corpus_flags},
        {"name": "verify_exactness", "path": str(ex / "by_feature" / "verify_exactness.py"),
         "argv": [*corpus_flags, "--max_train_steps", "8"]},
        *({"name": f"raw_ddp_loop{'' if sync == 'ddp' else '_' + sync}", "path": str(ex / "raw_ddp_loop.py"),
           "argv": [*corpus_flags, "--max_train_steps", str(RAW_DDP_STEPS), "--return_checks", "--grad_sync", sync]}
          for sync in RAW_GRAD_SYNCS),
        {"name": "profile_comm", "path": str(ex / "by_feature" / "profile_comm.py"),
         "argv": [*corpus_flags, "--max_train_steps", str(PROFILE_COMM_STEPS), "--ab_steps", "2"]},
        *checkpointing_specs(ex, corpus_flags, corpus.parent / "checkpointing"),
        {"name": "schedule", "path": str(ex / "by_feature" / "schedule.py"),
         "argv": [*corpus_flags, "--max_train_steps", "8", "--accumulation_schedule", SCHEDULE, "--lr_scaling", "linear"]},
        {"name": "image_classification", "path": str(ex / "by_feature" / "image_classification.py"),
         "argv": ["--num_train_epochs", str(DIGITS_EPOCHS)]},
        {"name": "batchnorm", "path": str(ex / "by_feature" / "batchnorm.py"),
         "argv": ["--windows", "1", "--num_train_epochs", "1"]},
    ]


def checkpointing_specs(ex: Path, corpus_flags: list, output_dir: Path) -> list[dict]:
    """by_feature/checkpointing.py twice: 8 steps saving every 3, then resumed from step_3 (a fresh Accelerator)."""
    argv = [*corpus_flags, "--max_train_steps", "8", "--checkpointing_steps", "3", "--output_dir", str(output_dir)]
    path = str(ex / "by_feature" / "checkpointing.py")
    return [{"name": "checkpointing", "path": path, "argv": argv},
            {"name": "checkpointing_resumed", "path": path,
             "argv": [*argv, "--resume_from_checkpoint", str(output_dir / "step_3")]}]


@pytest.fixture(scope="session")
def example_results(tmp_path_factory, ddp_pool):
    """``{name: [rank 0 result, rank 1 result]}`` from one run of tests/examples_worker.py on 2 processes (a
    script run of ``ddp_pool``).

    An example that raised shows up as ``{"error": traceback}`` for that rank.
    """
    work = tmp_path_factory.mktemp("examples")
    corpus = jh.write_corpus(work / "corpus.txt")
    specs = example_specs(corpus)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps({"examples": specs}))
    out = work / "out"
    out.mkdir()
    res = ddp_pool.submit("examples", [spec_path, out], datasets_cache=work / "hf_cache",
                          script=jh.REPO / "tests" / "examples_worker.py").result(EXAMPLES_TIMEOUT_S)
    results = {}
    for s in specs:
        per_rank = []
        for rank in range(2):
            ok, err = out / f"{s['name']}.rank{rank}.json", out / f"{s['name']}.rank{rank}.error"
            if ok.exists():
                per_rank.append(json.loads(ok.read_text()))
            else:
                per_rank.append({"error": err.read_text() if err.exists() else f"no result\n{res.describe()}"})
        results[s["name"]] = per_rank
    return results


FSDP_REFERENCE_TIMEOUT_S = 420
DDP_POOL_TIMEOUT_S = 600  # per command, both pools (a pool runs its commands one after another)


@pytest.fixture(scope="session")
def fsdp_pool(tmp_path_factory):
    """A :class:`command_pool.CommandPool` on 2 FSDP2 processes (accelerate_configs/cpu_fsdp.yaml), for the
    commands that need no launch of their own (no signal, no fault, no launcher flag); see ``ddp_pool``."""
    pool = command_pool.CommandPool(tmp_path_factory.mktemp("fsdp_pool"), jh.FSDP_CONFIG, timeout=DDP_POOL_TIMEOUT_S)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory, fsdp_pool):
    """The FSDP2 job (``jh.fsdp_job_argv``) uninterrupted, with ``--profile_comm``, TensorBoard tracking and
    ``--checkpointing_steps jh.FSDP_REFERENCE_EVERY``, as a :class:`job_helpers.Pending`: queued on ``fsdp_pool``
    when first asked for, so that the asking module's own launches run beside it; ``.result()`` waits. (Profiling,
    tracking and the save interval change no number: the modules that compare with it run without them, or with
    another interval, and must agree bitwise.)"""
    work = tmp_path_factory.mktemp("fsdp_reference")
    corpus = jh.write_corpus(work / "corpus.txt")
    cache, out = work / "hf_datasets_cache", work / "out"
    argv = jh.fsdp_job_argv(corpus, out, "--checkpointing_steps", jh.FSDP_REFERENCE_EVERY, "--profile_comm",
                            "--with_tracking", "--report_to", "tensorboard")
    assert argv[:3] == ["-m", "accum_kit", "train"]
    pending = jh.Pending(fsdp_pool.submit("train", argv[3:], datasets_cache=cache), out, corpus, cache,
                         FSDP_REFERENCE_TIMEOUT_S)
    yield pending
    pending.result()  # never left running


@pytest.fixture(scope="session")
def ddp_pool(tmp_path_factory):
    """A :class:`command_pool.CommandPool` on 2 DDP processes (accelerate_configs/cpu_ddp.yaml), shared by the
    modules whose 2-process commands need no launch of their own (no signal, no fault, no launcher flag):
    each module submits its commands and reads their results; one start-up for all of them."""
    pool = command_pool.CommandPool(tmp_path_factory.mktemp("ddp_pool"), jh.DDP_CONFIG, timeout=DDP_POOL_TIMEOUT_S)
    yield pool
    pool.close()


@pytest.fixture
def accelerator(monkeypatch):
    """A factory ``k -> build_accelerator(k, cpu=True)`` for one in-process run; Accelerate's state reset around it."""
    from accum_kit import build_accelerator

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        monkeypatch.delenv(var, raising=False)
    jh.reset_accelerate_state()
    yield lambda k: build_accelerator(k, cpu=True)
    jh.reset_accelerate_state()


@pytest.fixture
def one_process(monkeypatch):
    """A plain single process in this one: no launcher variables, fresh Accelerate state, one torch thread."""
    import torch

    for var in jh.LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    jh.reset_accelerate_state()
    yield
    jh.reset_accelerate_state()
    torch.set_num_threads(threads)


def ok(results: list[dict]) -> list[dict]:
    """Fail with the example's traceback if any rank raised."""
    for r in results:
        assert "error" not in r, r["error"]
    return results
