"""Faults on real ``accelerate launch`` jobs: a stalled worker, a killed worker, an elastic restart.

Three 2-process launches of tests/fault_worker.py start together (one import
cost) and real signals hit real worker processes:

- ``stall``: ``--ddp_timeout``-style timeout of 5 s; once both ranks have
  trained 2 steps, rank 1 gets SIGSTOP. Rank 0 must fail within the timeout
  with a line that names its rank and the collective; the launch must end
  non-zero by itself (torchrun kills the stopped worker 30 s after the failure).
- ``kill``: rank 1 gets SIGKILL after 2 steps; the launch must end non-zero
  within 60 s and name rank 1 as the failed one.
- ``restart``: ``accelerate launch --config_file accelerate_configs/cpu_ddp.yaml
  --max_restarts 1`` (an accelerate config file cannot hold ``max_restarts``:
  accelerate 1.15 rejects the key); rank 1 of attempt 0 kills itself
  (``os._exit(9)``), attempt 1 must form a group and finish with rc 0. Its
  final parameters are compared with plain-PyTorch SGD on the same samples.

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
import torch

import job_helpers as jh

WORKER = jh.REPO / "tests" / "fault_worker.py"
TIMEOUT_S = 5.0
READY_WITHIN_S = 180  # imports on a loaded 2-core machine


def _cmd(*args, launch_flags=()):
    return jh.accelerate_launch_cmd(*launch_flags, str(WORKER), *args)


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


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    env = jh.clean_env()
    started = {
        "stall": jh.start(_cmd("run", str(root / "stall"), str(TIMEOUT_S)), env, root, "stall"),
        "kill": jh.start(_cmd("run", str(root / "kill")), env, root, "kill"),
        "restart": jh.start(_cmd("restart", str(root / "restart"), launch_flags=("--max_restarts", "1")), env, root, "restart"),
    }
    facts = {}
    try:
        for name, signum in (("stall", signal.SIGSTOP), ("kill", signal.SIGKILL)):
            pid_file = root / name / "rank1.pid"
            proc = started[name][1]
            ready = _wait_for(lambda: pid_file.exists() and pid_file.read_text() or proc.poll() is not None,
                              READY_WITHIN_S)
            assert ready and proc.poll() is None, f"{name}: rank 1 never reached step 2\n" + _stderr_text(root, name)[-3000:]
            pid = int(pid_file.read_text())
            os.kill(pid, signum)
            facts[name] = {"pid": pid, "signalled_at": time.monotonic()}
        # Rank 0 of the stalled job: when does its error line appear?
        line = _wait_for(lambda: re.search(r"^error: rank 0: .*$", _stderr_text(root, "stall"), re.M), TIMEOUT_S + 60)
        facts["stall"]["detected_after"] = time.monotonic() - facts["stall"]["signalled_at"] if line else None
    finally:
        done = {name: jh.finish(s, timeout=240) for name, s in started.items()}
    for name in ("stall", "kill"):
        if name in facts:
            facts[name]["ended_after"] = (done[name].seconds + started[name][4]) - facts[name]["signalled_at"]
    return root, done, facts


def test_stalled_worker_makes_the_others_fail_within_the_timeout(faults):
    root, done, facts = faults
    res, fact = done["stall"], facts["stall"]
    assert fact["detected_after"] is not None, f"rank 0 never reported a failed collective\n{res.describe()}"
    # Not before the timeout (it is the timeout that fired), and not much after it.
    assert TIMEOUT_S - 0.5 <= fact["detected_after"] <= TIMEOUT_S + 20, fact
    line = re.search(r"^error: rank 0: .*$", res.stderr, re.M).group(0)
    assert f"timed out after {TIMEOUT_S:g} s" in line and "--ddp_timeout" in line, line
    # It names the collective the job was in: DDP's gradient all-reduce, or the loop's own all_reduce / barrier.
    assert re.search(r"rank 0: (DDP's gradient all_reduce|all_reduce|barrier|all_gather\w*) ", line), line
    assert "called at " in line, line
    # No silent hang: the launch ended by itself, non-zero (torchrun kills the stopped worker 30 s later).
    assert res.returncode not in (0, -9), res.describe()
    assert fact["ended_after"] < TIMEOUT_S + 60, fact
    assert "rank      : 0 (local_rank: 0)" in res.stderr  # the launcher's report: rank 0 failed first
    assert not (root / "stall" / "rank0.json").exists()  # the job did not carry on as if nothing happened


def test_killed_worker_ends_the_job_and_names_the_rank(faults):
    root, done, facts = faults
    res, fact = done["kill"], facts["kill"]
    assert res.returncode not in (0, -9), res.describe()
    assert fact["ended_after"] < 60, fact
    report = res.stderr[res.stderr.rfind("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in report and "Signal 9 (SIGKILL)" in report, res.describe()
    assert str(fact["pid"]) in report
    # Whether rank 0 first hits a collective (and prints "error: rank 0: ... lost its connection") or is
    # stopped by torchrun's SIGTERM first is a race (torchrun polls its workers every 0.1 s): not checked.


def _plain_sgd_params(steps: int, global_batch: int):
    """Independent oracle: one process, plain SGD on the mean squared error of each global batch, in data order."""
    from fault_worker import B, FEATURES, K  # noqa: F401 - the worker's sizes

    torch.manual_seed(0)
    x, y = torch.randn(4000, FEATURES), torch.randn(4000, 1)
    model = torch.nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for s in range(steps):
        xb, yb = x[s * global_batch:(s + 1) * global_batch], y[s * global_batch:(s + 1) * global_batch]
        opt.zero_grad()
        ((model(xb) - yb) ** 2).mean().backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_elastic_restart_survives_a_killed_worker(faults):
    root, done, _ = faults
    res = done["restart"]
    assert res.returncode == 0, res.describe()
    assert "attempt 0 kills itself" in res.stdout + res.stderr
    records = [json.loads((root / "restart" / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, rec in enumerate(records):
        assert rec["attempt"] == 1, rec  # written by the restarted attempt only
        assert rec["group_size"] == 2 and rec["num_processes"] == 2, rec
        assert rec["distributed_type"] == "DistributedType.MULTI_CPU", rec
        assert rec["allreduce_rank_sum"] == 1.0, rec  # 0 + 1: one group, not two lone processes
        assert rec["steps"] == 6, rec
    assert records[0]["params"] == records[1]["params"]
    from fault_worker import B, K

    expected = _plain_sgd_params(6, global_batch=B * K * 2)
    for got, want in zip(records[0]["params"], expected):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


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
    from accum_kit.faults import describe_collective_failure

    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete")
    assert "timed out after 3 s" in describe_collective_failure(timeout)
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer.")
    assert "lost its connection" in describe_collective_failure(reset)
    assert describe_collective_failure(ValueError("something else")) is None
