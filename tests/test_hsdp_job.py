"""The train job under HSDP (accelerate_configs/cpu_hsdp.yaml, 2 replicas x 2 shards): one launch, and the
same job as two loopback "machines" that lose a worker to SIGKILL and resume from ``latest``.

Three launches start together: the one-launch 4-process reference, and two 2-process launches with
``--num_machines 2 --machine_rank 0/1`` (one 4-process gloo group over loopback, as on two nodes). Once a
complete sharded checkpoint exists, rank 3 (on "machine" 1) gets SIGKILL: both machines' launches must
end non-zero. The two machines are then launched again with ``--resume_from_checkpoint latest`` and must
end with the reference's parameters, bit for bit, and its loss history. So the two-machine mesh trains
exactly as the one-launch mesh, and a run killed mid-way resumes exactly, under the
``reduce_scatter_each_batch`` policy.

Cost: one 4-process reference beside two 2-process machines, then the two machines again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import job_helpers as jh
from accum_kit.multinode import node_commands

HSDP_CONFIG = jh.REPO / "accelerate_configs" / "cpu_hsdp.yaml"
K, STEPS, EVERY = 3, 4, 2
POLICY = "reduce_scatter_each_batch"


def _flags(corpus: Path, out: Path, *extra) -> list[str]:
    return ["-m", "accum_kit", "train", "--model_preset", "tiny", "--block_size", "64",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", str(K), "--max_train_steps",
            str(STEPS), "--max_eval_samples", "8", "--train_file", str(corpus), "--output_dir", str(out),
            "--num_warmup_steps", "0", "--accumulation_policy", POLICY, "--checkpointing_steps", str(EVERY),
            "--logging_steps", "1", *extra]


def _machines(out: Path, corpus: Path, *extra) -> list[list[str]]:
    lines = node_commands(2, 4, "127.0.0.1", main_process_port=jh.free_port(), config_file=str(HSDP_CONFIG),
                          rdzv_timeout=120)
    assert all(line[:2] == ["accelerate", "launch"] for line in lines)
    return [[sys.executable, "-m", "accelerate.commands.launch", *line[2:], *_flags(corpus, out, *extra)]
            for line in lines]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    from accum_kit.core.checkpoint import latest_checkpoint

    work = tmp_path_factory.mktemp("hsdp_job")
    corpus = jh.write_corpus(work / "corpus.txt")
    env = jh.clean_env(HF_DATASETS_CACHE=str(work / "hf_cache"))
    single = jh.start(jh.accelerate_launch_cmd(*_flags(corpus, work / "single", "--profile_comm", "--with_tracking",
                                                       "--report_to", "tensorboard"), config=HSDP_CONFIG,
                                              num_processes=4),
                      env, work / "logs", "single")
    machines = [jh.start(cmd, env, work / "logs", f"machine{r}") for r, cmd in enumerate(_machines(work / "two", corpus))]
    killed = None
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and killed is None and machines[1][1].poll() is None:
        pid = latest_checkpoint(work / "two") and jh.worker_pid(machines[1][1].pid, 3)
        if pid:
            os.kill(pid, signal.SIGKILL)
            killed = latest_checkpoint(work / "two").name
        time.sleep(0.2)
    ended = [jh.finish(m, timeout=240) for m in machines]
    resumed = [jh.start(cmd, env, work / "logs", f"resumed{r}")
               for r, cmd in enumerate(_machines(work / "two", corpus, "--resume_from_checkpoint", "latest"))]
    return {"work": work, "killed_at": killed, "killed": ended, "single": jh.finish(single, timeout=400),
            "resumed": [jh.finish(m, timeout=400) for m in resumed]}


def _summary(d: Path) -> dict:
    return json.loads((d / "train_summary.json").read_text())


def test_a_killed_worker_ends_both_machines_before_the_run_ends(jobs):
    assert jobs["killed_at"] is not None, "no checkpoint appeared before the two-machine run ended"
    assert int(jobs["killed_at"].split("_")[-1]) < STEPS
    assert all(f.returncode != 0 for f in jobs["killed"]), [f.returncode for f in jobs["killed"]]


def test_two_machines_resumed_from_latest_equal_the_one_launch_run(jobs):
    from safetensors.torch import load_file

    assert jobs["single"].returncode == 0, jobs["single"].describe()
    for f in jobs["resumed"]:
        assert f.returncode == 0, f.describe()
    work = jobs["work"]
    two, one = _summary(work / "two"), _summary(work / "single")
    assert two["world_size"] == one["world_size"] == 4 and two["optimizer_steps"] == STEPS
    assert two["accumulation_policy"] == POLICY and two["fsdp"]["accumulation_policy"] == POLICY
    assert two["train_loss"] == one["train_loss"]
    a, b = load_file(str(work / "two" / "model.safetensors")), load_file(str(work / "single" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), (name, (a[name] - b[name]).abs().max())


def test_the_jobs_comm_block_gives_each_mesh_dimension(jobs):
    """train_summary.json's comm under HSDP: per step, K reduce-scatter rounds in the shard group and one
    all-reduce round across replicas (reduce_scatter_each_batch), each with its bytes, seconds and busbw."""
    from accum_kit.engines.costs import policy_costs, ShardedModel

    comm = _summary(jobs["work"] / "single")["comm"]
    groups = comm["by_group"]
    assert (groups["shard"]["size"], groups["replicate"]["size"]) == (2, 2)
    layout = ShardedModel.from_units(comm["fsdp_units"])
    c = policy_costs(POLICY, layout, world_size=4, accumulation_steps=K, replicate_size=2)
    assert groups["shard"]["reduce_scatter"]["calls_per_step"] == c.reduce_scatter_calls
    assert groups["replicate"]["all_reduce"]["calls_per_step"] == c.all_reduce_calls
    for block in (groups["shard"]["reduce_scatter"], groups["shard"]["all_gather"], groups["replicate"]["all_reduce"]):
        assert block["seconds_per_step"] > 0 and block["busbw_GBps"] > 0
    assert comm["mesh"] == {"dp_replicate_size": 2, "dp_shard_size": 2}


def test_the_tracker_logs_each_mesh_dimension_per_step(jobs):
    """TensorBoard, read back: per step the all-reduces across replicas (one per unit: the policy's one round per
    window) and the seconds of each group, next to the shard group's reduce-scatters (K rounds)."""
    out = jobs["work"] / "single"
    tb = jh.tensorboard_scalars(out / "accum_kit")
    units = len(_summary(out)["comm"]["fsdp_units"])
    assert sorted(tb["comm/all_reduce_calls"]) == list(range(1, STEPS + 1))
    assert set(tb["comm/all_reduce_calls"].values()) == {units}
    assert set(tb["comm/reduce_scatter_calls"].values()) == {K * units}
    assert all(v > 0 for v in tb["comm/replicate_seconds"].values())
    assert all(v > 0 for v in tb["comm/shard_seconds"].values())

