"""Saying which collective failed, and on which rank, when a peer process stalls or dies.

When one worker of a multi-process job is stopped (``SIGSTOP``, a debugger, a
swapped-out host) or killed, the others fail inside whatever collective they
were in, with the transport's words only. Measured with torch 2.13 over gloo:

- a stalled peer: ``RuntimeError: [.../gloo/transport/tcp/unbound_buffer.cc:78]
  Timed out waiting 5000ms for recv operation to complete``, raised once the
  process group's timeout (``--ddp_timeout``; Accelerate's default 1800 s for
  gloo) has passed, both for a direct ``all_reduce`` and for the gradient
  all-reduce that DDP launches inside ``backward``;
- a dead peer: ``... pair.cc:537] Read error [127.0.0.1]:PORT: Connection reset
  by peer``, at once.

Neither names the collective nor the rank that raised it. :func:`describe_collective_failure`
reads that from the exception's traceback (the ``torch.distributed`` function
it was raised in, or autograd's backward for DDP's bucket all-reduce, and the
innermost caller outside library code: torch, Accelerate, any installed package such
as DeepSpeed, the standard library). :func:`install_collective_failure_hook`
prints it as one ``error:`` line in place of the uncaught exception's traceback
(which said nothing more: the transport's words and torch's frames; set
``ACCUM_KIT_TRACEBACK=1`` to have it printed after the line);
:func:`accum_kit.build_accelerator` installs it in multi-process runs.

What the job cannot change: ``accelerate launch`` itself re-raises torchrun's
``ChildFailedError`` (accelerate 1.15, ``multi_gpu_launcher``), so the launcher
process ends with its own traceback before torchrun's failure report; it runs
no accum-kit code.
"""

from __future__ import annotations

import os
import re
import sys
import traceback

# gloo's wording (third_party/gloo/gloo/transport/tcp/unbound_buffer.cc and pair.cc).
_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (?:send|recv) operation")
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")
_LIBRARIES = (f"{os.sep}torch{os.sep}", f"{os.sep}accelerate{os.sep}")
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # this package's folder


def _is_library(filename: str) -> bool:
    """Whether a frame's file is library code, never the caller to name: torch and Accelerate wherever they live,
    any installed package (``site-packages``, ``dist-packages``: DeepSpeed's collective wrappers, typing_extensions'
    ``deprecated`` wrapper around a torch collective), the standard library and frozen modules; this package's own
    files never are, even when installed."""
    import sysconfig

    if filename.startswith("<frozen "):
        return True
    path = os.path.abspath(filename)
    if path.startswith(_OWN):
        return False
    stdlib = tuple(os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))
    return any(lib in path for lib in (*_LIBRARIES, *_INSTALLED)) or path.startswith(stdlib)


def _which_collective(tb) -> tuple[str, str]:
    """(collective, caller) from a traceback: e.g. ``("all_reduce", "accum_kit/core/loss.py:120 in finish")``."""
    frames = traceback.extract_tb(tb)
    op = None
    for frame in reversed(frames):  # innermost first
        if frame.filename.endswith(os.path.join("torch", "distributed", "distributed_c10d.py")):
            op = frame.name
            break
    if op is None and any(f.name == "_engine_run_backward" or f.filename.endswith(os.path.join("autograd", "__init__.py"))
                          for f in frames):
        op = "DDP's gradient all_reduce (inside backward)"
    caller = ""
    for outer, inner in zip(frames, frames[1:]):
        if not _is_library(outer.filename) and _is_library(inner.filename):
            caller = f"{_short(outer.filename)}:{outer.lineno} in {outer.name}"
    return op or "a collective", caller


def _short(path: str) -> str:
    parts = path.split(os.sep)
    return os.sep.join(parts[-2:]) if len(parts) > 1 else path


def _from_the_transport(exc: BaseException, text: str) -> bool:
    """Whether a lost connection is the process group's (gloo's source path in the message, NCCL's name, or
    torch.distributed's own error classes), not, say, a download's ``Connection refused``."""
    return ("gloo" in text or "nccl" in text.lower()
            or type(exc).__name__ in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError"))


def describe_collective_failure(exc: BaseException) -> str | None:
    """One line saying which collective failed on this rank and why, or None if ``exc`` is no such failure.

    Args:
        exc: an exception with its traceback (as caught, or as given to
            ``sys.excepthook``).

    Returns:
        e.g. ``"rank 0: all_reduce (called at accum_kit/core/loss.py:120 in finish)
        timed out after 3 s, the process group's timeout (--ddp_timeout): another
        process did not join it (stalled, stopped or dead); torchrun's failure
        report names the rank that failed first"``; None for any
        other exception. The rank is the launcher's ``RANK`` variable.
    """
    text = str(exc)
    match = _TIMEOUT.search(text)
    if match:
        what = (f"timed out after {int(match.group(1)) / 1000:g} s, the process group's timeout (--ddp_timeout): "
                "another process did not join it (stalled, stopped or dead)")
    elif any(p in text for p in _PEER_GONE) and _from_the_transport(exc, text):
        what = "lost its connection to another process (that process died or closed its group)"
    else:
        return None
    op, caller = _which_collective(exc.__traceback__)
    where = f" (called at {caller})" if caller else ""
    rank = os.environ.get("RANK", "?")
    return f"rank {rank}: {op}{where} {what}; torchrun's failure report names the rank that failed first"


#: Set to 1 to have the traceback of a collective failure printed after its one line.
TRACEBACK_ENV = "ACCUM_KIT_TRACEBACK"


def install_collective_failure_hook() -> None:
    """Print :func:`describe_collective_failure`'s line instead of the traceback of an uncaught collective failure.

    Any other exception, or any with ``ACCUM_KIT_TRACEBACK=1`` in the environment, goes on to the hook in place
    (torch.distributed's own, which prefixes every traceback line with ``[rankN]:``). The process still exits
    with code 1, as after any uncaught exception. Installing twice is a no-op.
    """
    previous = sys.excepthook
    if getattr(previous, "_accum_kit_collective_hook", False):
        return

    def hook(exc_type, exc, tb):
        try:
            line = describe_collective_failure(exc.with_traceback(tb)) if exc is not None else None
        except Exception:  # noqa: BLE001 - never hide the original error behind our own
            line = None
        if line:
            print(f"error: {line}", file=sys.stderr, flush=True)
        if not line or os.environ.get(TRACEBACK_ENV) == "1":
            previous(exc_type, exc, tb)

    hook._accum_kit_collective_hook = True
    sys.excepthook = hook
