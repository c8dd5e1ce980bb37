"""How long a peer of the rank that failed an allocation lives on, under --auto_find_batch_size.

    python benchmarks/auto_batch/peer_wait.py --work /tmp/peer_wait --out benchmarks/auto_batch/peer_wait.json

Two 2-process DDP launches (``accelerate launch --max_restarts 1``) of tests/auto_batch_worker.py, the ``mini`` preset,
a micro-batch of 4, where only rank 1 gets an address-space limit in the first attempt:

- ``in_collective``: K=1, the limit before rank 1's backward of the third window: rank 0 reaches DDP's gradient
  all-reduce in its own backward and waits there;
- ``computing``: K=4, the limit before rank 1's first forward of the third window: rank 0 still has four
  micro-batches to compute under ``no_sync`` before its next collective.

Every worker's pid is polled (psutil, every 20 ms). Reported per scenario: the failure time (``failed_at`` of the
state file, written by rank 1 before it exits), the moment rank 0's first-attempt process was last seen (its exit, to
within the 20 ms poll), their difference, and rank 0's own error line (a collective that lost its peer) or its
stop line (it saw the state file change before a micro-batch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import job_helpers as jh  # noqa: E402
from bench import write_result  # noqa: E402  (this folder: on sys.path as the script's own)

SCENARIOS = {"in_collective": ("1", "backward:2:0"), "computing": ("4", "forward:2:0")}


def poll_workers(proc) -> dict:
    """{pid: {"rank", "first_seen", "last_seen"}} (wall-clock s) of the launcher's workers until it ends."""
    import psutil

    seen: dict = {}
    while proc.poll() is None:
        now = time.time()
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for child in children:
            try:
                if child.pid not in seen:
                    rank = child.environ().get("RANK")
                    if rank is None or "auto_batch_worker" not in " ".join(child.cmdline()):
                        continue
                    seen[child.pid] = {"rank": int(rank), "first_seen": now}
                seen[child.pid]["last_seen"] = now
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.02)
    return seen


def scenario(work: Path, name: str, k: str, at: str, corpus: Path) -> dict:
    out = work / name
    cmd = jh.accelerate_launch_cmd("--max_restarts", "1", REPO / "tests" / "auto_batch_worker.py", "--train_file",
                                   corpus, "--model_preset", "mini", "--block_size", "64", "--max_train_steps", "3",
                                   "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", k,
                                   "--max_train_samples", "400", "--max_eval_samples", "8", "--auto_find_batch_size",
                                   "--output_dir", out)
    env = jh.clean_env(HF_DATASETS_CACHE=str(work / f"hf_cache_{name}"), AUTO_BATCH_RANK="1", AUTO_BATCH_AT=at)
    started = jh.start([str(c) for c in cmd], env, work, name)
    seen = poll_workers(started[1])
    res = jh.finish(started, 900)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed\n{res.describe()}")
    failure = json.loads((out / "train_summary.json").read_text())["auto_find_batch_size"]["attempts"][0]
    rank0 = min((w for w in seen.values() if w["rank"] == 0), key=lambda w: w["first_seen"])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: rank 0")]
    stops = [line[line.index("auto_find_batch_size: stopping"):] for line in res.stderr.splitlines()
             if "auto_find_batch_size: stopping" in line]
    return {"failure": {k: failure[k] for k in ("rank", "where", "micro_batch", "optimizer_step", "bytes")},
            "failed_at": failure["failed_at"], "rank0_last_seen": rank0["last_seen"],
            "rank0_exit_after_failure_seconds": round(rank0["last_seen"] - failure["failed_at"], 3),
            "rank0_error": errors[0] if errors else None, "rank0_stop_line": stops[0] if stops else None,
            "restart_seconds": failure["restart_seconds"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = jh.write_corpus(args.work / "corpus.txt")
    result = {"command": " ".join(sys.argv),
              **{name: scenario(args.work, name, k, at, corpus) for name, (k, at) in SCENARIOS.items()}}
    return write_result(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
