"""A checkpoint's files checked before anything is loaded or written: a corrupt or tampered file is refused by name.

Accelerate's ``load_state`` reads pickled files (optimizer, scheduler, RNG
states) with torch's weights-only unpickler (``accelerate.utils.other.load``,
which also allows the numpy types of the RNG states), so a planted pickle is refused
without running, but deep inside the training run, with a raw traceback from
every process. :func:`check_checkpoint_files` opens every file the way the
resume will (pickles through the same weights-only unpickler, safetensors
through their header, JSON through the parser) before the run builds or writes
anything, and turns the first failure into a :class:`~accum_kit.errors.UsageError`
that names the file.

FSDP2's and HSDP's sharded files (``torch.distributed.checkpoint``: ``.metadata``
and ``*.distcp``), whose own reader unpickles ``.metadata`` and the byte items
without a guard, are opened as data too (:mod:`accum_kit.compat.dcp_files`):
``.metadata`` through an unpickler that allows only DCP's metadata classes, and
every item it places in a ``.distcp`` file through torch's weights-only unpickler.

Cost: safetensors and zip-format torch files are read without their tensor data
(the header; ``torch.load(..., mmap=True)`` maps the storages without reading
them; a ``.distcp`` tensor item is loaded onto the meta device), so the check
takes milliseconds whatever the model's size.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
import zipfile
from pathlib import Path

from ..errors import UsageError

FLAG = "--resume_from_checkpoint"
#: Suffixes of the files read by torch's (weights-only) unpickler on resume.
PICKLED = (".bin", ".pt", ".pth", ".pkl")
#: torch.distributed.checkpoint's metadata file (its ``*.distcp`` files are checked through it)
METADATA = ".metadata"


def _check_one(path: Path) -> str | None:
    """Why ``path`` cannot be loaded as its suffix says, or None when it can."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                f.keys()
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.name == METADATA:  # torch.distributed.checkpoint's: the metadata, then each item it places
            from ..compat.dcp_files import read_metadata

            read_metadata(path)
        elif path.suffix in PICKLED:
            from accelerate.utils.other import load  # torch.load, weights only, with the numpy types of RNG states

            mmap = zipfile.is_zipfile(path)  # torch.save's format: map the storages, read only the pickle
            import torch

            from ..compat import deepspeed_checkpoint_globals

            with warnings.catch_warnings(), torch.serialization.safe_globals(deepspeed_checkpoint_globals()):
                warnings.simplefilter("ignore")  # a foreign pickle's protocol warning: the error below says it all
                load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if path.name == METADATA:  # exc names the global it refused
            return (f"not torch.distributed.checkpoint's metadata: {str(exc)[:200]}; an unpickler that allows only "
                    "the metadata's classes refused it, and nothing in it was run")
        return "not a torch state: torch's weights-only unpickler refused it, and nothing in it was run"
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the user's corrupt file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"{type(exc).__name__}: {first[:200]}"
    return None


def check_checkpoint_files(folder) -> None:
    """Open every file of checkpoint ``folder`` as data (never running anything in it); fail on the first that
    cannot be read.

    Pickled files through torch's weights-only unpickler; a ``torch.distributed.checkpoint`` ``.metadata``
    through :class:`accum_kit.compat.dcp_files.MetadataUnpickler`, then every item it places in the folder's
    ``.distcp`` files (:func:`accum_kit.compat.dcp_files.check_items`); safetensors' header; JSON.

    Raises:
        UsageError: naming ``--resume_from_checkpoint``, the file and why it
            cannot be loaded (a pickle that is not a torch state or not DCP's
            metadata, a ``.distcp`` item that cannot be read or a ``.distcp``
            without its ``.metadata``, a truncated or corrupt file), and the
            fix: another checkpoint or a restored copy.
    """
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        why = _check_one(path)
        if why is None and path.suffix == ".distcp" and not (path.parent / METADATA).is_file():
            why = f"its folder has no {METADATA}, without which torch.distributed.checkpoint cannot read it"
        if why is None and path.name == METADATA:  # the items it places in the folder's .distcp files
            from ..compat.dcp_files import check_items, read_metadata

            path, why = check_items(path.parent, read_metadata(path)) or (path, None)
        if why is not None:
            raise UsageError(FLAG, f"{path} cannot be loaded ({why}): the checkpoint is corrupt or was tampered "
                                   "with, and nothing was loaded from it",
                             "resume from another checkpoint (an earlier step_<N> folder), or restore the file "
                             "from a backup of the same checkpoint")


def check_state_files(folder, schedulers: int, custom_objects: int = 0) -> None:
    """Fail unless ``folder`` holds the files Accelerate's ``load_state`` will ask for beyond the model and
    optimizer: one ``scheduler.bin`` (``scheduler_<i>.bin`` after the first) per prepared scheduler, and as many
    ``custom_checkpoint_<i>.pkl`` as objects registered with ``register_for_checkpointing``.

    Without it ``load_state`` fails after the model and data are built, with a raw ``FileNotFoundError`` or
    ``RuntimeError`` from every process. A DeepSpeed checkpoint of an earlier accum-kit version kept the
    scheduler in ``custom_checkpoint_0.pkl`` and has no ``scheduler.bin`` (docs/deepspeed.md, Checkpoints).

    Args:
        schedulers: schedulers ``load_state`` will restore (the train job: 1).
        custom_objects: objects registered for checkpointing (the train job: none).

    Raises:
        UsageError: naming ``--resume_from_checkpoint``, the missing or extra file and the fix.
    """
    root = Path(folder)
    customs = sorted(p.name for p in root.iterdir() if re.fullmatch(r"custom_checkpoint_\d+\.pkl", p.name))
    names = ["scheduler.bin" if i == 0 else f"scheduler_{i}.bin" for i in range(schedulers)]
    missing = [name for name in names if not (root / name).is_file()]
    if missing:
        old = (f"; it holds {', '.join(customs)} instead, as DeepSpeed checkpoints of earlier accum-kit versions "
               "did" if customs else "")
        raise UsageError(FLAG, f"{root} has no {missing[0]}: the learning-rate scheduler's state, which this run "
                               f"restores, was not saved in it{old}",
                         "resume from a checkpoint saved by this version of accum-kit with the same scheduler, or "
                         "start afresh without --resume_from_checkpoint")
    if len(customs) != custom_objects:
        raise UsageError(FLAG, f"{root} holds {len(customs)} custom_checkpoint_<i>.pkl file(s) but this run "
                               f"registers {custom_objects} object(s) for checkpointing, so Accelerate's load_state "
                               "cannot pair them", "resume from a checkpoint saved by the same script (the same "
                         "register_for_checkpointing calls), or start afresh without --resume_from_checkpoint")
