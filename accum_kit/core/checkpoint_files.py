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

Cost: safetensors and zip-format torch files are read without their tensor data
(the header; ``torch.load(..., mmap=True)`` maps the storages without reading
them), so the check takes milliseconds whatever the model's size. FSDP2's
sharded files (``torch.distributed.checkpoint``: ``*.distcp`` and ``.metadata``)
are left to their reader.
"""

from __future__ import annotations

import json
import pickle
import warnings
import zipfile
from pathlib import Path

from ..errors import UsageError

FLAG = "--resume_from_checkpoint"
#: Suffixes of the files read by torch's (weights-only) unpickler on resume.
PICKLED = (".bin", ".pt", ".pth", ".pkl")


def _check_one(path: Path) -> str | None:
    """Why ``path`` cannot be loaded as its suffix says, or None when it can."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                f.keys()
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix in PICKLED:
            from accelerate.utils.other import load  # torch.load, weights only, with the numpy types of RNG states

            mmap = zipfile.is_zipfile(path)  # torch.save's format: map the storages, read only the pickle
            import torch

            from ..compat import deepspeed_checkpoint_globals

            with warnings.catch_warnings(), torch.serialization.safe_globals(deepspeed_checkpoint_globals()):
                warnings.simplefilter("ignore")  # a foreign pickle's protocol warning: the error below says it all
                load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        return "not a torch state: torch's weights-only unpickler refused it, and nothing in it was run"
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the user's corrupt file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"{type(exc).__name__}: {first[:200]}"
    return None


def check_checkpoint_files(folder) -> None:
    """Open every file of checkpoint ``folder`` as the resume will; fail on the first that cannot be read.

    Raises:
        UsageError: naming ``--resume_from_checkpoint``, the file and why it
            cannot be loaded (a pickle that is not a torch state, a truncated
            or corrupt file), and the fix: another checkpoint or a restored copy.
    """
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        why = _check_one(path)
        if why is not None:
            raise UsageError(FLAG, f"{path} cannot be loaded ({why}): the checkpoint is corrupt or was tampered "
                                   "with, and nothing was loaded from it",
                             "resume from another checkpoint (an earlier step_<N> folder), or restore the file "
                             "from a backup of the same checkpoint")
