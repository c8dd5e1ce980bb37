"""Worker for tests/test_launch_guard.py (not a test module: pytest does not collect it).

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/guard_worker.py OUT_DIR

Runs three checks in one launch (one import cost) and writes OUT_DIR/rank<r>.json:

1. ``plain``: a plain ``Accelerator()``, what a user script would build, and
   ``accum_kit.check_process_count`` on it (records the error, if any).
2. ``forced``: ``accum_kit.build_accelerator(cpu=False)`` (a caller that turns
   the CPU switch off), which must refuse to return a lone-process Accelerator.
3. ``built``: ``accum_kit.build_accelerator(K)``, then a raw
   ``torch.distributed.all_reduce`` of the rank (independent of Accelerate's
   bookkeeping: it only succeeds, and sums to 0+1, if the processes really share
   one group).

Accelerate's state is a process-wide singleton; it is reset between the
checks, which is safe here because checks 1 and 2 never create a process group.
The worker only records; the test decides what is right.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)}


def main(out_dir: Path) -> int:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    import accum_kit

    rank = int(os.environ["RANK"])
    rec = {"env_rank": rank, "env_world_size": int(os.environ["WORLD_SIZE"])}

    # 1. plain Accelerator()
    acc = Accelerator()
    rec["plain"] = {"num_processes": acc.num_processes, "distributed_type": str(acc.distributed_type),
                    "dist_initialized": dist.is_initialized(), "error": None}
    try:
        accum_kit.check_process_count(acc)
    except Exception as exc:  # noqa: BLE001 - the test checks the type
        rec["plain"]["error"] = _error(exc)
    del acc
    _reset()

    # 2. build_accelerator with the CPU switch forced off
    rec["forced"] = {"error": None, "dist_initialized": None}
    try:
        acc = accum_kit.build_accelerator(2, cpu=False)
        rec["forced"]["num_processes"] = acc.num_processes
    except Exception as exc:  # noqa: BLE001
        rec["forced"]["error"] = _error(exc)
    rec["forced"]["dist_initialized"] = dist.is_initialized()
    _reset()

    # 3. build_accelerator(): one gloo group of all launched processes
    try:
        acc = accum_kit.build_accelerator(3)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)  # SUM over the default group
        rec["built"] = {
            "num_processes": acc.num_processes,
            "process_index": acc.process_index,
            "distributed_type": str(acc.distributed_type),
            "gradient_accumulation_steps": acc.gradient_accumulation_steps,
            "backend": dist.get_backend(),
            "group_size": dist.get_world_size(),
            "allreduce_rank_sum": t.item(),
            "error": None,
        }
        acc.wait_for_everyone()
    except Exception as exc:  # noqa: BLE001
        rec["built"] = {"error": _error(exc), "traceback": traceback.format_exc()}

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(rec, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
