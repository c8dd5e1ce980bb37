"""Worker for tests/test_multinode.py (not a test module): verify, then a short train run, in ONE launch.

    accelerate launch [...] tests/multinode_worker.py OUT_DIR -- TRAIN FLAGS

Writes OUT_DIR/verify.rank<R>.json (the verify report) and runs ``accum-kit train``
with the given flags; exit code 0 only when both succeeded.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import job_helpers as jh  # the worker runs as a script from tests/


def main(out_dir: str, train_argv: list[str]) -> int:
    from accum_kit.cli import run
    from accum_kit.verify import verify_accumulation

    rank = int(os.environ.get("RANK", "0"))
    report = verify_accumulation(gradient_accumulation_steps=3)
    Path(out_dir, f"verify.rank{rank}.json").write_text(json.dumps(report.to_dict(), default=str))
    jh.reset_accelerate_state()
    return max(report.exit_code, run("train", train_argv))


if __name__ == "__main__":
    split = sys.argv.index("--")
    sys.exit(main(sys.argv[1], sys.argv[split + 1:]))
