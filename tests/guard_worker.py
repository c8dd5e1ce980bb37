"""Worker for tests/test_launch_guard.py (not a test module: pytest does not collect it).

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/guard_worker.py MODE OUT_DIR

Writes OUT_DIR/rank<r>.json with what it saw; the test decides what is right.

MODE ``built``: ``accum_kit.build_accelerator(3)``, then a raw
``torch.distributed.all_reduce`` of the rank (independent of Accelerate's
bookkeeping: it sums to 0+1 only if the processes really share one group).

MODE ``plain``: first ``accum_kit.build_accelerator(cpu=False)`` (a caller that
turns the CPU switch off; it must refuse to return), then, after resetting
Accelerate's singleton state, a plain ``Accelerator()`` as a user script would
build it and ``accum_kit.check_process_count`` on it, *not* caught: the record
is written first, then the ProcessCountError must fail the launch.

The two modes run in separate launches because a plain ``Accelerator()`` under
torchrun already calls ``torch.distributed.init_process_group`` (with no
backend) while reporting ``num_processes == 1``; a later
``Accelerator(cpu=True)`` in the same process would reuse that group instead of
creating its own gloo group.
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


def _write(out_dir: Path, rank: int, rec: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(rec, indent=1))


def built(out_dir: Path, rank: int, rec: dict) -> int:
    import torch
    import torch.distributed as dist

    import accum_kit

    rec["dist_initialized_before"] = dist.is_initialized()
    try:
        acc = accum_kit.build_accelerator(3)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)  # SUM over the default group
        rec.update(
            num_processes=acc.num_processes,
            process_index=acc.process_index,
            distributed_type=str(acc.distributed_type),
            gradient_accumulation_steps=acc.gradient_accumulation_steps,
            backend=dist.get_backend(),
            group_size=dist.get_world_size(),
            allreduce_rank_sum=t.item(),
            error=None,
        )
        acc.wait_for_everyone()
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        rec.update(error=_error(exc), traceback=traceback.format_exc())
    _write(out_dir, rank, rec)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def plain(out_dir: Path, rank: int, rec: dict) -> int:
    from accelerate import Accelerator

    import accum_kit

    rec["forced"] = {"error": None}
    try:
        acc = accum_kit.build_accelerator(2, cpu=False)
        rec["forced"]["num_processes"] = acc.num_processes
    except Exception as exc:  # noqa: BLE001
        rec["forced"]["error"] = _error(exc)
    _reset()

    acc = Accelerator()  # what a user script would build
    rec["plain"] = {"num_processes": acc.num_processes, "distributed_type": str(acc.distributed_type)}
    _write(out_dir, rank, rec)
    accum_kit.check_process_count(acc)  # must raise, on every rank
    (out_dir / f"rank{rank}.passed").write_text("check_process_count did not raise")
    return 0


def main(mode: str, out_dir: Path) -> int:
    rank = int(os.environ["RANK"])
    rec = {"mode": mode, "env_rank": rank, "env_world_size": int(os.environ["WORLD_SIZE"])}
    return {"built": built, "plain": plain}[mode](out_dir, rank, rec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
