"""Planted pickles: a checkpoint copied with one file (or one item of a sharded file) replaced by a pickle that
would run a shell command if it were unpickled without a guard (not a test module: pytest does not collect it).

The command only creates a marker file, so a test sees whether anything ran. :func:`kinds` names one file of
each kind a checkpoint holds; :func:`refused_each_kind` plants one at a time into copies of a saved checkpoint
and runs the pre-check of a resume (``accum_kit.core.checkpoint_files.check_checkpoint_files``) on each.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
from pathlib import Path


class Planted:
    """Unpickled without a guard, runs ``touch <marker>`` (``os.system``: a shell command, as an attacker would)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_file(path: Path, marker: Path) -> None:
    """Replace ``path`` by a plain pickle holding a :class:`Planted`."""
    path.write_bytes(pickle.dumps({"state": Planted(marker)}))


def plant_dcp_item(folder: Path, marker: Path, item: str) -> tuple[Path, str]:
    """In a ``torch.distributed.checkpoint`` folder: append a ``torch.save``'d :class:`Planted` to the ``.distcp``
    file of the first item of kind ``item`` (``"bytes"`` or ``"tensor"``) and point that item's entry in
    ``.metadata`` at it (file, offset, length), as an attacker who rewrites both would. Returns the ``.distcp``
    file and the item's key."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = pickle.loads((folder / ".metadata").read_bytes())  # the test's own saved file
    want = BytesStorageMetadata if item == "bytes" else TensorStorageMetadata
    index, info = next((i, s) for i, s in sorted(metadata.storage_data.items(), key=lambda kv: kv[0].fqn)
                       if isinstance(metadata.state_dict_metadata[i.fqn], want))
    payload = io.BytesIO()
    torch.save({"state": Planted(marker)}, payload)
    target = folder / info.relative_path
    info.offset, info.length = target.stat().st_size, len(payload.getvalue())
    with open(target, "ab") as f:
        f.write(payload.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return target, index.fqn


def kinds(checkpoint: Path) -> dict[str, str]:
    """``{kind: file relative to checkpoint}``: one file of every kind it holds that a resume unpickles (DCP's
    ``<folder>/.metadata``, ``<folder>/.distcp bytes`` / ``tensor`` items, torch and pickle files by name)."""
    found: dict[str, str] = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        rel = str(path.relative_to(checkpoint))
        if path.name == ".metadata":
            from torch.distributed.checkpoint.metadata import BytesStorageMetadata

            found[rel] = rel
            metadata = pickle.loads(path.read_bytes())  # the test's own saved file
            for item in {"bytes" if isinstance(m, BytesStorageMetadata) else "tensor"
                         for m in metadata.state_dict_metadata.values()}:
                found[f"{path.parent.name}/*.distcp {item} item"] = rel
        elif path.suffix in (".bin", ".pt", ".pkl"):
            found.setdefault(re.sub(r"\d+", "<n>", path.name), rel)  # one per kind, not one per rank
    return found


def refused_each_kind(checkpoint: Path, work: Path) -> dict[str, dict]:
    """For each of :func:`kinds`: plant into a fresh copy of ``checkpoint`` under ``work``, run the pre-check.
    Returns ``{kind: {"file": planted file, "error": the UsageError or None, "ran": marker exists}}``."""
    from accum_kit import UsageError
    from accum_kit.core.checkpoint_files import check_checkpoint_files

    table = {}
    for n, (kind, rel) in enumerate(kinds(checkpoint).items()):
        copy, marker = work / f"planted_{n}" / checkpoint.name, work / f"planted_{n}.ran"
        shutil.copytree(checkpoint, copy)
        if kind.endswith(" item"):
            target, _ = plant_dcp_item((copy / rel).parent, marker, kind.split()[-2])
        else:
            target = copy / rel
            plant_file(target, marker)
        try:
            check_checkpoint_files(copy)
            error = None
        except UsageError as exc:
            error = exc
        table[kind] = {"file": target, "error": error, "ran": marker.exists()}
        shutil.rmtree(copy.parent)
    return table


def assert_each_refused(table: dict[str, dict]) -> None:
    """Every planted kind refused by a UsageError that names ``--resume_from_checkpoint``, the planted file and
    that nothing in it ran, with a fix; no marker."""
    assert table, "no file to plant into"
    for kind, row in table.items():  # the figures, printed under -s
        print(f"\nplanted {kind}: ran {row['ran']}; {row['error'] or 'accepted'}"[:220])
    for kind, row in table.items():
        err = row["error"]
        assert err is not None, f"{kind}: the pre-check accepted a planted pickle"
        assert err.flag == "--resume_from_checkpoint" and f"{row['file']} cannot be loaded" in err.problem, (kind, err)
        assert "nothing in it was run" in err.problem and err.fix, (kind, err)
        assert not row["ran"], f"{kind}: the planted command ran"
