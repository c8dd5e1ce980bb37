"""``accum-kit nodes`` and the SLURM template: the launch lines, checked field by field.

No SLURM here, so the sbatch script runs under bash with a stand-in ``srun``
(runs the task once, as node 1 of a 2-node x 4-GPU allocation) and a stand-in
``accelerate`` that records the argv it was exec'd with.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from accum_kit.cli import run
from accum_kit.errors import UsageError
from accum_kit.multinode import first_host, node_commands, slurm_command

REPO = Path(__file__).resolve().parents[1]
SLURM_2x4 = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[007-008]",
             "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_ID": "4242"}


def flags(argv: list[str]) -> dict:
    """``--name value`` pairs of an accelerate launch argv (up to the script)."""
    out, i = {}, 2
    while i < len(argv) and argv[i].startswith("--"):
        out[argv[i]] = argv[i + 1]
        i += 2
    return out


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[007-008]", "gpu007"), ("gpu[3,5-6]", "gpu3"), ("a1,b2", "a1"), ("node-x", "node-x"),
    ("rack1-n[10-11],rack2-n1", "rack1-n10"),
])
def test_first_host_of_a_slurm_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def test_slurm_2_nodes_x_4_gpus():
    cmd = slurm_command(SLURM_2x4, command=["examples/train.py", "--output_dir", "runs/x"])
    assert cmd[:2] == ["accelerate", "launch"]
    assert flags(cmd) == {"--config_file": "accelerate_configs/multi_node.yaml", "--num_machines": "2",
                          "--machine_rank": "1", "--num_processes": "8", "--main_process_ip": "gpu007",
                          "--main_process_port": "29500", "--rdzv_conf": "timeout=300"}
    assert cmd[-3:] == ["examples/train.py", "--output_dir", "runs/x"]
    over = slurm_command({**SLURM_2x4, "SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "a100:4",
                          "MAIN_PROCESS_IP": "10.1.2.3", "MAIN_PROCESS_PORT": "29777"})
    assert flags(over)["--main_process_ip"] == "10.1.2.3" and flags(over)["--main_process_port"] == "29777"
    assert flags(over)["--num_processes"] == "8"


def test_missing_slurm_variable_names_it():
    env = dict(SLURM_2x4)
    del env["SLURM_NODEID"]
    with pytest.raises(UsageError, match="SLURM_NODEID: is not set"):
        slurm_command(env)


def test_node_commands_differ_only_in_machine_rank():
    lines = node_commands(2, 8, "10.0.0.1", command=["examples/train.py"])
    assert [flags(line)["--machine_rank"] for line in lines] == ["0", "1"]
    a, b = (dict(flags(line)) for line in lines)
    a.pop("--machine_rank"), b.pop("--machine_rank")
    assert a == b and a["--num_processes"] == "8" and a["--main_process_ip"] == "10.0.0.1"


@pytest.mark.parametrize("argv, flag", [
    (["--num_machines", "0"], "--num_machines"),
    (["--num_machines", "3", "--num_processes", "8"], "--num_processes"),
    (["--rdzv_timeout", "0"], "--rdzv_timeout"),
    (["--exec"], "--exec"),
])
def test_bad_input_exits_2_naming_the_flag(argv, flag, capsys):
    assert run("nodes", argv) == 2
    assert f"error: {flag}:" in capsys.readouterr().err


def test_cli_prints_one_line_per_machine(capsys):
    assert run("nodes", ["--num_machines", "2", "--num_processes", "2", "--", "-m", "accum_kit", "verify"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("accelerate launch")]
    assert len(lines) == 2 and all(line.endswith("-m accum_kit verify") for line in lines)


def test_sbatch_script_execs_this_nodes_launch(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    record = tmp_path / "argv.txt"
    # srun: drop its own options, run the task once. accelerate: record what it was called with.
    (fake / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (fake / "accelerate").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {record}\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    env = {**os.environ, **SLURM_2x4, "SLURM_SUBMIT_DIR": str(REPO),
           "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(REPO / "examples/slurm/accum_kit.sbatch"), "--output_dir", "runs/slurm"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    argv = ["accelerate", *record.read_text().splitlines()]
    assert flags(argv)["--machine_rank"] == "1" and flags(argv)["--num_processes"] == "8"
    assert flags(argv)["--main_process_ip"] == "gpu007"
    assert argv[-3:] == ["examples/train.py", "--output_dir", "runs/slurm"]
