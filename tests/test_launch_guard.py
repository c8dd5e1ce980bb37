"""The process-count guard (shared/DESIGN.md's trap) and the K resolution of accum_kit.launch.

On a CPU-only machine ``accelerate launch --config_file accelerate_configs/cpu_ddp.yaml``
starts two processes through torchrun, but a plain ``Accelerator()`` in each
sees one process: two separate trainings, silently. These tests launch real
processes and check that (a) the trap is real here, (b) ``check_process_count``
turns it into an error on every rank and a failed launch, and (c)
``build_accelerator`` makes the processes one gloo group (verified with a raw
``torch.distributed.all_reduce``, not with Accelerate's own counters).

Two launches, started together to share the import time: tests/guard_worker.py
(every check, recorded per rank) and a four-line user script that lets the
ProcessCountError escape.
"""

from __future__ import annotations

import json
import textwrap

import pytest

import job_helpers as jh
from accum_kit import ProcessCountError, UsageError, check_process_count
from accum_kit.launch import launcher_world_size, resolve_accumulation_steps

WORLD = 2
MISMATCH = f"the launcher started {WORLD} processes but the Accelerator sees 1"

UNCAUGHT_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from accelerate import Accelerator
    import accum_kit

    acc = Accelerator()  # what a user script would do
    Path(sys.argv[1], f"rank{os.environ['RANK']}.started").write_text(str(acc.num_processes))
    accum_kit.check_process_count(acc)
    Path(sys.argv[1], f"rank{os.environ['RANK']}.passed").write_text("check passed")
    """
)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch_guard")
    user_script = root / "user_script.py"
    user_script.write_text(UNCAUGHT_SCRIPT)
    (root / "uncaught").mkdir()
    env = jh.clean_env()
    started = {
        "worker": jh.start(jh.accelerate_launch_cmd(str(jh.REPO / "tests" / "guard_worker.py"), str(root / "worker")),
                           env, root, "worker"),
        "uncaught": jh.start(jh.accelerate_launch_cmd(str(user_script), str(root / "uncaught")), env, root, "uncaught"),
    }
    done = {name: jh.finish(s, timeout=180) for name, s in started.items()}
    return root, done


@pytest.fixture(scope="module")
def worker_ranks(launches):
    root, done = launches
    assert done["worker"].returncode == 0, done["worker"].describe()
    ranks = [json.loads((root / "worker" / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["env_rank"] for r in ranks] == list(range(WORLD))
    assert all(r["env_world_size"] == WORLD for r in ranks)
    return ranks


# --------------------------------------------------------------------------- launched


def test_plain_accelerator_trap_is_real_and_caught_on_every_rank(worker_ranks):
    for r in worker_ranks:
        plain = r["plain"]
        # The trap itself: the launcher started 2 processes, each Accelerator sees 1, no group.
        assert plain["num_processes"] == 1, r
        assert plain["distributed_type"] == "DistributedType.NO", r
        assert plain["dist_initialized"] is False, r
        # ... and the guard refuses it, naming both counts and the fix.
        assert plain["error"] is not None, f"rank {r['env_rank']}: check_process_count did not raise"
        assert plain["error"]["type"] == "ProcessCountError", r
        assert MISMATCH in plain["error"]["message"], r
        assert "build_accelerator" in plain["error"]["message"], r


def test_build_accelerator_refuses_a_lone_process_accelerator(worker_ranks):
    for r in worker_ranks:
        forced = r["forced"]
        assert forced["error"] is not None, f"rank {r['env_rank']}: build_accelerator(cpu=False) returned {forced}"
        assert forced["error"]["type"] == "ProcessCountError", r
        assert MISMATCH in forced["error"]["message"], r


def test_build_accelerator_joins_one_gloo_group(worker_ranks):
    built = [r["built"] for r in worker_ranks]
    for rank, b in enumerate(built):
        assert b["error"] is None, b.get("traceback")
        assert b["num_processes"] == WORLD
        assert b["distributed_type"] == "DistributedType.MULTI_CPU"
        assert b["process_index"] == rank
        assert b["gradient_accumulation_steps"] == 3
        assert b["backend"] == "gloo"
        assert b["group_size"] == WORLD
        # A real collective across both processes: 0 + 1. Two lone processes would give 0 and 1.
        assert b["allreduce_rank_sum"] == sum(range(WORLD))


def test_uncaught_process_count_error_fails_the_launch(launches):
    root, done = launches
    res = done["uncaught"]
    assert res.returncode not in (0, -9), res.describe()
    for rank in range(WORLD):
        assert (root / "uncaught" / f"rank{rank}.started").read_text() == "1", res.describe()
        assert not (root / "uncaught" / f"rank{rank}.passed").exists(), f"rank {rank} passed the check"
    assert "ProcessCountError" in res.stderr, res.describe()
    assert MISMATCH in res.stderr, res.describe()


# --------------------------------------------------------------------------- in-process units


@pytest.fixture
def no_launcher_env(monkeypatch):
    for name in jh.LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    jh.reset_accelerate_state()


def test_check_process_count_compares_launcher_world_size(no_launcher_env):
    from accelerate import Accelerator

    jh.reset_accelerate_state()
    acc = Accelerator(cpu=True)  # built before WORLD_SIZE is set: a lone process
    assert acc.num_processes == 1
    check_process_count(acc)  # no launcher: 1 == 1
    no_launcher_env.setenv("WORLD_SIZE", "2")
    assert launcher_world_size() == 2
    with pytest.raises(ProcessCountError, match=MISMATCH):
        check_process_count(acc)
    check_process_count(acc, expected=1)  # an explicit expectation wins over the environment
    with pytest.raises(ProcessCountError, match="started 3 processes"):
        check_process_count(acc, expected=3)


@pytest.mark.parametrize("requested", [0, -1])
def test_resolve_rejects_k_below_one(no_launcher_env, requested):
    with pytest.raises(UsageError) as info:
        resolve_accumulation_steps(requested)
    assert info.value.flag == "--gradient_accumulation_steps"
    assert f"got {requested}" in str(info.value)


def test_resolve_launcher_env_conflict_and_precedence(no_launcher_env):
    env = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
    assert resolve_accumulation_steps(None, default=4) == 4
    assert resolve_accumulation_steps(5, default=4) == 5
    no_launcher_env.setenv(env, "3")
    assert resolve_accumulation_steps(None, default=4) == 3  # the launcher's value beats the default
    assert resolve_accumulation_steps(3, default=4) == 3  # same value in both places is fine
    with pytest.raises(UsageError) as info:
        resolve_accumulation_steps(8, default=4)
    assert info.value.flag == "--gradient_accumulation_steps"
    assert "8" in info.value.problem and "3" in info.value.problem
    no_launcher_env.setenv(env, "0")
    with pytest.raises(UsageError, match="--gradient_accumulation_steps"):
        resolve_accumulation_steps(None)
    no_launcher_env.setenv(env, "")
    assert resolve_accumulation_steps(None, default=2) == 2  # empty means unset
