"""Worker for the example tests (not a test module): runs every example in ONE launch.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/examples_worker.py SPEC.json OUT_DIR

SPEC.json is ``{"examples": [{"name": ..., "path": ..., "argv": [...], "env": {...}}, ...]}``
(``env`` optional: variables set while that example runs, as ``accelerate launch`` sets them from
its config and flags, e.g. ``ACCELERATE_DEEPSPEED_ZERO_STAGE`` for ``--zero_stage``; restored after).
Each example script defines ``main(argv) -> dict``; it is loaded from its file
and called with ``argv``, and what it returns is saved as
``OUT_DIR/<name>.rank<R>.json`` (or ``<name>.rank<R>.error`` with the
traceback), and each example's seconds to ``OUT_DIR/example_seconds.rank<R>.json``.
Accelerate's singletons are reset between examples; the gloo
process group stays up, so the import and start-up cost is paid once.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

import job_helpers as jh  # the worker runs as a script from tests/


@contextlib.contextmanager
def environment(env: dict | None):
    """``os.environ`` with ``env`` set (``None`` values removed) for the block, as it was after."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    for k, v in (env or {}).items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, str(v))
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def main(spec_path: str, out_dir: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_dir)
    rank = int(os.environ.get("RANK", "0"))
    failed, seconds = False, {}
    for ex in spec["examples"]:
        jh.reset_accelerate_state()
        started = time.perf_counter()
        try:
            with environment(ex.get("env")):
                module = runpy.run_path(ex["path"], run_name="accum_kit_example")
                result = module["main"](ex["argv"])
            (out / f"{ex['name']}.rank{rank}.json").write_text(json.dumps(result, default=str))
        except BaseException:  # noqa: BLE001 - recorded for the test, then the next example runs
            failed = True
            (out / f"{ex['name']}.rank{rank}.error").write_text(traceback.format_exc())
        seconds[ex["name"]] = time.perf_counter() - started
    (out / f"example_seconds.rank{rank}.json").write_text(json.dumps(seconds))  # what each example adds to a launch
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
