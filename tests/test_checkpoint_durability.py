"""A checkpoint marked complete survives a power loss: its files and folders reach the disk first.

A power loss cannot be staged in a test, so this checks the order of the
system calls that makes it safe (each file and directory ``fsync``ed before
the marker that publishes them is written, the marker and its folder entry
synced before the rename, the parent directory synced after it and before an
older checkpoint is deleted), recorded in-process around real
:class:`accum_kit.core.checkpoint.Checkpointer` saves of a prepared model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import job_helpers as jh
from accum_kit import train_loop
from accum_kit.core.checkpoint import COMPLETE, Checkpointer


def test_every_file_and_folder_is_synced_before_the_marker_and_the_rename(accelerator, tmp_path, monkeypatch):
    acc = accelerator(2)
    model, opt, dl = jh.prepared_tiny_lm(acc)
    events = []
    real_fsync, real_rename, real_rmtree = os.fsync, os.rename, shutil.rmtree

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst):
        # what the folder holds when it is published (the history chunks differ from save to save)
        published = sorted((p.relative_to(src), p.is_dir()) for p in Path(src).rglob("*")) if Path(src).is_dir() else []
        events.append(("rename", str(Path(src).absolute()), str(Path(dst).absolute()), published))
        return real_rename(src, dst)

    def rmtree(path, *args, **kwargs):
        if Path(path).exists():
            events.append(("rmtree", str(Path(path).absolute())))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    # two saves, keeping one: step_2's save deletes step_1
    ckpt = Checkpointer(acc, tmp_path / "ckpts", checkpointing_steps=1, total_limit=1, signals=())
    train_loop(acc, model, opt, dl, max_train_steps=2, checkpointer=ckpt, progress=False)
    assert not (tmp_path / "ckpts" / "step_1").exists() and (tmp_path / "ckpts" / "step_2").exists()
    first = str(tmp_path / "ckpts" / "step_1")
    (i_delete,) = [i for i, e in enumerate(events) if e == ("rmtree", first)]
    (i_rename2,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(tmp_path / "ckpts" / "step_2")]
    assert ("fsync", str(tmp_path / "ckpts")) in events[i_rename2:i_delete], \
        "an older checkpoint was deleted before the new one's rename reached the disk"
    events = events[:i_rename2]  # the first save, checked in full below
    final = tmp_path / "ckpts" / "step_1"
    tmp = str(final.parent / ".step_1.incomplete")
    (i_rename,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[1] == tmp]
    published = events[i_rename][3]
    synced_before = {e[1] for e in events[:i_rename] if e[0] == "fsync"}
    files = [p for p, is_dir in published if not is_dir]
    assert len(files) >= 5, files  # model, optimizer, RNG states, loop state, history, marker
    for p in files:
        assert f"{tmp}/{p}" in synced_before, f"{p} renamed into place before fsync"
    for d in [Path("."), *(p for p, is_dir in published if is_dir)]:
        assert os.path.normpath(f"{tmp}/{d}") in synced_before, f"folder {d} not synced"
    marker_sync = events.index(("fsync", f"{tmp}/{COMPLETE}"))
    assert all(events.index(("fsync", f"{tmp}/{p}")) < marker_sync
               for p in files if p.name != COMPLETE), "a file was synced after the marker"
    assert ("fsync", tmp) in events[marker_sync:i_rename], "the marker's folder entry was not synced before the rename"
    assert ("fsync", str(final.parent)) in events[i_rename:], "the parent folder was not synced after the rename"
    assert ckpt.timings and ckpt.timings[0]["name"] == "step_1" and ckpt.timings[0]["bytes"] > 0
