"""Two ``accelerate launch`` commands on this machine acting as two nodes (one process each).

They must form one 2-process gloo group: ``verify`` passes there, and a short
``train`` run reaches bit-identical parameters to the one-node 2-process run of
the same settings (compared tensor by tensor with plain ``safetensors``), with
one gradient all-reduce per optimizer step. A node whose partner never starts
fails within the rendezvous timeout instead of hanging.

Cost: two concurrent launches (the two "nodes"; the one-node reference is a script run of
conftest.py's shared ``ddp_pool`` beside them) plus a lone "node" that waits out a 10 s
rendezvous timeout, all started together.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import job_helpers as jh
from accum_kit.multinode import node_commands

WORKER = jh.REPO / "tests" / "multinode_worker.py"
K, STEPS = 3, 4
RDZV_TIMEOUT = 10


def train_flags(corpus: Path, out: Path) -> list[str]:
    return ["--model_preset", "tiny", "--block_size", "64", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", str(K), "--max_train_steps", str(STEPS), "--max_eval_samples", "8",
            "--train_file", str(corpus), "--output_dir", str(out), "--profile_comm", "--num_warmup_steps", "0"]


def _python_launch(line: list[str]) -> list[str]:
    # node_commands names `accelerate`; run this venv's launcher module instead.
    assert line[:2] == ["accelerate", "launch"]
    return [sys.executable, "-m", "accelerate.commands.launch", *line[2:]]


@pytest.fixture(scope="module")
def launches(tmp_path_factory, ddp_pool):
    work = tmp_path_factory.mktemp("multinode")
    corpus = jh.write_corpus(work / "corpus.txt")
    env = jh.clean_env(HF_DATASETS_CACHE=str(work / "hf_cache"))
    cfg = str(jh.DDP_CONFIG)
    started = {}
    for name in ("node0", "node1", "single"):
        (work / name).mkdir()
    port = jh.free_port()
    for rank, line in enumerate(node_commands(2, 2, "127.0.0.1", main_process_port=port, config_file=cfg,
                                              rdzv_timeout=120)):
        cmd = [*_python_launch(line), str(WORKER), str(work / f"node{rank}"), "--",
               *train_flags(corpus, work / f"node{rank}" / "train")]
        started[f"node{rank}"] = jh.start(cmd, env, work / "logs", f"node{rank}")
    # the one-node reference: a script run of conftest.py's shared 2-process ddp_pool (same config, one node)
    assert ddp_pool.num_processes == 2 and Path(ddp_pool.config) == Path(cfg)
    single = ddp_pool.submit("multinode_worker", [work / "single", "--", *train_flags(corpus, work / "single" / "train")],
                             datasets_cache=work / "hf_cache", script=WORKER)
    (lone,) = node_commands(2, 2, "127.0.0.1", main_process_port=jh.free_port(), config_file=cfg,
                            rdzv_timeout=RDZV_TIMEOUT)[:1]
    started["lone"] = jh.start([*_python_launch(lone), "-m", "accum_kit", "verify"], env, work / "logs", "lone")
    done = {name: jh.finish(s, timeout=300) for name, s in started.items()}
    done["single"] = single.result()
    return work, done


def _params(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_two_nodes_form_one_group_and_verify_passes(launches):
    work, done = launches
    for name in ("node0", "node1", "single"):
        assert done[name].returncode == 0, done[name].describe()
    for node in ("node0", "node1"):
        rep = json.loads((work / node / f"verify.rank{node[-1]}.json").read_text())
        assert rep["world_size"] == 2 and rep["passed"] is True, rep["rows"]["tokens"]


def test_two_node_training_equals_one_node_training(launches):
    work, done = launches
    summary = json.loads((work / "node0" / "train" / "train_summary.json").read_text())
    reference = json.loads((work / "single" / "train" / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["optimizer_steps"] == STEPS
    assert not (work / "node1" / "train").exists()  # only the main process writes
    # no_sync: one synchronised backward per optimizer step, K - 1 skipped, on every process
    comm = summary["comm"]
    assert comm["syncs"] == STEPS and comm["skipped_syncs"] == STEPS * (K - 1)
    assert [p["syncs"] for p in comm["per_process"]] == [STEPS, STEPS]
    a, b = _params(work / "node0" / "train"), _params(work / "single" / "train")
    assert a.keys() == b.keys()
    for name in a:  # the same ranks run the same arithmetic: bit-identical, not just close
        assert torch.equal(a[name], b[name]), (name, (a[name] - b[name]).abs().max())
    assert summary["train_loss"] == reference["train_loss"]


def test_a_node_whose_partner_never_starts_fails_at_the_rendezvous_timeout(launches):
    _, done = launches
    lone = done["lone"]
    assert lone.returncode != 0
    assert "Timed out" in lone.stderr and "1/2 clients joined" in lone.stderr, lone.describe()
    # the timeout plus start-up; never the 300 s the fixture would wait
    assert lone.seconds < RDZV_TIMEOUT + 120, lone.seconds
