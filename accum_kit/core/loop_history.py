"""The loop's per-step history in a checkpoint, in chunks, so that a save costs the same at step 100 and 100,000.

A checkpoint holds the history of every optimizer step so far (loss, target
tokens, seconds, K: :class:`accum_kit.core.loop.LoopResult`), which a resumed run
takes over. Written whole into ``loop_state.json`` at every save, it grows
with the step count, and so do the file and the save time. Here it is kept
in ``history/steps_<first>-<end>.json`` files instead, one per stretch
between two saves of a run (steps ``first`` to ``end - 1``, 0-based): a save
writes only the stretch since the previous save and hard-links the earlier
files from the previous checkpoint (a link costs the same whatever the
file's size, and the files never change once written). Where a link cannot
be made (the previous checkpoint is gone, another file system), the file is
written again from the history in memory. A checkpoint folder stays complete
on its own: copying it copies its files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..outputs import atomic_write_json

FOLDER = "history"
#: The per-step lists of :class:`accum_kit.core.loop.LoopResult` kept in the chunks.
KEYS = ("train_loss", "step_tokens", "step_seconds", "step_accumulation_steps")


def chunk_name(first: int, end: int) -> str:
    return f"steps_{first:09d}-{end:09d}.json"


class HistoryWriter:
    """Writes the history chunks of successive checkpoints of one run (main process only)."""

    def __init__(self):
        self._chunks: list[tuple[int, int, Path]] = []  # (first, end, file in the newest checkpoint written)

    def write(self, folder: Path, result, final: Path) -> dict:
        """Write ``result``'s history into ``folder/history``; returns ``{"folder", "steps", "chunks"}`` for the loop state.

        ``final`` is where ``folder`` will be renamed to once complete: the
        chunk paths remembered for the next save's links.
        """
        steps = result.optimizer_steps
        (folder / FOLDER).mkdir(parents=True, exist_ok=True)
        kept = [(a, b, p) for a, b, p in self._chunks if b <= steps]
        done = kept[-1][1] if kept else 0
        if done < steps:
            kept.append((done, steps, None))
        names = []
        for a, b, old in kept:
            name = chunk_name(a, b)
            target = folder / FOLDER / name
            if not _link(old, target):
                atomic_write_json(target, {"first_step": a, **{k: list(getattr(result, k)[a:b]) for k in KEYS}})
            names.append(name)
        self._chunks = [(a, b, final / FOLDER / chunk_name(a, b)) for a, b, _ in kept]
        return {"folder": FOLDER, "steps": steps, "chunks": len(names)}


def _link(old: Path | None, target: Path) -> bool:
    if old is None:
        return False
    try:
        os.link(old, target)
        return True
    except OSError:
        return False


def read_history(folder) -> dict:
    """The per-step lists (:data:`KEYS`) of checkpoint ``folder`` from its chunk files, in step order.

    Raises:
        ValueError: the chunks do not follow each other from step 0.
    """
    out = {k: [] for k in KEYS}
    for name in sorted(p.name for p in (Path(folder) / FOLDER).glob("steps_*.json")):
        chunk = json.loads((Path(folder) / FOLDER / name).read_text())
        if chunk["first_step"] != len(out["train_loss"]):
            raise ValueError(f"{folder}/{FOLDER}/{name} starts at step {chunk['first_step']}, "
                             f"after {len(out['train_loss'])} steps")
        for k in KEYS:
            out[k].extend(chunk[k])
    return out
