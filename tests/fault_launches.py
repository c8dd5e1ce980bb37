"""What the fault launches share: kill a worker once a checkpoint exists, read torchrun's failure report,
compare a resumed run with the uninterrupted one.

Used by tests/test_deepspeed.py (the DeepSpeed fault launches beside its worker), tests/test_fsdp_faults.py (the
comparison) and benchmarks/deepspeed/faults.py (every stage and fault, by hand).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import job_helpers as jh
from accum_kit.core.checkpoint import latest_checkpoint


def kill_rank1_after_a_checkpoint(started: tuple, out: Path, timeout: float) -> dict:
    """SIGKILL the rank-1 worker of the launch ``started`` (``jh.start``'s) as soon as ``out`` holds a complete
    checkpoint. Returns ``{"pid", "checkpoint_then", "signalled_at"}`` (monotonic seconds), or ``{"error"}``
    when the launch ended first or no checkpoint came within ``timeout`` seconds."""
    proc = started[1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return {"error": f"ended (rc {proc.returncode}) before its signal"}
        if (ckpt := latest_checkpoint(out)) and (pid := jh.worker_pid(proc.pid, 1)):
            os.kill(pid, signal.SIGKILL)
            return {"pid": pid, "checkpoint_then": ckpt.name, "signalled_at": time.monotonic()}
        time.sleep(0.1)
    return {"error": f"no checkpoint within {timeout} s"}


def root_cause(stderr: str) -> dict:
    """torchrun's failure report: ``{"rank", "exitcode", "signal"}`` of the first observed failure (None each
    when the text has no report)."""
    report = stderr[stderr.rfind("Root Cause"):] if "Root Cause" in stderr else ""
    rank = re.search(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)", report)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", report)
    sig = re.search(r"Signal (\d+) \((\w+)\)", report)
    return {"rank": int(rank.group(1)) if rank else None, "exitcode": int(code.group(1)) if code else None,
            "signal": sig.group(2) if sig else None}


def compare(out: Path, reference: Path, steps: int) -> dict:
    """The train job's output in ``out`` against the uninterrupted run's in ``reference``: per-step losses,
    final evaluation loss and every tensor of ``model.safetensors``, bit for bit. ``steps``: the optimizer steps
    both must have logged. ``bitwise_equal`` is the verdict; the other keys say what differs."""
    from safetensors.torch import load_file

    if not (out / "train_summary.json").exists():
        return {"finished": False}
    got = json.loads((out / "train_summary.json").read_text())
    ref = json.loads((reference / "train_summary.json").read_text())
    a, b = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    differing = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a.keys() & b.keys()
                 if not a[k].equal(b[k])}
    equal = (got["train_loss"] == ref["train_loss"] and got.get("eval_loss_after") == ref.get("eval_loss_after")
             and a.keys() == b.keys() and not differing and len(got["train_loss"]) == steps)
    return {"finished": True, "bitwise_equal": equal, "train_loss_equal": got["train_loss"] == ref["train_loss"],
            "eval_loss_equal": got.get("eval_loss_after") == ref.get("eval_loss_after"),
            "losses": len(got["train_loss"]), "tensors": len(a), "tensor_keys_equal": a.keys() == b.keys(),
            "tensors_differing": len(differing), "max_abs_difference": max(differing.values(), default=0.0),
            "resumed_from_step": got.get("resumed_from_step"), "zero_stage": (got.get("deepspeed") or {}).get("zero_stage")}
