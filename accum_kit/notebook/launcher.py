"""Run a training function on several processes from a Jupyter notebook.

:func:`launch` starts N processes that form one ``torch.distributed`` process
group and runs ``function(*args)`` in each, the way ``accelerate launch`` would
run a script. It exists because Accelerate's ``notebook_launcher`` starts a
single process on a machine without a GPU, so a notebook there could never
see what ``no_sync`` saves.

Why fork: a function defined in a notebook cell lives in the kernel's
``__main__`` and cannot be pickled by reference, so the ``spawn`` start
method (a fresh interpreter that must import the function) fails for it. A
``fork`` start copies the kernel's memory, function included, and needs no
pickling on the way in; only the return value travels back (pickled to a
file). Accelerate's own launchers use ``fork`` for the same reason. The
parent must not have initialised CUDA or a process group (a forked child
cannot reuse either): :func:`launch` checks both.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path

from ..errors import AccumKitError


class LaunchError(AccumKitError, RuntimeError):
    """A process of :func:`launch` raised, died or timed out; the message names its rank."""


def _free_port(host: str) -> int:
    # A fresh port per launch: two launches in a row must not meet the first one's store.
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker(function, args, rank: int, world: int, host: str, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    from ..compat import reset_accelerate_state

    reset_accelerate_state()  # the kernel may hold a single-process Accelerator from an earlier cell
    path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        payload = ("ok", function(*args))
        data = pickle.dumps(payload)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the notebook with its rank
        data = pickle.dumps(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)  # skip the kernel's atexit handlers, inherited through fork


def _check_parent() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise LaunchError("CUDA is already initialised in this kernel, and forked processes cannot use it: "
                          "restart the kernel and create models and tensors on the GPU only inside the function")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise LaunchError("this kernel already has a torch.distributed process group: restart the kernel "
                          "and initialise it only inside the launched function")


def launch(function, *args, num_processes: int | None = None, timeout: float = 600.0, host: str = "127.0.0.1",
           grace_seconds: float = 10.0):
    """Run ``function(*args)`` on ``num_processes`` processes that form one process group.

    Each process gets the variables a launcher sets (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so
    :func:`accum_kit.build_accelerator` inside ``function`` joins them into one
    group: gloo on CPU when no GPU is present, one process per GPU with NCCL
    when GPUs are (the GPU path is written but was only run on CPU machines).

    Args:
        function: called as ``function(*args)`` in every process; it may be
            defined in a notebook cell (see the module docstring).
        *args: its arguments, inherited by the forked processes (not pickled).
        num_processes: processes to start; default the number of GPUs, or 2 without GPUs.
        timeout: seconds for the whole run; then every process is killed and
            :class:`LaunchError` raised, so a hung process never freezes the kernel.
        host: the address of the rendezvous store (this machine).
        grace_seconds: after one process fails, seconds the others get to end
            on their own (they usually fail in their next collective) before they are killed.

    Returns:
        What rank 0's call returned (it must pickle).

    Raises:
        LaunchError: a process raised (its rank, exception and traceback are in
            the message), died from a signal, or the run passed ``timeout``.
        ValueError: ``num_processes`` below 1.
    """
    import torch

    _check_parent()
    if num_processes is None:
        num_processes = torch.cuda.device_count() or 2
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1 (got {num_processes})")
    port = _free_port(host)
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="accum_kit_launch-") as out_dir:
        procs = [ctx.Process(target=_worker, args=(function, args, r, num_processes, host, port, out_dir),
                             name=f"accum_kit rank {r}", daemon=False) for r in range(num_processes)]
        for p in procs:
            p.start()
        deadline, failed_at = time.monotonic() + timeout, None
        try:
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if failed_at is None and any(_failed(p, out_dir, r) for r, p in enumerate(procs)):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + grace_seconds):
                    break
                time.sleep(0.05)
        finally:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                p.join()
        results = {r: pickle.loads((Path(out_dir) / f"rank{r}.pkl").read_bytes())
                   for r in range(num_processes) if (Path(out_dir) / f"rank{r}.pkl").exists()}
    errors = [f"rank {r} raised {res[1]}\n{res[2]}" for r, res in sorted(results.items()) if res[0] == "error"]
    for r, p in enumerate(procs):
        if r not in results and r not in alive:
            errors.append(f"rank {r} died with exit code {p.exitcode}"
                          + (f" ({signal.Signals(-p.exitcode).name})" if p.exitcode and p.exitcode < 0 else ""))
    if errors:
        raise LaunchError("\n".join(errors) + (f"\n(ranks {alive} were still running and were killed)" if alive else ""))
    if alive:
        raise LaunchError(f"ranks {alive} were still running after timeout={timeout:g} s and were killed")
    return results[0][1]


def _failed(proc, out_dir: str, rank: int) -> bool:
    """True once a process died without a result, or reported an error."""
    path = Path(out_dir) / f"rank{rank}.pkl"
    if path.exists():
        return pickle.loads(path.read_bytes())[0] == "error"
    return not proc.is_alive() and proc.exitcode is not None
