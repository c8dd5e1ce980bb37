"""The process-count guard (a plain Accelerator on a CPU-only machine trains each process alone) and the K resolution of accum_kit.launch.

On a CPU-only machine ``accelerate launch --config_file accelerate_configs/cpu_ddp.yaml``
starts two processes through torchrun, but a plain ``Accelerator()`` in each
sees one process: two separate trainings, silently. These tests launch real
processes (tests/guard_worker.py) and check that (a) the trap is real here,
(b) ``check_process_count`` turns it into an error on every rank and a failed
launch, and (c) ``build_accelerator`` makes the processes one gloo group,
verified with a raw ``torch.distributed.all_reduce``, not with Accelerate's
own counters. The two launches start together to share the import time.
"""

from __future__ import annotations

import json

import pytest

import job_helpers as jh
from accum_kit import ProcessCountError, UsageError, check_process_count
from accum_kit.launch import launcher_world_size, resolve_accumulation_steps

WORLD = 2
MISMATCH = f"the launcher started {WORLD} processes but the Accelerator sees 1"
WORKER = jh.REPO / "tests" / "guard_worker.py"


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch_guard")
    env = jh.clean_env()
    started = {
        mode: jh.start(jh.accelerate_launch_cmd(str(WORKER), mode, str(root / mode)), env, root, mode)
        for mode in ("built", "plain")
    }
    done = {mode: jh.finish(s, timeout=180) for mode, s in started.items()}
    records = {}
    for mode in done:
        records[mode] = [
            json.loads(p.read_text()) if (p := root / mode / f"rank{r}.json").exists() else None for r in range(WORLD)
        ]
    return root, done, records


def _ranks(launches, mode):
    root, done, records = launches
    assert all(r is not None for r in records[mode]), f"a rank wrote no record\n{done[mode].describe()}"
    assert [r["env_rank"] for r in records[mode]] == list(range(WORLD))
    assert all(r["env_world_size"] == WORLD for r in records[mode])
    return records[mode]


def test_plain_accelerator_sees_one_process_and_the_launch_fails(launches):
    root, done, _ = launches
    for r in _ranks(launches, "plain"):
        # The trap itself: the launcher started 2 processes, each Accelerator sees 1.
        assert r["plain"]["num_processes"] == 1, r
        assert r["plain"]["distributed_type"] == "DistributedType.NO", r
        assert not (root / "plain" / f"rank{r['env_rank']}.passed").exists(), f"rank {r['env_rank']}: no error raised"
    res = done["plain"]
    assert res.returncode not in (0, -9), res.describe()  # failed, and not by our timeout
    # The error reaches the user with both counts and the fix, once per rank.
    assert res.stderr.count("ProcessCountError: " + MISMATCH) >= WORLD, res.describe()
    assert "build_accelerator" in res.stderr


def test_build_accelerator_refuses_a_lone_process_accelerator(launches):
    for r in _ranks(launches, "plain"):
        forced = r["forced"]
        assert forced["error"] is not None, f"rank {r['env_rank']}: build_accelerator(cpu=False) returned {forced}"
        assert forced["error"]["type"] == "ProcessCountError", r
        assert MISMATCH in forced["error"]["message"], r


def test_build_accelerator_joins_one_gloo_group(launches):
    root, done, _ = launches
    assert done["built"].returncode == 0, done["built"].describe()
    for rank, b in enumerate(_ranks(launches, "built")):
        assert b["error"] is None, b.get("traceback")
        assert b["dist_initialized_before"] is False
        assert b["num_processes"] == WORLD
        assert b["distributed_type"] == "DistributedType.MULTI_CPU"
        assert b["process_index"] == rank
        assert b["gradient_accumulation_steps"] == 3
        assert b["backend"] == "gloo"
        assert b["group_size"] == WORLD
        # A real collective across both processes: 0 + 1. Two lone processes would give 0 and 1.
        assert b["allreduce_rank_sum"] == sum(range(WORLD))


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
