"""A sharded (FSDP2) checkpoint is opened as data before a resume builds anything: a pickle planted in its
``.metadata`` or in an item of its ``.distcp`` files never runs.

torch's own reader would run it: ``FileSystemReader.read_metadata`` is a plain ``pickle.load`` and the byte
items go through ``torch.load(weights_only=False)``. Uses the checkpoint ``step_4`` of conftest.py's
``fsdp_reference`` (the FSDP2 train job, 2 processes) and one command on the shared ``fsdp_pool``; the
planting is tests/planted.py's. The same table for DDP, HSDP and ZeRO checkpoints is in test_checkpoint_job.py,
test_hsdp.py and test_deepspeed.py.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

import job_helpers as jh
import planted

SHARDED = {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "pytorch_model_fsdp_0/*.distcp tensor item",
           "optimizer_0/*.distcp tensor item", "optimizer_0/*.distcp bytes item"}


@pytest.fixture(scope="module")
def reference(fsdp_reference) -> Path:
    res = fsdp_reference.result()
    assert res.returncode == 0, res.describe()
    return fsdp_reference.output_dir / f"step_{jh.FSDP_REFERENCE_EVERY}"


def _tree(root: Path) -> list:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def test_the_restricted_unpickler_reads_real_metadata_as_pickle_does(reference):
    """Both ``.metadata`` files of a real FSDP2 checkpoint come back through the restricted unpickler equal to
    what plain ``pickle.load`` (torch's reader) makes of them: the allowed classes are all a real file needs."""
    from accum_kit.compat.dcp_files import read_metadata

    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        path = reference / folder / ".metadata"
        ours, torchs = read_metadata(path), pickle.loads(path.read_bytes())  # the test's own file: trusted
        assert ours.state_dict_metadata == torchs.state_dict_metadata and ours.planner_data == torchs.planner_data
        assert ours.storage_data == torchs.storage_data and len(ours.storage_data) > 0


def test_a_planted_pickle_in_each_kind_of_file_of_an_fsdp2_checkpoint_is_refused(reference, tmp_path):
    """Each kind of file (both ``.metadata``, a byte item and a tensor item of the ``.distcp`` files, the
    scheduler, RNG and data-RNG files) planted in turn: refused by name, the command never runs."""
    table = planted.refused_each_kind(reference, tmp_path)
    assert SHARDED <= set(table), sorted(table)
    planted.assert_each_refused(table)
    bytes_row = table["optimizer_0/*.distcp bytes item"]
    assert bytes_row["file"].suffix == ".distcp" and "optimizer.param_groups" in bytes_row["error"].problem


def test_resuming_from_a_planted_metadata_exits_2_on_every_process_and_runs_nothing(reference, fsdp_reference,
                                                                                      fsdp_pool, tmp_path):
    """The reported case, through the train job on 2 FSDP2 processes: ``pytorch_model_fsdp_0/.metadata``
    replaced by a pickle that runs a shell command; ``--resume_from_checkpoint`` on it. One error line per
    process naming the file and the fix, exit 2, no traceback, the command never ran, nothing written."""
    ckpt, marker, out = tmp_path / "saved" / reference.name, tmp_path / "planted_ran", tmp_path / "out"
    shutil.copytree(reference, ckpt)
    planted.plant_file(ckpt / "pytorch_model_fsdp_0" / ".metadata", marker)
    before = _tree(ckpt.parent)
    argv = jh.fsdp_job_argv(fsdp_reference.corpus, out, "--resume_from_checkpoint", ckpt)[3:]
    res = fsdp_pool.submit("train", argv, datasets_cache=fsdp_reference.datasets_cache).result()
    assert res.returncode == 2, res.describe()
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    path = ckpt / "pytorch_model_fsdp_0" / ".metadata"
    assert len(errors) == 2, res.describe()  # one per process
    assert all(e.startswith(f"error: --resume_from_checkpoint: {path} cannot be loaded (not torch.distributed."
                            "checkpoint's metadata") and ". Fix: " in e for e in errors), errors
    assert "Traceback" not in res.stderr, res.describe()
    assert not marker.exists()
    assert _tree(ckpt.parent) == before and not out.exists()
