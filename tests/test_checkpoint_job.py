"""Checkpoint, resume and preemption of the train job, with real processes and real signals.

Runs (2 gloo processes each, ``accum-kit train`` under ``accelerate launch``; the two
with no signal and no hook are commands of conftest.py's shared ``ddp_pool``), the
independent ones at the same time:

- ``uninterrupted``: 3 epochs, ``--checkpointing_steps epoch``: the reference;
- ``crash``: exits while saving ``step_10`` (test hook, after ``save_state``,
  before the rename);
- ``sigterm``: ``--max_train_steps`` (as many steps as the three epochs),
  ``--checkpointing_steps 5 --checkpoints_total_limit 2``, SIGTERM to the
  ``accelerate launch`` process after step 37; then ``final`` resumes it from
  ``latest`` (part-way into the 3rd epoch: its own shuffle, the data position in
  it and the RNG must all come back) and must end where ``uninterrupted`` ended.

Plus one plain process that gets SIGUSR1 (the worker's own exit code; its
checkpoint serves the 1-process cases), and in-process runs for every bad input. Data: 200 packed blocks of a
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
from accum_kit.core.checkpoint import CRASH_HOOK, PREEMPTED_EXIT_CODE, complete_checkpoints, latest_checkpoint
from accum_kit.core.loop_history import read_history

K, B, SAMPLES, STEPS_PER_EPOCH, EPOCHS = 3, 2, 200, 17, 3
STEPS = EPOCHS * STEPS_PER_EPOCH
SIGNAL_AFTER = 2 * STEPS_PER_EPOCH + 3  # the 3rd epoch's 3rd step
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


def _pooled(pool, work, *argv):
    """The same command as :func:`_launch` with no fault hook, as a command of conftest.py's shared ``ddp_pool``."""
    return pool.submit("train", ["--train_file", work / "corpus.txt", *argv], datasets_cache=work / "hf")


def _lone(work, name, *argv):
    cmd = [sys.executable, "-m", "accum_kit", "train", "--train_file", str(work / "corpus.txt"), *argv]
    return jh.start(cmd, jh.clean_env(HF_DATASETS_CACHE=str(work / "hf")), work / "logs", name)


@pytest.fixture(scope="module")
def jobs(work, ddp_pool):
    """Every launch once; the independent ones at the same time (the machine may have 2 cores). The two runs that
    need no signal and no hook (``uninterrupted``, ``final``) are commands of the shared 2-process ``ddp_pool``."""
    chain, crashed = work / "chain", work / "crashed"
    res = {}
    ref = _pooled(ddp_pool, work, *flags(work / "ref", "--max_train_steps", 0, "--num_train_epochs", EPOCHS,
                                         "--checkpointing_steps", "epoch"))
    lone = _lone(work, "lone", *flags(work / "lone", "--max_train_steps", 400))
    chain_flags = flags(chain, "--max_train_steps", STEPS, "--checkpointing_steps", 5, "--checkpoints_total_limit", 2)
    crash = _launch(work, "crash", *flags(crashed, "--max_train_steps", STEPS, "--checkpointing_steps", 5),
                    **{CRASH_HOOK: "step_10"})
    term = _launch(work, "sigterm", *chain_flags)

    jh.wait_for_text(work / "logs" / "lone.stderr", "step 3:", lone[1])
    os.kill(lone[1].pid, signal.SIGUSR1)  # SLURM's warning signal, to a plain process: its exit code is visible
    jh.wait_for_text(work / "logs" / "sigterm.stderr", f"step {SIGNAL_AFTER}:", term[1])
    t0 = time.monotonic()
    os.kill(term[1].pid, signal.SIGTERM)  # the accelerate launch process only: torchrun forwards it
    res["sigterm"] = jh.finish(term, TIMEOUT_S)
    res["sigterm_exit_seconds"] = time.monotonic() - t0
    saved = complete_checkpoints(chain)
    res["after_sigterm"] = {"checkpoints": [p.name for p in saved], "listing": sorted(p.name for p in chain.iterdir()),
                            "state": json.loads((saved[-1] / "loop_state.json").read_text()) if saved else None}
    final = _pooled(ddp_pool, work, *chain_flags, "--resume_from_checkpoint", "latest")
    res["lone"] = jh.finish(lone, TIMEOUT_S)
    res["crash"] = jh.finish(crash, TIMEOUT_S)
    res["after_crash"] = {"latest": latest_checkpoint(crashed), "listing": sorted(p.name for p in crashed.iterdir())}
    res["uninterrupted"] = ref.result()
    tampered = work / "tampered"
    plant_pickle(work / "ref" / "epoch_0", tampered / "epoch_0", work / "planted_ran")
    res["tampered_before"] = _tree(tampered)
    bad = _launch(work, "tampered", *flags(tampered, "--num_train_epochs", 2, "--resume_from_checkpoint", "latest"))
    res["final"] = final.result()
    res["tampered"] = jh.finish(bad, TIMEOUT_S)
    return res


def plant_pickle(src: Path, dst: Path, marker: Path) -> None:
    """Copy checkpoint ``src`` to ``dst`` with its optimizer file replaced by a plain pickle that, if it were
    unpickled without torch's weights-only guard, would create ``marker`` (what a tampered file could do)."""
    import pickle

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    shutil.copytree(src, dst)
    (dst / "optimizer.bin").write_bytes(pickle.dumps({"state": Planted()}))


def summary(path: Path) -> dict:
    return json.loads((path / "train_summary.json").read_text())


def params(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_uninterrupted_reference_saved_each_epoch(jobs, work):
    assert jobs["uninterrupted"].returncode == 0, jobs["uninterrupted"].describe()
    s = summary(work / "ref")
    assert s["optimizer_steps"] == STEPS and s["checkpoints"] == [f"epoch_{e}" for e in range(EPOCHS)]
    assert s["epochs"] == EPOCHS
    state = json.loads((work / "ref" / "epoch_0" / "loop_state.json").read_text())
    # the epoch ended with a partial window of 2: the checkpoint points at the start of epoch 1
    assert (state["optimizer_steps"], state["epoch"], state["batches_done_in_epoch"]) == (STEPS_PER_EPOCH, 1, 0)
    assert state["micro_batches"] == 50 and "train_loss" not in state  # the history is in history/
    assert read_history(work / "ref" / "epoch_0")["train_loss"] == s["train_loss"][:STEPS_PER_EPOCH]


def test_crash_during_save_leaves_latest_on_the_previous_checkpoint(jobs, work):
    assert jobs["crash"].returncode != 0
    after = jobs["after_crash"]
    assert after["latest"] == work / "crashed" / "step_5"
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
    assert SIGNAL_AFTER <= n < STEPS and saved == [f"step_{5 * ((n - 1) // 5)}", f"step_{n}"]  # limit 2
    assert state["epoch"] == 2 and state["batches_done_in_epoch"] > 0  # part-way into the 3rd epoch
    assert state["micro_batches"] == (n // STEPS_PER_EPOCH) * 50 + (n % STEPS_PER_EPOCH) * K  # a window boundary
    assert f"step_{n}" in lines[0] and "train_summary.json" not in jobs["after_sigterm"]["listing"]
    assert not [p for p in jobs["after_sigterm"]["listing"] if p.endswith(".incomplete")]
    assert jobs["sigterm_exit_seconds"] < 30  # before torchrun's SIGKILL


def test_a_lone_worker_exits_with_the_preemption_code_on_sigusr1(jobs):
    res = jobs["lone"]
    assert res.returncode == PREEMPTED_EXIT_CODE, res.describe()
    assert "preempted by SIGUSR1" in res.stderr


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
    assert got["epochs"] == ref["epochs"] == EPOCHS
    older, newer = complete_checkpoints(work / "chain")
    # the history: the newer checkpoint links the older one's chunks (one inode), adds only its own stretch,
    # and its loop_state.json holds no per-step list (its size does not grow with the step count)
    a, b = (sorted(p.name for p in (c / "history").iterdir()) for c in (older, newer))
    assert b[:len(a)] == a and len(b) == len(a) + 1, (a, b)
    assert all((older / "history" / n).samefile(newer / "history" / n) for n in a)
    history = read_history(newer)["train_loss"]
    assert history == ref["train_loss"][:len(history)] and len(history) > len(read_history(older)["train_loss"])
    assert abs((older / "loop_state.json").stat().st_size - (newer / "loop_state.json").stat().st_size) <= 8  # digits


def test_a_tampered_checkpoint_file_is_refused_by_name_before_anything_runs_or_is_written(jobs, work):
    """A real 2-process launch resuming from a checkpoint whose optimizer file is a plain pickle: one error line
    per process naming the file and the fix, the worker exits 2, the pickle never runs, nothing is written."""
    res = jobs["tampered"]
    assert res.returncode != 0, res.describe()
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    path = work / "tampered" / "epoch_0" / "optimizer.bin"
    assert 1 <= len(errors) <= 2, res.describe()  # one per process (torchrun may stop the second one first)
    assert all(e.startswith(f"error: --resume_from_checkpoint: {path} cannot be loaded (not a torch state")
               and ". Fix: " in e for e in errors), errors
    assert "UnpicklingError" not in res.stderr.split("error: ")[0]  # no raw unpickler traceback before it
    assert res.stderr.count("exitcode  : 2") + res.stderr.count("exitcode : 2") >= 1, res.describe()  # torchrun's report
    assert not (work / "planted_ran").exists()
    assert _tree(work / "tampered") == jobs["tampered_before"]


def test_a_planted_pickle_in_each_kind_of_file_of_a_ddp_checkpoint_is_refused(jobs, work, tmp_path):
    """Beside the launched case above (optimizer.bin): every pickled file of the DDP checkpoint (optimizer,
    scheduler, RNG and data-RNG states) replaced in turn by a pickle that runs a command (tests/planted.py); the
    pre-check of a resume refuses each by name and nothing runs."""
    import planted

    assert jobs["uninterrupted"].returncode == 0, jobs["uninterrupted"].describe()
    table = planted.refused_each_kind(work / "ref" / "epoch_0", tmp_path)
    assert {"optimizer.bin", "scheduler.bin", "random_states_<n>.pkl", "data_rng_<n>.pt"} <= set(table), sorted(table)
    planted.assert_each_refused(table)


# --------------------------------------------------------------------------- bad input, in-process, 1 process


@pytest.fixture
def inproc(work, monkeypatch):
    jh.isolate_in_process(monkeypatch, work / "hf_inproc")
    yield monkeypatch
    jh.reset_accelerate_state()


def _run(capsys, argv):
    from accum_kit.cli import run

    code = run("train", [str(a) for a in argv])
    return code, capsys.readouterr().err


def _tree(root: Path) -> list:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def one_process_checkpoint(jobs, work):
    """The checkpoint the 1-process run saved when it got SIGTERM, and its optimizer steps."""
    assert jobs["lone"].returncode == PREEMPTED_EXIT_CODE, jobs["lone"].describe()
    path = latest_checkpoint(work / "lone")
    return path, json.loads((path / "loop_state.json").read_text())["optimizer_steps"]


BAD = {
    # case: (extra flags, flag named, text in the message); {ckpt}: saved by 1 process, {ref}: by 2
    "other_k": (["--resume_from_checkpoint", "{ckpt}", "--gradient_accumulation_steps", 2],
                "--gradient_accumulation_steps", "resume with --gradient_accumulation_steps 3"),
    "other_batch": (["--resume_from_checkpoint", "{ckpt}", "--per_device_train_batch_size", 4],
                    "--per_device_train_batch_size", "resume with --per_device_train_batch_size 2"),
    "other_world_size": (["--resume_from_checkpoint", "{ref}/epoch_0"], "--num_processes", "world size 2"),
    "missing": (["--resume_from_checkpoint", "{one}/step_9999"], "--resume_from_checkpoint", "does not exist"),
    "incomplete": (["--resume_from_checkpoint", "{one}/.step_copy"], "--resume_from_checkpoint", "incomplete"),
    "tampered": (["--resume_from_checkpoint", "{one}/.step_tampered"], "--resume_from_checkpoint",
                 "optimizer.bin cannot be loaded"),
    "latest_without_any": (["--resume_from_checkpoint", "latest", "--output_dir", "{empty}"],
                           "--resume_from_checkpoint", "no complete checkpoint"),
    "unwritable_output_dir": (["--output_dir", "/sys/accum_kit_test/out"], "--output_dir", "/sys"),
    "checkpointing_steps_word": (["--checkpointing_steps", "often"], "--checkpointing_steps", "'often'"),
    "checkpointing_steps_zero": (["--checkpointing_steps", "0"], "--checkpointing_steps", "'0'"),
    "total_limit_zero": (["--checkpoints_total_limit", "0"], "--checkpoints_total_limit", "got 0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_and_overwrites_nothing(inproc, capsys, work, jobs, one_process_checkpoint, case):
    ckpt, _ = one_process_checkpoint
    one = ckpt.parent
    incomplete = one / ".step_copy"
    if not incomplete.exists():
        shutil.copytree(ckpt, incomplete)
        (incomplete / "checkpoint_complete").unlink()
    if not (one / ".step_tampered").exists():
        plant_pickle(ckpt, one / ".step_tampered", work / "planted_ran_inproc")
    (work / "empty").mkdir(exist_ok=True)
    argv, flag, detail = BAD[case]
    argv = [str(a).format(one=one, ckpt=ckpt, ref=work / "ref", empty=work / "empty") for a in argv]
    before = _tree(one)
    code, err = _run(capsys, ["--train_file", work / "corpus.txt", *flags(one, "--max_train_steps", 4), *argv])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2, err[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: {flag}: ") and ". Fix: " in errors[0], errors
    assert detail in errors[0], errors[0]
    assert _tree(one) == before
    assert not Path("/sys/accum_kit_test").exists() and not (work / "planted_ran_inproc").exists()


def test_elastic_restart_resumes_from_latest_without_a_flag(inproc, capsys, work, one_process_checkpoint):
    """torchrun sets TORCHELASTIC_RESTART_COUNT in restarted workers: they continue from latest."""
    ckpt, steps = one_process_checkpoint
    out = work / "restarted"
    shutil.copytree(ckpt, out / ckpt.name)
    inproc.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    code, err = _run(capsys, ["--train_file", work / "corpus.txt", *flags(out, "--max_train_steps", steps + 1)])
    assert code == 0, err[-3000:]
    s = summary(out)
    assert s["resumed_from_step"] == steps and s["resumed_from"] == str(out / ckpt.name)
    saved = json.loads((ckpt / "loop_state.json").read_text())
    assert s["train_loss"][:steps] == read_history(ckpt)["train_loss"]
    assert len(s["train_loss"]) == steps + 1
