"""Faults on real ``accelerate launch`` jobs: a stalled worker, a killed worker, an elastic restart.

Four 2-process launches start together (the import time overlaps) and real
signals hit real worker processes. Two run tests/fault_worker.py:

- ``stall``: ``--ddp_timeout``-style timeout of 5 s; once both ranks have
  trained 2 steps, rank 1 gets SIGSTOP. Rank 0 must fail within the timeout
  with a line that names its rank and the collective; the launch must end
  non-zero by itself (torchrun kills the stopped worker 30 s after the failure).
- ``kill``: rank 1 gets SIGKILL after 2 steps; the launch must end non-zero
  within 60 s and name rank 1 as the failed one.

Two run the train job itself (``accelerate launch -m accum_kit train``): an
uninterrupted reference, and the same flags with ``--max_restarts 1`` (the
default static rendezvous; an accelerate config file cannot hold
``max_restarts``: accelerate 1.15 rejects the key) whose rank 1 gets SIGKILL as
soon as a complete checkpoint exists. The restarted workers must form a new
group (the dead attempt's store keys are still there, see
``accum_kit.launch.init_restartable_process_group``), resume from ``latest``
without a flag, and end with the reference's losses and parameters.

Plus in-process checks of the timeout plumbing and of the message parser.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from datetime import timedelta

import pytest

import job_helpers as jh

WORKER = jh.REPO / "tests" / "fault_worker.py"
TIMEOUT_S = 5.0
READY_WITHIN_S = 180  # imports on a loaded 2-core machine


def _cmd(*args):
    return jh.accelerate_launch_cmd(str(WORKER), *args)


def _wait_for(predicate, timeout, poll=0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    return None


def _stderr_text(root, name):
    return (root / f"{name}.stderr").read_text(errors="replace")


def _job_flags(out):
    return ["--model_preset", "tiny", "--block_size", "64", "--max_train_samples", "200",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "3", "--max_train_steps", "30",
            "--checkpointing_steps", "3", "--num_warmup_steps", "2", "--logging_steps", "1",
            "--max_eval_samples", "16", "--output_dir", str(out)]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """Start all five launches at once, fire each signal when its job is ready, time what follows."""
    from accum_kit.core.checkpoint import latest_checkpoint

    root = tmp_path_factory.mktemp("faults")
    env = jh.clean_env(HF_DATASETS_CACHE=str(root / "hf"))
    corpus = jh.write_corpus(root / "corpus.txt")

    def job(name, *launch_flags):
        return jh.accelerate_launch_cmd(*launch_flags, "-m", "accum_kit", "train", "--train_file", str(corpus),
                                        *_job_flags(root / name))

    cmds = {
        "stall": _cmd(str(root / "stall"), str(TIMEOUT_S)),
        "kill": _cmd(str(root / "kill")),
        "reference": job("reference"),
        "restarted_job": job("restarted_job", "--max_restarts", "1"),
    }
    started = {name: jh.start(cmd, env, root, name) for name, cmd in cmds.items()}
    proc = {name: s[1] for name, s in started.items()}

    def pid_file_ready(name):
        f = root / name / "rank1.pid"
        return int(f.read_text()) if f.exists() and f.read_text() else None

    pending = {  # name: (signal, when ready -> the pid to signal, or None)
        "stall": (signal.SIGSTOP, lambda: pid_file_ready("stall")),
        "kill": (signal.SIGKILL, lambda: pid_file_ready("kill")),
        "restarted_job": (signal.SIGKILL,
                          lambda: latest_checkpoint(root / "restarted_job") and jh.worker_pid(proc["restarted_job"].pid, 1)),
    }
    facts = {name: {} for name in pending}
    try:
        deadline = time.monotonic() + READY_WITHIN_S + 120
        stall = facts.setdefault("stall", {})

        def waiting():
            running = [n for n, f in facts.items() if "signalled_at" in f and "ended_after" not in f]
            return pending or running or ("signalled_at" in stall and "detected_after" not in stall)

        while time.monotonic() < deadline and waiting():
            for name in list(pending):
                signum, ready = pending[name]
                if proc[name].poll() is not None:
                    facts[name].update(error=f"ended (rc {proc[name].returncode}) before its signal")
                    del pending[name]
                elif pid := ready():
                    os.kill(pid, signum)
                    facts[name].update(pid=pid, signalled_at=time.monotonic())
                    if name == "restarted_job":
                        facts[name]["checkpoint_then"] = latest_checkpoint(root / name).name
                    del pending[name]
            for name, fact in facts.items():  # when each signalled launch ends, to 20 ms
                if "signalled_at" in fact and "ended_after" not in fact and proc[name].poll() is not None:
                    fact["ended_after"] = time.monotonic() - fact["signalled_at"]
            if "signalled_at" in stall and "detected_after" not in stall:
                if re.search(r"^error: rank 0: .*$", _stderr_text(root, "stall"), re.M):
                    stall["detected_after"] = time.monotonic() - stall["signalled_at"]
            time.sleep(0.02)
    finally:
        done = {name: jh.finish(s, timeout=300) for name, s in started.items()}
    for fact in facts.values():
        fact.pop("signalled_at", None)
    print(f"\nfault timings (s after the signal): {json.dumps(facts)}")
    return root, done, facts


def test_stalled_worker_makes_the_others_fail_within_the_timeout(faults):
    root, done, facts = faults
    res, fact = done["stall"], facts["stall"]
    assert "pid" in fact, fact
    assert fact.get("detected_after") is not None, f"rank 0 never reported a failed collective\n{res.describe()}"
    # Not before the timeout (it is the timeout that fired), and not much after it.
    assert TIMEOUT_S - 0.5 <= fact["detected_after"] <= TIMEOUT_S + 20, fact
    line = re.search(r"^error: rank 0: .*$", res.stderr, re.M).group(0)
    assert f"timed out after {TIMEOUT_S:g} s" in line and "--ddp_timeout" in line, line
    # It names the collective the job was in: DDP's gradient all-reduce, or the loop's own all_reduce / barrier.
    assert re.search(r"rank 0: (DDP's gradient all_reduce|all_reduce|barrier|all_gather\w*) ", line), line
    assert "called at " in line, line
    # No silent hang: the launch ended by itself, non-zero (torchrun kills the stopped worker 30 s later).
    assert res.returncode not in (0, -9), res.describe()
    assert fact.get("ended_after", float("inf")) < TIMEOUT_S + 60, fact
    assert "rank      : 0 (local_rank: 0)" in res.stderr  # the launcher's report: rank 0 failed first
    # one message from the workers: rank 0's line, no traceback of its own; the one traceback left is accelerate
    # launch's, re-raising torchrun's ChildFailedError in the launcher process (no accum-kit code runs there)
    assert len(re.findall(r"^error: ", res.stderr, re.M)) == 1, res.describe()
    tracebacks = res.stderr.split("Traceback (most recent call last):")[1:]
    assert len(tracebacks) == 1 and "ChildFailedError" in tracebacks[0], res.describe()
    assert "accelerate" in tracebacks[0] and "fault_worker.py\", line" not in tracebacks[0], res.describe()
    assert not (root / "stall" / "rank0.json").exists()  # the job did not carry on as if nothing happened


def test_killed_worker_ends_the_job_and_names_the_rank(faults):
    root, done, facts = faults
    res, fact = done["kill"], facts["kill"]
    assert "pid" in fact, fact
    assert res.returncode not in (0, -9), res.describe()
    assert fact.get("ended_after", float("inf")) < 60, fact
    report = res.stderr[res.stderr.rfind("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in report and "Signal 9 (SIGKILL)" in report, res.describe()
    assert str(fact["pid"]) in report
    # Whether rank 0 first hits a collective (and prints "error: rank 0: ... lost its connection") or is
    # stopped by torchrun's SIGTERM first is a race (torchrun polls its workers every 0.1 s): not checked.


# --------------------------------------------------------------------------- the train job, restarted


def test_restarted_job_resumes_from_latest_and_equals_the_uninterrupted_run(faults):
    from safetensors.torch import load_file

    root, done, facts = faults
    fact = facts["restarted_job"]
    assert "pid" in fact, fact
    for name in ("reference", "restarted_job"):
        assert done[name].returncode == 0, done[name].describe()
    res = done["restarted_job"]
    assert f"local_rank: 1 (pid: {fact['pid']})" in res.stderr, res.describe()  # torchrun saw the killed worker
    assert "elastic restart 1: resuming from" in res.stderr, res.describe()  # no flag was passed
    ref = json.loads((root / "reference" / "train_summary.json").read_text())
    got = json.loads((root / "restarted_job" / "train_summary.json").read_text())
    assert got["resumed_from_step"] is not None and 3 <= got["resumed_from_step"] < 30, got["resumed_from_step"]
    assert got["resumed_from_step"] >= int(fact["checkpoint_then"].split("_")[1])
    assert len(got["train_loss"]) == 30
    assert got["train_loss"] == ref["train_loss"]  # restored steps and new ones, bitwise
    a = load_file(root / "reference" / "model.safetensors")
    b = load_file(root / "restarted_job" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all((a[k] - b[k]).abs().max().item() <= 1e-6 for k in a)


# --------------------------------------------------------------------------- in-process


@pytest.fixture
def no_launcher(monkeypatch):
    for name in (*jh.LAUNCHER_VARS, "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                 "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    jh.reset_accelerate_state()
    yield monkeypatch
    jh.reset_accelerate_state()


def test_ddp_timeout_reaches_init_process_group_kwargs(no_launcher):
    from accelerate.utils import InitProcessGroupKwargs

    from accum_kit import build_accelerator

    acc = build_accelerator(2, ddp_timeout=7)
    assert acc.init_handler.timeout == timedelta(seconds=7)
    jh.reset_accelerate_state()
    # A user's own InitProcessGroupKwargs keeps its other fields and gets the timeout; no duplicate handler.
    own = InitProcessGroupKwargs(init_method="tcp://127.0.0.1:1", timeout=timedelta(seconds=99))
    acc = build_accelerator(2, ddp_timeout=3, kwargs_handlers=[own])
    assert acc.init_handler.timeout == timedelta(seconds=3) and acc.init_handler.init_method == "tcp://127.0.0.1:1"
    assert own.timeout == timedelta(seconds=99)  # not mutated


@pytest.mark.parametrize("bad", [0, -1, float("nan")])
def test_ddp_timeout_must_be_positive(no_launcher, bad):
    from accum_kit import UsageError, build_accelerator

    with pytest.raises(UsageError) as info:
        build_accelerator(2, ddp_timeout=bad)
    assert info.value.flag == "--ddp_timeout"


def test_restartable_group_only_under_a_restart_capable_launch(no_launcher):
    from accum_kit.launch import elastic_restarts_possible, init_restartable_process_group

    assert not elastic_restarts_possible()
    assert init_restartable_process_group() is False  # plain runs keep Accelerate's own init
    no_launcher.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    no_launcher.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert not elastic_restarts_possible()  # no restart can happen
    no_launcher.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    assert elastic_restarts_possible()
    no_launcher.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert not elastic_restarts_possible()  # each round has a fresh store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)


def test_describe_collective_failure_reads_gloo_messages():
    from accum_kit.core.faults import describe_collective_failure

    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete")
    assert "timed out after 3 s" in describe_collective_failure(timeout)
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer.")
    assert "lost its connection" in describe_collective_failure(reset)
    assert describe_collective_failure(ValueError("something else")) is None
    # a lost connection that is not the process group's (a download, a socket of the user's): not a collective's
    assert describe_collective_failure(ConnectionRefusedError(111, "Connection refused")) is None


def _installed(path: str, source: str, env: dict) -> dict:
    """Run ``source`` as if it were the installed file ``path`` (its frames carry that file name)."""
    exec(compile(source, path, "exec"), env)
    return env


def test_the_caller_named_is_outside_every_installed_package():
    """Under DeepSpeed the collective is called by DeepSpeed's wrappers (``deepspeed/comm/torch.py``, or
    typing_extensions' ``deprecated`` wrapper), both installed packages: the line names the frame that called
    into them, as under DDP it names the one that called torch (found by benchmarks/deepspeed/faults.py: the
    killed ZeRO runs' line said ``called at comm/torch.py:290 in all_reduce``)."""
    from accum_kit.core.faults import describe_collective_failure

    site = os.path.join(os.sep, "venv", "lib", "python3.11", "site-packages")
    env = _installed(os.path.join(site, "torch", "distributed", "distributed_c10d.py"),
                     "def all_reduce(t):\n    raise RuntimeError('[gloo/transport/tcp/pair.cc:537] Read error "
                     "[127.0.0.1]:1: Connection reset by peer.')\n", {})
    env = _installed(os.path.join(site, "deepspeed", "comm", "torch.py"),
                     "def ds_all_reduce(t):\n    all_reduce(t)\n", env)
    env = _installed(os.path.join(site, "typing_extensions.py"), "def wrapper(t):\n    ds_all_reduce(t)\n", env)
    import inspect

    try:
        call_line = inspect.currentframe().f_lineno + 1
        env["wrapper"](None)  # this test's frame is the caller
    except RuntimeError as exc:
        line = describe_collective_failure(exc)
    name = inspect.currentframe().f_code.co_name
    assert f"all_reduce (called at tests/test_faults.py:{call_line} in {name}) lost its connection" in line, line


def test_the_hook_prints_one_line_in_place_of_a_collective_failures_traceback(monkeypatch, capsys):
    """A collective failure reaching ``sys.excepthook``: the one ``error:`` line and not the traceback (the hook
    in place is not called); ``ACCUM_KIT_TRACEBACK=1`` adds the traceback; any other exception is left alone."""
    from accum_kit.core.faults import TRACEBACK_ENV, install_collective_failure_hook

    seen = []
    monkeypatch.setattr("sys.excepthook", lambda *exc_info: seen.append(exc_info[1]))
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    install_collective_failure_hook()
    import sys

    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")
    sys.excepthook(RuntimeError, timeout, None)
    err = capsys.readouterr().err
    assert err.startswith("error: rank 0: ") and err.count("\n") == 1 and seen == [], (err, seen)
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    sys.excepthook(RuntimeError, timeout, None)
    assert capsys.readouterr().err.startswith("error: rank 0: ") and seen == [timeout]
    other = ValueError("something else")
    sys.excepthook(ValueError, other, None)
    assert capsys.readouterr().err == "" and seen == [timeout, other]
