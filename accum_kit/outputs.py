"""Writing results atomically: a reader never sees a half-written file or directory."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import UsageError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_output_dir(output_dir: str, flag: str = "--output_dir") -> None:
    """Fail before any work if ``output_dir`` cannot become a directory.

    Raises:
        UsageError: it exists as a file, or its nearest existing parent is not writable.
    """
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise UsageError(flag, f"{output_dir} exists and is not a directory", "pass a directory path")
    parent = path if path.exists() else next(p for p in path.absolute().parents if p.exists())
    if not os.access(parent, os.W_OK):
        raise UsageError(flag, f"{parent} is not writable", "pass a writable location")


def fsync_dir(path: str | os.PathLike) -> None:
    """``fsync`` a directory, so that the entries created, renamed or deleted in it survive a power loss.

    POSIX leaves a new name durable only once its directory is synced (``fsync(2)``:
    "calling fsync() on the file descriptor for the directory is also needed").
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> int:
    """``fsync`` every regular file under ``path``, then every directory bottom-up; return the bytes synced.

    Used before a checkpoint is marked complete: the files then reach the disk
    before the marker and the rename that publish them (the order ext4's and
    XFS's documentation ask of an application that wants a crash-consistent
    replace-by-rename). ``fsync`` flushes the file's dirty pages whichever
    process wrote them, on this machine.
    """
    synced = 0
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            file = os.path.join(root, name)
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                synced += os.fstat(fd).st_size
            finally:
                os.close(fd)
        fsync_dir(root)
    return synced


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def library_versions() -> dict:
    """Versions of Python and the libraries whose behaviour the figures depend on."""
    import platform

    import accelerate
    import datasets
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "accelerate": accelerate.__version__,
            "transformers": transformers.__version__, "datasets": datasets.__version__}


@contextmanager
def staged_output_dir(output_dir: str | os.PathLike):
    """Yield a fresh staging directory; on success move its files into ``output_dir``.

    The staging directory is a sibling of ``output_dir`` (same file system, so
    every move is an atomic rename). On an exception inside the ``with`` block
    it is deleted and ``output_dir`` is left as it was. Into an existing
    ``output_dir`` the entries move one by one, each replacing its namesake.
    """
    output_dir = Path(output_dir).absolute()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=output_dir.parent, prefix=f".{output_dir.name}.staging-"))
    try:
        yield staging
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp creates 0700
        if not output_dir.exists():
            os.rename(staging, output_dir)
            return
        for item in sorted(staging.iterdir()):
            target = output_dir / item.name
            if target.is_dir():  # os.replace cannot overwrite a non-empty directory
                shutil.rmtree(target)
            os.replace(item, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
