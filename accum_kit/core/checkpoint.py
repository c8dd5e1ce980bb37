"""Exact checkpoint and resume at window boundaries, atomic checkpoint folders, and preemption.

A checkpoint is written only right after an optimizer step, when ``zero_grad``
has emptied the gradients: Accelerate's ``save_state`` does not save ``.grad``,
so a checkpoint inside a window would lose the window's first micro-batches
and the resumed window would under-weight them. (transformers' Trainer also
checkpoints only at optimizer steps and drops a partial window on resume:
https://github.com/huggingface/transformers/issues/22143.)

Folder ``<output_dir>/step_<N>`` (N optimizer steps done) or ``epoch_<E>``
(epoch E, 0-based, done), the names of transformers'
``examples/pytorch/language-modeling/run_clm_no_trainer.py``, holding:

- what ``accelerator.save_state`` writes: model, optimizer, scheduler,
  GradScaler, and per process the RNG states and Accelerate's micro-batch counter;
- ``loop_state.json`` (main process): optimizer steps, the data position
  (epoch and micro-batches done in it, per process), and K, world size,
  per-device batch and batches per epoch, which a resume must match;
- ``history/`` (main process): the per-step loss, token, seconds and K
  history in chunks, the earlier ones hard-linked from the previous
  checkpoint, so that a save's cost does not grow with the step count
  (:mod:`accum_kit.core.loop_history`);
- ``data_rng_<rank>.pt`` (every process): the global torch RNG and the
  shuffling generators as they were when the current epoch began, so that
  the resumed epoch draws the same order before the consumed batches are skipped;
- ``checkpoint_complete``: the marker, written last.

Atomicity: everything is written into ``.<name>.incomplete`` in the same
folder, and after a barrier the main process adds the marker and renames the
folder (one ``rename``). A crash mid-save leaves the previous checkpoints and
``latest`` as they were. ``latest`` is the complete checkpoint with the most
optimizer steps.

Durability: before the marker is written, every process ``fsync``s the files
in the folder and the folder itself; the marker is synced, then the folder
is renamed and its parent directory synced. A checkpoint marked complete
therefore survives a power loss or a lost machine, not only a crashed
process (Accelerate's ``save_state`` alone does not sync). The cost is
logged with each save and kept in :attr:`Checkpointer.timings`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import torch
from accelerate.logging import get_logger

from .callbacks import LoopCallback
from ..engines.checkpoint_tag import check_engine, engine_name  # noqa: F401 (re-exported)
from .checkpoint_files import check_checkpoint_files, check_state_files
from .data_cursor import DataCursor, rng_snapshot
from ..errors import UsageError
from .loop_history import HistoryWriter, read_history
from ..outputs import atomic_write_json, fsync_dir, fsync_tree
from .accumulation_schedule import accumulation_steps_at
from .auto_batch import in_resplit_units, resplit_factor

logger = get_logger("accum_kit.core.checkpoint")

LOOP_STATE = "loop_state.json"
COMPLETE = "checkpoint_complete"
NAME = re.compile(r"^(step|epoch)_(\d+)$")
FORMAT = 2  # 1: the history inline in loop_state.json (still read); 2: in history/ chunks

#: Exit code of a job stopped by a preemption signal after saving (EX_TEMPFAIL of sysexits.h: "try again later").
PREEMPTED_EXIT_CODE = 75

#: Test hook: with this environment variable set to a checkpoint name, every process exits (code 3)
#: after that checkpoint's files are written and before it is marked complete and renamed.
CRASH_HOOK = "ACCUM_KIT_TEST_CRASH_BEFORE_RENAME"


class Preempted(Exception):
    """Raised by :func:`accum_kit.train_loop` on every process after a signal, once ``step_<N>`` is saved.

    Attributes:
        step: optimizer steps done (and saved). path: the checkpoint folder.
        signal_name: e.g. ``"SIGTERM"``.
    """

    def __init__(self, step: int, path: Path, signal_name: str):
        self.step, self.path, self.signal_name = step, path, signal_name
        super().__init__(f"stopped by {signal_name} after optimizer step {step}; saved {path}")


# --------------------------------------------------------------------------- finding checkpoints


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / COMPLETE).is_file() and (Path(path) / LOOP_STATE).is_file()


def read_loop_state(path: str | os.PathLike) -> dict:
    """The checkpoint's ``loop_state.json``.

    Raises:
        UsageError: the file is not valid JSON (corrupt or edited), naming it.
    """
    file = Path(path) / LOOP_STATE
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError("--resume_from_checkpoint", f"{file} cannot be read ({exc}): the checkpoint is corrupt",
                         "resume from another checkpoint, or delete this folder so 'latest' skips it") from None


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete ``step_<N>`` / ``epoch_<E>`` folders in ``output_dir``, oldest first (by optimizer steps, then mtime)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and NAME.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: (read_loop_state(p)["optimizer_steps"], (p / COMPLETE).stat().st_mtime))


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``output_dir`` (most optimizer steps), or None."""
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def resolve_checkpoint(value: str, output_dir: str | os.PathLike) -> Path:
    """``--resume_from_checkpoint`` value (a folder or ``latest``) -> a complete checkpoint folder.

    Raises:
        UsageError: ``latest`` with no complete checkpoint in ``output_dir``; a
            missing folder; a folder without the completion marker.
    """
    flag = "--resume_from_checkpoint"
    if value == "latest":
        found = latest_checkpoint(output_dir)
        if found is None:
            raise UsageError(flag, f"'latest' found no complete checkpoint in --output_dir {output_dir}",
                             "train without --resume_from_checkpoint to start afresh, or pass a checkpoint folder")
        return found
    path = Path(value)
    if not path.is_dir():
        raise UsageError(flag, f"{value} is not a checkpoint folder (it does not exist)",
                         "pass a step_<N> or epoch_<E> folder, or 'latest'")
    if not is_complete(path):
        raise UsageError(flag, f"{value} is incomplete (no {COMPLETE} marker: its save was interrupted)",
                         "pass an earlier checkpoint, or 'latest' (the newest complete one)")
    return path


def check_resumable(path, *, gradient_accumulation_steps: int, world_size: int, per_device_batch_size: int | None,
                    batches_per_epoch: int | None = None, accumulation_schedule=None, engine: str | None = None,
                    resplit: bool = False, examples_per_epoch: int | None = None) -> dict:
    """The checkpoint's loop state, after checking that this run would read the same examples.

    With ``accumulation_schedule`` (``{step: K}``) the K compared is the schedule's K at the saved step.
    With ``resplit`` (``--auto_find_batch_size``) a checkpoint whose micro-batch is p times this run's and whose K
    is this run's / p is accepted too (the same windows, :mod:`accum_kit.core.auto_batch`): the returned state then
    has ``"resplit": p`` (else 1), and batches per epoch are compared through ``examples_per_epoch`` instead.

    Raises:
        UsageError: another engine or ZeRO stage (``engine``, :func:`check_engine`);
            K, world size, per-device batch size or batches per epoch
            differ from the checkpoint's (the saved data position would point at
            other examples); the message names the flag to change. A file of the
            checkpoint cannot be loaded (corrupt, or a pickle that is not a torch
            state): :func:`accum_kit.core.checkpoint_files.check_checkpoint_files`.
    """
    check_checkpoint_files(path)
    saved = read_loop_state(path)
    if engine is not None:
        check_engine(path, saved, engine)
    k_flag = "--gradient_accumulation_steps"
    if accumulation_schedule is not None:
        k_flag, gradient_accumulation_steps = "--accumulation_schedule", accumulation_steps_at(
            accumulation_schedule, saved["optimizer_steps"])
    saved["resplit"] = p = resplit_factor(path, saved, gradient_accumulation_steps, per_device_batch_size,
                                          examples_per_epoch) if resplit else 1
    if p > 1:  # compare in the checkpoint's units; its batches per epoch count other micro-batches
        gradient_accumulation_steps, per_device_batch_size, batches_per_epoch = (
            gradient_accumulation_steps // p, per_device_batch_size * p, None)
    checks = [
        (k_flag, "gradient_accumulation_steps", gradient_accumulation_steps),
        ("--per_device_train_batch_size", "per_device_batch_size", per_device_batch_size),
        ("--num_processes", "world_size", world_size),
        ("--train_file", "batches_per_epoch", batches_per_epoch),
    ]
    for flag, key, now in checks:
        if now is not None and saved.get(key) is not None and saved[key] != now:
            what = key.replace("_", " ")
            fix = (f"resume with {flag} {saved[key]}" if key != "batches_per_epoch"
                   else "resume with the same data flags (--train_file/--dataset_name, --max_train_samples, --block_size)")
            if flag == "--accumulation_schedule":
                fix = f"resume with a schedule whose K after step {saved['optimizer_steps']} is {saved[key]}"
            if key == "world_size":
                fix = f"launch {saved[key]} processes (accelerate launch --num_processes {saved[key]})"
            raise UsageError(flag, f"{path} was saved with {what} {saved[key]} but this run has {now}, so its data "
                                   "position would no longer mean the same examples", fix)
    return saved


def check_writable(output_dir: str | os.PathLike, flag: str = "--output_dir") -> None:
    """Fail unless a file can really be created in ``output_dir`` (or its nearest existing parent).

    ``os.access`` says yes to root everywhere; creating (and deleting) a
    temporary file does not, e.g. under ``/sys``. Leaves nothing behind.

    Raises:
        UsageError: the folder, or its nearest existing parent, does not accept files.
    """
    path = Path(output_dir).absolute()
    parent = next(p for p in (path, *path.parents) if p.exists())
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".accum_kit_probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(flag, f"cannot write in {parent} ({exc.strerror})", "pass a writable location") from None


# --------------------------------------------------------------------------- saving and loading


def loop_state(accelerator, cursor: DataCursor, result, micro_batches: int) -> dict:
    """The loop's own state at a window boundary (JSON-ready); a finished epoch becomes (next epoch, 0)."""
    epoch, position = (cursor.epoch + 1, 0) if cursor.epoch_done else (cursor.epoch, cursor.position)
    dl = cursor.dataloader
    total = getattr(dl, "total_batch_size", None)
    batch = total // accelerator.num_processes if total else getattr(dl, "batch_size", None)
    return {"format": FORMAT, "optimizer_steps": result.optimizer_steps, "epoch": epoch,
            "batches_done_in_epoch": position, "micro_batches": micro_batches,
            "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
            "world_size": accelerator.num_processes, "per_device_batch_size": batch, "engine": engine_name(accelerator),
            "batches_per_epoch": cursor.batches_per_epoch, "accumulation_schedule": result.accumulation_schedule,
            "examples_per_epoch": cursor.examples_per_epoch}


def save_checkpoint(accelerator, output_dir, name: str, state: dict, data_rng: dict,
                    total_limit: int | None = None, timings: list | None = None, history=None) -> Path:
    """Write checkpoint ``output_dir/name`` atomically; collective (call on every process).

    Args:
        state: :func:`loop_state` (written by the main process).
        data_rng: this process's RNG snapshot from the start of the data position's epoch.
        total_limit: keep at most this many complete checkpoints; the oldest
            are deleted only after the new one is complete.
        history: ``(folder, final) -> dict``, writing the per-step history into the folder
            being saved (main process; :meth:`accum_kit.core.loop_history.HistoryWriter.write`); the
            dict goes into the loop state as ``history``.
        timings: if given, the main process appends ``{"name", "seconds" (the whole save),
            "fsync_seconds" (from the end of writing: syncing files, marker and folders, the
            barriers around it, the renames and the deletion of replaced or stale checkpoints),
            "bytes"}``.

    Returns:
        The final folder. Seconds and bytes are logged on the main process.
    """
    t0 = time.perf_counter()
    root = Path(output_dir)
    final, tmp = root / name, root / f".{name}.incomplete"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # the leftover of an earlier crash
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)  # model, optimizer, scheduler by the main process; RNG files by each
    torch.save(data_rng, tmp / f"data_rng_{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        if history is not None:
            state = {**state, "history": history(tmp, final)}
        atomic_write_json(tmp / LOOP_STATE, state)
    if os.environ.get(CRASH_HOOK) == name:
        os._exit(3)
    t_sync = time.perf_counter()
    accelerator.wait_for_everyone()  # every process's files are written ...
    size = fsync_tree(tmp)  # ... and on the disk, before anything says they are complete
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_synced(tmp / COMPLETE, json.dumps({"optimizer_steps": state["optimizer_steps"]}) + "\n")
        fsync_dir(tmp)  # the marker's name, not only its bytes
        old = root / f".{name}.replaced"
        if final.exists():  # same name from an earlier run: swap, then delete the old one
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(root)  # the new checkpoint survives a power loss before anything older is deleted
        shutil.rmtree(old, ignore_errors=True)
        if total_limit:
            for stale in complete_checkpoints(root)[:-total_limit]:
                if stale != final:
                    shutil.rmtree(stale)
        fsync_dir(root)  # and the deletions
        seconds, sync_seconds = time.perf_counter() - t0, time.perf_counter() - t_sync
        logger.info("saved checkpoint %s (%.1f MB, %.2f s, of which fsync and barriers %.2f s)", final, size / 1e6,
                    seconds, sync_seconds)
        if timings is not None:
            timings.append({"name": name, "seconds": seconds, "fsync_seconds": sync_seconds, "bytes": size})
    accelerator.wait_for_everyone()
    return final


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def load_checkpoint(accelerator, path, cursor: DataCursor, accumulation_schedule=None, resplit: bool = False) -> dict:
    """``load_state`` from a checkpoint and point ``cursor`` at its data position; return its loop state.

    Call on every process, after ``accelerator.prepare`` of the same objects in
    the same order as in the saved run. Checks compatibility first
    (:func:`check_resumable`; under ``accumulation_schedule`` against its K at the saved step).
    With ``resplit`` (``--auto_find_batch_size``) a checkpoint of p times this run's micro-batch and K / p is
    resumed too: its micro-batch counts (data position, micro-batches done, the per-step K history) are
    multiplied by p, so they count this run's micro-batches, which cover the same examples.
    """
    t0 = time.perf_counter()
    dl = cursor.dataloader
    total = getattr(dl, "total_batch_size", None)
    saved = check_resumable(path, gradient_accumulation_steps=accelerator.gradient_accumulation_steps,
                            world_size=accelerator.num_processes,
                            per_device_batch_size=total // accelerator.num_processes if total else None,
                            batches_per_epoch=cursor.batches_per_epoch, accumulation_schedule=accumulation_schedule,
                            engine=engine_name(accelerator), resplit=resplit,
                            examples_per_epoch=cursor.examples_per_epoch)
    if "history" in saved:  # format 2: the per-step lists in chunks
        history = read_history(path)
        if len(history["train_loss"]) != saved["history"]["steps"]:
            raise UsageError("--resume_from_checkpoint", f"{path}/history holds {len(history['train_loss'])} steps "
                             f"but the checkpoint has {saved['history']['steps']}: it is incomplete",
                             "resume from another checkpoint")
        saved.update(history)
    in_resplit_units(saved)  # micro-batch counts x p (--auto_find_batch_size), else unchanged
    from ..compat import restored_state_objects

    check_state_files(path, *restored_state_objects(accelerator))  # one line where load_state would raise
    accelerator.load_state(str(path))
    rng_now = torch.get_rng_state()
    epoch_rng = torch.load(Path(path) / f"data_rng_{accelerator.process_index}.pt", weights_only=True)
    cursor.resume_at(saved["epoch"], saved["batches_done_in_epoch"], epoch_rng, rng_now)
    logger.info("resumed from %s: %d optimizer steps done, epoch %d, %d micro-batches into it (%.2f s)",
                path, saved["optimizer_steps"], saved["epoch"], saved["batches_done_in_epoch"],
                time.perf_counter() - t0)
    return saved


# --------------------------------------------------------------------------- the callback


class Checkpointer(LoopCallback):
    """Saves checkpoints at window boundaries and turns a preemption signal into a saved stop.

    Pass it as ``train_loop(..., checkpointer=Checkpointer(...))``.

    Args:
        accelerator: the Accelerator of the loop.
        output_dir: folder of the ``step_<N>`` / ``epoch_<E>`` checkpoints.
        checkpointing_steps: an int N (every N optimizer steps), ``"epoch"``
            (after every epoch), or None (only on a signal).
        total_limit: keep at most this many complete checkpoints (oldest deleted after the newest is complete).
        signals: signals that mean "save and stop" (default SIGTERM, which
            torchrun forwards to every worker, and SIGUSR1, which SLURM sends
            before the time limit with ``--signal``). The handler only sets a
            flag; at the next window boundary every process learns whether any
            process got one (one 1-element all-reduce per optimizer step), all
            save ``step_<N>``, and :class:`Preempted` is raised. Pass ``()`` to
            leave signals alone.
        resplit: resume a checkpoint of a larger micro-batch re-split (:func:`load_checkpoint`).
        metadata: JSON-ready keys written into every checkpoint's ``loop_state.json`` beside the loop's own (the
            train job records its adapter there, :func:`accum_kit.job.adapters.adapter_record`); read back with
            :func:`read_loop_state` / :func:`check_resumable`.
    """

    def __init__(self, accelerator, output_dir, checkpointing_steps: int | str | None = None,
                 total_limit: int | None = None, signals=(signal.SIGTERM, signal.SIGUSR1), resplit: bool = False,
                 metadata: dict | None = None):
        if checkpointing_steps not in (None, "epoch") and not (isinstance(checkpointing_steps, int) and checkpointing_steps >= 1):
            raise UsageError("--checkpointing_steps", f"must be a positive integer or 'epoch' (got {checkpointing_steps!r})",
                             "pass e.g. 100 or epoch")
        self.accelerator, self.output_dir = accelerator, Path(output_dir)
        self.every, self.total_limit, self.signals = checkpointing_steps, total_limit, tuple(signals)
        self.resplit = resplit  # a resume may re-split the micro-batch (--auto_find_batch_size; load_checkpoint)
        self.metadata = dict(metadata or {})  # the caller's own keys in loop_state.json (the train job: its adapter)
        self.saved: list[Path] = []
        self.timings: list[dict] = []  # per save on the main process, see save_checkpoint
        self._cursor = self._result = None
        self._received = 0
        self._previous: dict = {}
        self._history = HistoryWriter()

    def attach(self, cursor: DataCursor, result) -> None:
        """Called by ``train_loop``: where the data stands and the history so far."""
        self._cursor, self._result = cursor, result

    def _on_signal(self, signum, frame):  # only sets a flag: the loop acts at the next window boundary
        self._received = signum

    def on_train_begin(self, state):
        if self._cursor is None:
            raise TypeError("pass the Checkpointer as train_loop(..., checkpointer=...), not in callbacks")
        if self.signals and threading.current_thread() is not threading.main_thread():
            logger.warning("training runs outside the main thread: signals are not handled (Python allows it there only)")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def close(self) -> None:
        """Restore the signal handlers that were there before (train_loop calls it on the way out)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _stop_requested(self) -> bool:
        if not self.signals:
            return False
        flag = torch.tensor([1.0 if self._received else 0.0], device=self.accelerator.device)
        return self.accelerator.reduce(flag, reduction="sum").item() > 0

    def save(self, name: str, micro_batches: int) -> Path:
        """Save checkpoint ``name`` now (collective; at a window boundary only)."""
        state = {**loop_state(self.accelerator, self._cursor, self._result, micro_batches), **self.metadata}
        rng = self._cursor.epoch_rng if not self._cursor.epoch_done else rng_snapshot(self._cursor.dataloader)
        path = save_checkpoint(self.accelerator, self.output_dir, name, state, rng, self.total_limit, self.timings,
                               history=lambda folder, final: self._history.write(folder, self._result, final))
        self.saved.append(path)
        return path

    def on_step_end(self, state):
        stop = self._stop_requested()
        names = []
        if isinstance(self.every, int) and state.step % self.every == 0:
            names.append(f"step_{state.step}")
        if self.every == "epoch" and self._cursor.epoch_done:
            names.append(f"epoch_{self._cursor.epoch}")
        if stop and not names:
            names.append(f"step_{state.step}")
        for name in names:
            self.save(name, state.micro_step)
        if stop:
            sig = signal.Signals(self._received).name if self._received else "a signal on another process"
            logger.warning("%s: saved %s at optimizer step %d; stopping (resume with --resume_from_checkpoint latest)",
                           sig, self.saved[-1], state.step)
            raise Preempted(state.step, self.saved[-1], sig)
