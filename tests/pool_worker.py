"""Worker of :class:`command_pool.CommandPool` (not a test module: pytest does not collect it).

    accelerate launch --config_file <config> tests/pool_worker.py QUEUE_DIR

Runs the accum-kit commands that the tests drop into QUEUE_DIR while it runs, one after
another, in every process of the launch, so that the start-up (torch, transformers,
datasets, the launcher and the rendezvous: most of a small job's cost) is paid once for all
of them. Command ``i`` is ``QUEUE_DIR/<i:04d>.json`` (written atomically by the test)::

    {"command": "verify"|"train"|"bench"|..., "argv": [...], "datasets_cache": str|null}
    {"script": "benchmarks/soak.py", "argv": [...], "datasets_cache": str|null}   # a script, as __main__
    {"stop": true}                                  # the last one: the launch ends, exit code 0

Each command runs as ``accelerate launch ... -m accum_kit <command> <argv>`` would run it
(``accum_kit.cli.run``), as if in a fresh process: Accelerate's shared state and dynamo's
caches are reset (``torch._dynamo.reset()``, documented as "as if you had started a fresh
process"), a default process group is formed again if an earlier command ended it (the
train job and bench do; the first command forms its own as in a fresh launch), and ``datasets``' cache directory is the command's own. What it
prints on stdout goes to ``QUEUE_DIR/<i:04d>.rank<r>.stdout``; its stderr goes to the launch's,
between the lines ``[pool_worker] rank <r> command <i> start: ...`` and ``... end: ...``; then every rank writes
``QUEUE_DIR/<i:04d>.rank<r>.done`` with ``{"exit_code": int}`` or, if the command raised,
``{"exit_code": null, "traceback": str}``, and the launch ends with that exception (a rank that
raised may have left its peers inside a collective: nothing later could be trusted).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from job_helpers import fresh_process_group  # the worker runs as a script from tests/

POLL_S = 0.05  # waiting for the next command: a stat per poll, no CPU to speak of
IDLE_TIMEOUT_S = 3600  # a pool nobody stops (its test session died) ends by itself


def wait_for(path: Path) -> dict:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no command {path.name} within {IDLE_TIMEOUT_S} s")
        time.sleep(POLL_S)
    return json.loads(path.read_text())


@contextlib.contextmanager
def datasets_cache(path: str | None):
    """``datasets``' cache directory for one command (read at import time, so set on its config too)."""
    if path is None:
        yield
        return
    import datasets

    before, env_before = datasets.config.HF_DATASETS_CACHE, os.environ.get("HF_DATASETS_CACHE")
    datasets.config.HF_DATASETS_CACHE = Path(path)
    os.environ["HF_DATASETS_CACHE"] = path
    try:
        yield
    finally:
        datasets.config.HF_DATASETS_CACHE = before
        if env_before is None:
            os.environ.pop("HF_DATASETS_CACHE", None)
        else:
            os.environ["HF_DATASETS_CACHE"] = env_before


def write_atomically(path: Path, record: dict) -> None:
    """The reader polls for ``path``: it must never see it half-written."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def run_script(path: str, argv: list[str]) -> int:
    """``python <path> <argv>`` in this process (``runpy``, as ``__main__``); its exit code."""
    import runpy

    before = sys.argv
    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = before
    return 0


def run_one(i: int, entry: dict, queue: Path, rank: str) -> int:
    import torch

    from accum_kit.cli import run as cli_run
    from accum_kit.compat import reset_accelerate_state

    if i > 0:  # the first command forms its group as under a fresh launch
        fresh_process_group(f"pool_worker/command{i}/")
    reset_accelerate_state()
    torch._dynamo.reset()
    # the launch's stderr is every command's: these lines let a test cut out its own command's part
    print(f"[pool_worker] rank {rank} command {i} start: {entry.get('script') or 'accum-kit ' + entry['command']}", file=sys.stderr, flush=True)
    with open(queue / f"{i:04d}.rank{rank}.stdout", "w") as out, contextlib.redirect_stdout(out), \
            datasets_cache(entry.get("datasets_cache")):
        if entry.get("script"):
            code = run_script(entry["script"], [str(a) for a in entry["argv"]])
        else:
            code = cli_run(entry["command"], [str(a) for a in entry["argv"]])
        sys.stdout.flush()
    sys.stderr.flush()
    print(f"[pool_worker] rank {rank} command {i} end: exit code {code}", file=sys.stderr, flush=True)
    return code


def main(argv) -> int:
    import torch

    torch.set_num_threads(1)
    queue = Path(argv[1])
    rank = os.environ.get("RANK", "0")
    i = 0
    while not (entry := wait_for(queue / f"{i:04d}.json")).get("stop"):
        done = queue / f"{i:04d}.rank{rank}.done"
        try:
            code = run_one(i, entry, queue, rank)
        except BaseException:
            write_atomically(done, {"exit_code": None, "traceback": traceback.format_exc()})
            raise
        write_atomically(done, {"exit_code": code})
        i += 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main(sys.argv))
