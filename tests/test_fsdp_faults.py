"""Faults under FSDP2 (accelerate_configs/cpu_fsdp.yaml): a killed worker, an elastic restart, a crash mid-save.

The DDP versions are in test_faults.py and test_checkpoint_job.py. Here every launch is the FSDP2 train job
shared with test_train_job.py (``jh.fsdp_job_argv``: tiny preset, 2 processes, K=3, 8 optimizer steps, sharded
checkpoints) saving every 2 steps, and its uninterrupted run is conftest.py's ``fsdp_reference``. Three
launches start beside that reference, on real processes with real signals:

- ``killed``: rank 1 gets SIGKILL as soon as a complete checkpoint exists; the launch must end non-zero and
  name rank 1. Then ``resumed`` (same flags, ``--resume_from_checkpoint latest``, same folder) starts at once;
- ``restarted``: the same with ``accelerate launch --max_restarts 1``: torchrun restarts both workers, which
  resume from ``latest`` by themselves and finish;
- ``crashed``: every process exits while saving ``step_4`` (the test hook, after the shards are written and
  before the rename): ``latest`` must stay on ``step_2``.

``resumed`` and ``restarted`` must end with the reference's parameters, bit for bit, and its loss history.

Cost: 5 launches' worth of processes (the restart starts 2 more workers) beside the shared reference, about
160 s of CPU (measured: the module 193 s of CPU with the reference, the reference alone 33 s), so about
80-90 s on 2 idle cores; 174 to 252 s of wall time on a 2-core machine shared with other test runs.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

import fault_launches as fl
import job_helpers as jh
from accum_kit.core.checkpoint import CRASH_HOOK, complete_checkpoints, latest_checkpoint

EVERY = 2  # --checkpointing_steps: the first checkpoint comes early, leaving most of the run to interrupt
CRASH_AT = "step_4"
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def runs(fsdp_reference, tmp_path_factory):
    """Start the three fault launches beside the reference; signal each when ready; resume the killed one."""
    root = tmp_path_factory.mktemp("fsdp_faults")
    env = jh.clean_env(HF_DATASETS_CACHE=str(fsdp_reference.datasets_cache))  # the reference's tokenised data

    def launch(name, *launcher_flags, folder=None, resume=False, **extra_env):
        argv = jh.fsdp_job_argv(fsdp_reference.corpus, root / (folder or name), "--checkpointing_steps", EVERY,
                                "--logging_steps", 1, *(["--resume_from_checkpoint", "latest"] if resume else []))
        return jh.start(jh.accelerate_launch_cmd(*launcher_flags, *argv, config=jh.FSDP_CONFIG),
                        {**env, **extra_env}, root / "logs", name)

    t0 = time.monotonic()
    started = {"killed": launch("killed"), "restarted": launch("restarted", "--max_restarts", "1"),
               "crashed": launch("crashed", **{CRASH_HOOK: CRASH_AT})}
    proc = {name: s[1] for name, s in started.items()}
    facts = {"killed": {}, "restarted": {}}
    killed = facts["killed"]

    def waiting():
        return (any("pid" not in f and "error" not in f for f in facts.values())
                or ("pid" in killed and "resumed" not in started))

    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and waiting():
            for name, fact in facts.items():
                if "pid" in fact or "error" in fact:
                    continue
                if proc[name].poll() is not None:
                    fact["error"] = f"ended (rc {proc[name].returncode}) before its signal"
                elif (ckpt := latest_checkpoint(root / name)) and (pid := jh.worker_pid(proc[name].pid, 1)):
                    os.kill(pid, signal.SIGKILL)
                    fact.update(pid=pid, checkpoint_then=ckpt.name, signalled_at=time.monotonic())
            if "pid" in killed and "resumed" not in started and proc["killed"].poll() is not None:
                killed["ended_after"] = round(time.monotonic() - killed["signalled_at"], 2)
                killed["latest_then"] = getattr(latest_checkpoint(root / "killed"), "name", None)
                killed["summary_then"] = (root / "killed" / "train_summary.json").exists()
                started["resumed"] = launch("resumed", folder="killed", resume=True)
            time.sleep(0.1)
    finally:
        done = {name: jh.finish(s, timeout=TIMEOUT_S) for name, s in started.items()}
    done["reference"] = fsdp_reference.result()
    for fact in facts.values():
        fact.pop("signalled_at", None)
    print(f"\nFSDP2 fault launches: {json.dumps(facts)}; {time.monotonic() - t0:.0f} s beside the reference")
    return root, done, facts


def _summary(out) -> dict:
    return json.loads((out / "train_summary.json").read_text())


def _assert_equals_reference(out, reference_out) -> dict:
    """Loss history (restored steps and recomputed ones), evaluation loss and saved parameters bitwise equal to the
    uninterrupted run's (tests/fault_launches.py); returns the summary."""
    cmp = fl.compare(out, reference_out, jh.FSDP_JOB_STEPS)
    assert cmp["bitwise_equal"], cmp
    return _summary(out)


def test_the_reference_ran(runs):
    _, done, _ = runs
    assert done["reference"].returncode == 0, done["reference"].describe()


def test_a_killed_worker_ends_the_sharded_job_and_latest_resumes_it_exactly(runs, fsdp_reference):
    root, done, facts = runs
    fact = facts["killed"]
    assert "pid" in fact, fact
    killed = done["killed"]
    assert killed.returncode not in (0, -9), killed.describe()  # ended by itself, not by the test's timeout
    report = killed.stderr[killed.stderr.rfind("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in report and "Signal 9 (SIGKILL)" in report, killed.describe()
    assert fact["summary_then"] is False  # it did not finish before the kill
    assert fact["latest_then"] is not None and int(fact["latest_then"].split("_")[1]) < jh.FSDP_JOB_STEPS, fact
    resumed = done["resumed"]
    assert resumed.returncode == 0, resumed.describe()
    got = _assert_equals_reference(root / "killed", fsdp_reference.output_dir)
    assert got["resumed_from_step"] == int(fact["latest_then"].split("_")[1])
    assert got["resumed_from_step"] >= int(fact["checkpoint_then"].split("_")[1])
    assert "pytorch_model_fsdp_0" in {p.name for p in (root / "killed" / fact["latest_then"]).iterdir()}


def test_max_restarts_survives_a_killed_worker_and_equals_the_uninterrupted_run(runs, fsdp_reference):
    root, done, facts = runs
    fact = facts["restarted"]
    assert "pid" in fact, fact
    res = done["restarted"]
    assert res.returncode == 0, res.describe()
    assert f"local_rank: 1 (pid: {fact['pid']})" in res.stderr, res.describe()  # torchrun saw the killed worker
    assert "elastic restart 1: resuming from" in res.stderr, res.describe()  # no flag was passed
    got = _assert_equals_reference(root / "restarted", fsdp_reference.output_dir)
    assert int(fact["checkpoint_then"].split("_")[1]) <= got["resumed_from_step"] < jh.FSDP_JOB_STEPS


def test_a_crash_during_a_sharded_save_leaves_latest_on_the_previous_checkpoint(runs):
    from accum_kit.core.checkpoint_files import check_checkpoint_files

    root, done, _ = runs
    res, out = done["crashed"], root / "crashed"
    assert res.returncode not in (0, -9), res.describe()
    assert "exitcode  : 3" in res.stderr or "exitcode : 3" in res.stderr, res.describe()  # the hook's exit
    n = int(CRASH_AT.split("_")[1])
    assert [p.name for p in complete_checkpoints(out)] == [f"step_{s}" for s in range(EVERY, n, EVERY)]
    assert latest_checkpoint(out) == out / f"step_{n - EVERY}"
    listing = sorted(p.name for p in out.iterdir())
    assert f".{CRASH_AT}.incomplete" in listing and CRASH_AT not in listing and "train_summary.json" not in listing
    # the crash came after every rank had written its shards: the folder holds them all, and no marker
    partial = out / f".{CRASH_AT}.incomplete"
    for sharded in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in (partial / sharded).iterdir()}
    assert not (partial / "checkpoint_complete").exists()
    check_checkpoint_files(latest_checkpoint(out))  # the previous checkpoint is intact (raises otherwise)
