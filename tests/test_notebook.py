"""accum_kit.notebook.launch from a real Jupyter kernel (nbclient + ipykernel), with functions defined in cells."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

SETUP = """
import os
os.environ.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1")
from accum_kit.notebook import launch, LaunchError
"""

DEFINE = """
def rank_sum(x):
    # defined in a cell: lives in the kernel's __main__ and cannot be pickled for a spawn start
    import torch
    from accum_kit import build_accelerator
    acc = build_accelerator(2)
    total = acc.reduce(torch.tensor([float(acc.process_index + 1)]), reduction="sum").item()
    return {"world_size": acc.num_processes, "total": total, "x": x, "pid_differs": os.getpid() != PARENT}

PARENT = os.getpid()

def fails_on_rank_1():
    from accum_kit import build_accelerator
    acc = build_accelerator(2)
    if acc.process_index == 1:
        raise ValueError("bad batch on rank one")
    acc.wait_for_everyone()
"""

RUN_TWICE = """
first = launch(rank_sum, 3, num_processes=2, timeout=120)
second = launch(rank_sum, 4, num_processes=2, timeout=120)
print("FIRST", first)
print("SECOND", second)
"""

RAISE = """
try:
    launch(fails_on_rank_1, num_processes=2, timeout=120, grace_seconds=5)
except LaunchError as exc:
    print("CAUGHT", exc)
"""


@pytest.fixture(scope="module")
def executed():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (SETUP, DEFINE, RUN_TWICE, RAISE)]
    env_keep = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT") if k in os.environ}
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    finally:
        os.environ.update(env_keep)
    return ["".join(o.get("text", "") for o in cell.outputs) for cell in nb.cells]


def test_cell_function_runs_on_two_processes_twice(executed):
    out = executed[2]
    first = eval(out.split("FIRST ", 1)[1].splitlines()[0])  # the dict printed by the cell
    second = eval(out.split("SECOND ", 1)[1].splitlines()[0])
    # 1 + 2 summed over one gloo group of two processes (two separate trainings would give 1 on rank 0)
    assert first == {"world_size": 2, "total": 3.0, "x": 3, "pid_differs": True}
    assert second == {"world_size": 2, "total": 3.0, "x": 4, "pid_differs": True}


def test_exception_on_rank_1_reaches_the_notebook_with_its_rank(executed):
    out = executed[3]
    assert "CAUGHT" in out, out
    assert "rank 1 raised ValueError: bad batch on rank one" in out, out
    assert "Traceback" in out and "fails_on_rank_1" in out, out


def _killed_on_rank_1():
    import signal
    import time

    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _returns_its_rank():
    return {"rank": int(os.environ["RANK"]), "pid": os.getpid()}


def test_launch_returns_rank_0s_value():
    """Each rank returns a different value: the launch must hand back rank 0's, not any other rank's."""
    from accum_kit.notebook import launch

    got = launch(_returns_its_rank, num_processes=2, timeout=60)
    assert got["rank"] == 0 and got["pid"] != os.getpid(), got


def _hangs():
    import time

    time.sleep(60)


def test_a_killed_process_ends_the_launch_with_its_rank():
    import time

    from accum_kit.notebook import LaunchError, launch

    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_killed_on_rank_1, num_processes=2, timeout=30, grace_seconds=1)
    assert time.monotonic() - t0 < 20
    assert "rank 1 died with exit code -9 (SIGKILL)" in str(info.value)
    assert "ranks [0] were still running and were killed" in str(info.value)


def test_a_hung_launch_ends_at_its_timeout():
    import time

    from accum_kit.notebook import LaunchError, launch

    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_hangs, num_processes=2, timeout=2)
    assert 2 <= time.monotonic() - t0 < 15
    assert "still running after timeout=2 s" in str(info.value)


NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "accumulation.ipynb"
INJECTED = 'TRAIN_PRESET, TRAIN_BLOCK_SIZE, AB_PRESET = "tiny", 64, "tiny"'


@pytest.fixture(scope="module")
def user_notebook():
    """examples/notebooks/accumulation.ipynb executed afresh in a real kernel (outputs as text per cell)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # papermill's convention: values injected in a cell right after the one tagged "parameters"; the smallest
    # preset keeps this affordable on 2 cores (what is checked below is the machinery, not the model's quality)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(INJECTED))
    env_keep = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT") if k in os.environ}
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    finally:
        os.environ.update(env_keep)
    texts = []
    for cell in nb.cells:
        outs = cell.get("outputs", [])
        assert not any(o.output_type == "error" for o in outs), [o for o in outs if o.output_type == "error"]
        texts.append("".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outs))
    return "\n".join(texts)


def test_user_notebook_trains_on_two_processes_and_measures_the_saving(user_notebook):
    out = user_notebook
    assert "world size 2 (DistributedType.MULTI_CPU)" in out, out[-3000:]
    before, after = map(float, re.search(r"eval loss ([\d.]+) -> ([\d.]+) nats", out).groups())
    assert after < before - 0.5
    # The A/B machinery, not its timing (a speed claim belongs to accum-kit bench, with an interval): after the
    # warm-up window, 3 windows per mode alternate from the run's own mode, and a sync_each_batch window
    # all-reduces every bucket on each of its K=8 micro-batches where a no_sync window does once.
    assert re.search(r"A/B windows in order: (.+)", out).group(1).split() == ["no_sync", "sync_each_batch"] * 3, out[-3000:]
    row = {m: re.search(rf"\b{m}\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out).groups()
           for m in ("sync_each_batch", "no_sync")}  # windows, s/step, all-reduces/step, speedup
    assert int(row["no_sync"][0]) == int(row["sync_each_batch"][0]) == 3, row
    buckets = float(row["no_sync"][2])
    assert buckets >= 1 and buckets == int(buckets), row
    assert float(row["sync_each_batch"][2]) == 8 * buckets, row
    assert re.search(r"no_sync speedup: [\d.]+x", out)
    assert "verdict: tokens (--loss_normalization tokens) PASSES" in out
    assert re.search(r"effective batch size\s+256", out), out[-2000:]  # 8 x 4 x 8 processes (2 nodes x 4 GPUs)
