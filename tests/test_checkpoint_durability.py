"""A checkpoint marked complete survives a power loss: its files and folders reach the disk first.

A power loss cannot be staged in a test, so this checks the order of the
system calls that makes it safe (each file and directory ``fsync``ed before
the marker that publishes them is written, the marker synced before the
rename, the parent directory synced after it), recorded in-process around a
real :class:`accum_kit.checkpoint.Checkpointer` save of a prepared model.
"""

from __future__ import annotations

import os
from pathlib import Path

import job_helpers as jh
from accum_kit import train_loop
from accum_kit.checkpoint import COMPLETE, Checkpointer


def test_every_file_and_folder_is_synced_before_the_marker_and_the_rename(accelerator, tmp_path, monkeypatch):
    acc = accelerator(2)
    model, opt, dl = jh.prepared_tiny_lm(acc)
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", str(Path(src).absolute()), str(Path(dst).absolute())))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    ckpt = Checkpointer(acc, tmp_path / "ckpts", checkpointing_steps=1, signals=())
    train_loop(acc, model, opt, dl, max_train_steps=1, checkpointer=ckpt, progress=False)
    final = tmp_path / "ckpts" / "step_1"
    tmp = str(final.parent / ".step_1.incomplete")

    (i_rename,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[1] == tmp]
    synced_before = {e[1] for e in events[:i_rename] if e[0] == "fsync"}
    files = [p for p in final.rglob("*") if p.is_file()]
    assert len(files) >= 5, files  # model, optimizer, RNG states, loop state, marker
    for p in files:
        assert tmp + str(p)[len(str(final)):] in synced_before, f"{p.name} renamed into place before fsync"
    for d in [final, *(p for p in final.rglob("*") if p.is_dir())]:
        assert tmp + str(d)[len(str(final)):] in synced_before, f"folder {d} not synced"
    marker_sync = events.index(("fsync", f"{tmp}/{COMPLETE}"))
    assert all(events.index(("fsync", tmp + str(p)[len(str(final)):])) < marker_sync
               for p in files if p.name != COMPLETE), "a file was synced after the marker"
    assert ("fsync", str(final.parent)) in events[i_rename:], "the parent folder was not synced after the rename"
    assert ckpt.timings and ckpt.timings[0]["name"] == "step_1" and ckpt.timings[0]["bytes"] > 0
