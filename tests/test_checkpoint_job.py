"""Checkpoint, resume and preemption of the train job, with real processes and real signals.

Launches (2 gloo processes each, ``accelerate launch -m accum_kit train``):

- ``uninterrupted``: 2 epochs, ``--checkpointing_steps epoch``: the reference;
- the chain, started at the same time: a run that crashes while saving
  ``step_10`` (test hook) -> a run resumed from ``latest`` that gets SIGTERM
  on the ``accelerate launch`` process -> a run resumed from ``latest`` that
  finishes. It uses ``--max_train_steps`` (same number of steps as the two
  epochs) and ``--checkpoints_total_limit 2``.

Plus one plain process that gets SIGTERM (the worker's own exit code), and
in-process runs (1 process) for every bad input. Data: 200 packed blocks of a
small real corpus, 2 per micro-batch, K=3: 50 micro-batches per process and
epoch, windows of 3 and a last partial window of 2, 17 optimizer steps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

import job_helpers as jh
from accum_kit.checkpoint import CRASH_HOOK, PREEMPTED_EXIT_CODE, complete_checkpoints, latest_checkpoint

K, B, SAMPLES, STEPS_PER_EPOCH = 3, 2, 200, 17
STEPS = 2 * STEPS_PER_EPOCH
TIMEOUT_S = 300


def flags(out, *extra):
    return ["--model_preset", "tiny", "--block_size", "64", "--max_train_samples", str(SAMPLES),
            "--per_device_train_batch_size", str(B), "--gradient_accumulation_steps", str(K),
            "--num_warmup_steps", "2", "--logging_steps", "1", "--max_eval_samples", "16",
            "--output_dir", str(out), *[str(x) for x in extra]]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_job")
    jh.write_corpus(root / "corpus.txt")
    return root


def _launch(work, name, *argv, **env):
    cmd = jh.accelerate_launch_cmd("-m", "accum_kit", "train", "--train_file", str(work / "corpus.txt"), *argv)
    return jh.start(cmd, jh.clean_env(HF_DATASETS_CACHE=str(work / "hf"), **env), work / "logs", name)


def _wait_for(path: Path, text: str, proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path} (rc={proc.poll()})")


def _lone(work, name, *argv):
    cmd = [sys.executable, "-m", "accum_kit", "train", "--train_file", str(work / "corpus.txt"), *argv]
    return jh.start(cmd, jh.clean_env(HF_DATASETS_CACHE=str(work / "hf")), work / "logs", name)


@pytest.fixture(scope="module")
def jobs(work):
    """Run every launch once (independent ones at the same time); return their results."""
    chain = work / "chain"
    res = {}
    ref = _launch(work, "uninterrupted", *flags(work / "ref", "--max_train_steps", 0, "--num_train_epochs", 2,
                                                 "--checkpointing_steps", "epoch"))
    one = _lone(work, "one", *flags(work / "one", "--max_train_steps", 4, "--checkpointing_steps", 2,
                                    "--max_train_samples", 40))
    lone = _lone(work, "lone", *flags(work / "lone", "--max_train_steps", 400))
    chain_flags = flags(chain, "--max_train_steps", STEPS, "--checkpointing_steps", 5, "--checkpoints_total_limit", 2)
    crash = _launch(work, "crash", *chain_flags, **{CRASH_HOOK: "step_10"})

    _wait_for(work / "logs" / "lone.stderr", "step 3:", lone[1])
    os.kill(lone[1].pid, signal.SIGTERM)  # a plain process: its own exit code is visible
    res["lone"] = jh.finish(lone, TIMEOUT_S)
    res["crash"] = jh.finish(crash, TIMEOUT_S)
    res["after_crash"] = {"latest": latest_checkpoint(chain), "listing": sorted(p.name for p in chain.iterdir())}

    term = _launch(work, "sigterm", *chain_flags, "--resume_from_checkpoint", "latest")
    _wait_for(work / "logs" / "sigterm.stderr", "step 12:", term[1])
    t0 = time.monotonic()
    os.kill(term[1].pid, signal.SIGTERM)  # the accelerate launch process only: torchrun forwards it
    res["sigterm"] = jh.finish(term, TIMEOUT_S)
    res["sigterm_exit_seconds"] = time.monotonic() - t0
    saved = complete_checkpoints(chain)
    res["after_sigterm"] = {"checkpoints": [p.name for p in saved], "listing": sorted(p.name for p in chain.iterdir()),
                            "state": json.loads((saved[-1] / "loop_state.json").read_text()) if saved else None}
    res["final"] = jh.finish(_launch(work, "final", *chain_flags, "--resume_from_checkpoint", "latest"), TIMEOUT_S)
    res["uninterrupted"] = jh.finish(ref, TIMEOUT_S)
    res["one"] = jh.finish(one, TIMEOUT_S)
    return res


def summary(path: Path) -> dict:
    return json.loads((path / "train_summary.json").read_text())


def params(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_uninterrupted_reference_saved_each_epoch(jobs, work):
    assert jobs["uninterrupted"].returncode == 0, jobs["uninterrupted"].describe()
    s = summary(work / "ref")
    assert s["optimizer_steps"] == STEPS and s["checkpoints"] == ["epoch_0", "epoch_1"]
    state = json.loads((work / "ref" / "epoch_0" / "loop_state.json").read_text())
    # the epoch ended with a partial window of 2: the checkpoint points at the start of epoch 1
    assert (state["optimizer_steps"], state["epoch"], state["batches_done_in_epoch"]) == (STEPS_PER_EPOCH, 1, 0)
    assert state["micro_batches"] == 50 and len(state["train_loss"]) == STEPS_PER_EPOCH


def test_crash_during_save_leaves_latest_on_the_previous_checkpoint(jobs, work):
    assert jobs["crash"].returncode != 0
    after = jobs["after_crash"]
    assert after["latest"] == work / "chain" / "step_5"
    assert ".step_10.incomplete" in after["listing"] and "step_10" not in after["listing"]
    assert "train_summary.json" not in after["listing"]


def test_sigterm_to_accelerate_launch_saves_at_a_boundary_and_exits(jobs, work):
    res = jobs["sigterm"]
    assert res.returncode != 0, res.describe()  # torchrun re-raises the signal: accelerate launch exits 1
    lines = [line for line in res.stderr.splitlines() if "preempted by SIGTERM" in line]
    assert len(lines) == 2, res.describe()  # one per rank
    saved = jobs["after_sigterm"]["checkpoints"]
    assert len(saved) == 2, saved  # --checkpoints_total_limit 2
    state = jobs["after_sigterm"]["state"]
    n = state["optimizer_steps"]
    assert 12 <= n < STEPS and saved[-1] == f"step_{n}"
    assert state["micro_batches"] == (n // STEPS_PER_EPOCH) * 50 + (n % STEPS_PER_EPOCH) * K  # a window boundary
    assert f"step_{n}" in lines[0] and "train_summary.json" not in jobs["after_sigterm"]["listing"]
    assert not [p for p in jobs["after_sigterm"]["listing"] if p.endswith(".incomplete")]
    assert jobs["sigterm_exit_seconds"] < 30  # before torchrun's SIGKILL


def test_a_lone_worker_exits_with_the_preemption_code(jobs):
    res = jobs["lone"]
    assert res.returncode == PREEMPTED_EXIT_CODE, res.describe()
    assert "preempted by SIGTERM" in res.stderr


def test_resumed_chain_equals_uninterrupted_run(jobs, work):
    assert jobs["final"].returncode == 0, jobs["final"].describe()
    ref, got = summary(work / "ref"), summary(work / "chain")
    assert got["resumed_from_step"] == int(jobs["after_sigterm"]["checkpoints"][-1].split("_")[1])
    assert len(got["train_loss"]) == STEPS
    assert got["train_loss"] == ref["train_loss"]  # bitwise: restored steps and new ones
    a, b = params(work / "ref"), params(work / "chain")
    assert a.keys() == b.keys()
    assert all((a[k] - b[k]).abs().max().item() <= 1e-6 for k in a)
    assert all(a[k].equal(b[k]) for k in a)  # and in fact bitwise
    assert got["eval_loss_after"] == ref["eval_loss_after"]
    assert len(complete_checkpoints(work / "chain")) == 2


# --------------------------------------------------------------------------- bad input, in-process, 1 process


@pytest.fixture
def inproc(work, monkeypatch):
    import datasets
    import huggingface_hub.constants

    for name in jh.LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", work / "hf_inproc")
    jh.reset_accelerate_state()
    yield monkeypatch
    jh.reset_accelerate_state()


def _run(capsys, argv):
    from accum_kit.cli import run

    code = run("train", [str(a) for a in argv])
    return code, capsys.readouterr().err


def _tree(root: Path) -> list:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def one_process_checkpoints(jobs, work):
    """A 1-process run with step_2 and step_4 (4 steps), made in a subprocess (its own Accelerate state)."""
    assert jobs["one"].returncode == 0, jobs["one"].describe()
    return work / "one"


BAD = {
    # case: (extra flags, flag named, text in the message); {one} = 1-process run, {ref} = 2-process run
    "other_k": (["--resume_from_checkpoint", "{one}/step_2", "--gradient_accumulation_steps", 2],
                "--gradient_accumulation_steps", "resume with --gradient_accumulation_steps 3"),
    "other_batch": (["--resume_from_checkpoint", "{one}/step_2", "--per_device_train_batch_size", 4],
                    "--per_device_train_batch_size", "resume with --per_device_train_batch_size 2"),
    "other_world_size": (["--resume_from_checkpoint", "{ref}/epoch_0"], "--num_processes", "world size 2"),
    "missing": (["--resume_from_checkpoint", "{one}/step_99"], "--resume_from_checkpoint", "does not exist"),
    "incomplete": (["--resume_from_checkpoint", "{one}/.step_4.copy"], "--resume_from_checkpoint", "incomplete"),
    "latest_without_any": (["--resume_from_checkpoint", "latest", "--output_dir", "{empty}"],
                           "--resume_from_checkpoint", "no complete checkpoint"),
    "unwritable_output_dir": (["--output_dir", "/sys/accum_kit_test/out"], "--output_dir", "/sys"),
    "checkpointing_steps_word": (["--checkpointing_steps", "often"], "--checkpointing_steps", "'often'"),
    "checkpointing_steps_zero": (["--checkpointing_steps", "0"], "--checkpointing_steps", "'0'"),
    "total_limit_zero": (["--checkpoints_total_limit", "0"], "--checkpoints_total_limit", "got 0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_and_overwrites_nothing(inproc, capsys, work, jobs, one_process_checkpoints, case):
    one, extra = one_process_checkpoints, BAD[case]
    incomplete = one / ".step_4.copy"
    if not incomplete.exists():
        shutil.copytree(one / "step_4", incomplete)
        (incomplete / "checkpoint_complete").unlink()
    (work / "empty").mkdir(exist_ok=True)
    argv, flag, detail = extra
    argv = [str(a).format(one=one, ref=work / "ref", empty=work / "empty") for a in argv]
    before = _tree(one)
    code, err = _run(capsys, ["--train_file", work / "corpus.txt",
                              *flags(one, "--max_train_steps", 4, "--max_train_samples", 40), *argv])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2, err[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: {flag}: ") and ". Fix: " in errors[0], errors
    assert detail in errors[0], errors[0]
    assert _tree(one) == before
    assert not Path("/sys/accum_kit_test").exists()


def test_elastic_restart_resumes_from_latest_without_a_flag(inproc, capsys, work, one_process_checkpoints):
    out = work / "restarted"
    shutil.copytree(one_process_checkpoints, out)
    inproc.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    code, err = _run(capsys, ["--train_file", work / "corpus.txt",
                              *flags(out, "--max_train_steps", 4, "--max_train_samples", 40)])
    assert code == 0, err[-3000:]
    s, first = summary(out), summary(one_process_checkpoints)
    assert s["resumed_from_step"] == 4 and s["resumed_from"] == str(out / "step_4")
    assert s["train_loss"] == first["train_loss"]
