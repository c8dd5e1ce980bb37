"""--auto_find_batch_size under a real memory limit: retries, time lost, and steady-state speed against the
micro-batch set by hand.

    python benchmarks/auto_batch/bench.py --work /tmp/auto_batch_bench --out benchmarks/auto_batch/results.json

Three 2-process DDP launches (accelerate_configs/cpu_ddp.yaml), each under ``prlimit --as=LIMIT`` (an address-space
limit inherited by every worker), run one after another: by hand at the micro-batch that fits (``--fits``), then
``--auto_find_batch_size`` started 8 times larger with K=1 (``accelerate launch --max_restarts 3``), then by hand
again (drift check). Same effective batch, seed and data in all three. While the automatic run goes, every worker's
pid is polled (psutil, every 20 ms) to time each peer's exit after a failure.

Reported: the micro-batch settled on and the retries; per failure its phase, the longest wait of a peer between the
failure (``failed_at`` in the state file) and its exit, and the time lost (restart + work lost); steady-state step
times after ``--warmup`` steps, and the ratio automatic / by hand per step (pass = step index) with its 95 %
t-interval on the log (accum_kit.stats.ratio_interval); whether the losses equal the by-hand run's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import job_helpers as jh  # noqa: E402
from accum_kit.stats import median, ratio_interval  # noqa: E402

FILES = ("textwrap.py", "shlex.py", "string.py", "argparse.py", "typing.py", "inspect.py", "pathlib.py",
         "subprocess.py", "dataclasses.py", "enum.py", "functools.py", "tarfile.py")


def launch(work: Path, name: str, limit: int, batch: int, k: int, steps: int, corpus: Path, *extra) -> dict:
    out = work / name
    cmd = ["prlimit", f"--as={limit}", *jh.accelerate_launch_cmd(*extra, "-m", "accum_kit", "train",
           "--train_file", corpus, "--model_preset", "mini", "--block_size", "256", "--max_train_steps", steps,
           "--per_device_train_batch_size", batch, "--gradient_accumulation_steps", k, "--num_warmup_steps", "0",
           "--max_eval_samples", "8", "--per_device_eval_batch_size", "4", "--logging_steps", "1",
           "--output_dir", out)]
    cmd = [str(c) for c in cmd]
    started = jh.start(cmd, jh.clean_env(HF_DATASETS_CACHE=str(work / "hf_cache")), work, name)
    seen = _poll_workers(started[1])
    res = jh.finish(started, 3600)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed\n{res.describe()}")
    return {"summary": json.loads((out / "train_summary.json").read_text()), "workers": seen, "seconds": res.seconds}


def _poll_workers(proc) -> dict:
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
                rank = child.environ().get("RANK")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if rank is not None and child.pid not in seen and child.name().startswith("python"):
                seen[child.pid] = {"rank": int(rank), "first_seen": now, "last_seen": now}
            if child.pid in seen:
                seen[child.pid]["last_seen"] = now
        time.sleep(0.02)
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=3_800_000_000, help="RLIMIT_AS of every process, bytes")
    ap.add_argument("--fits", type=int, default=16, help="the largest micro-batch that fits under --limit")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = jh.write_corpus(args.work / "corpus.txt", files=FILES)
    big, k_hand = 8 * args.fits, 8
    load = [os.getloadavg()[0]]
    hand = launch(args.work, "by_hand", args.limit, args.fits, k_hand, args.steps, corpus)
    load.append(os.getloadavg()[0])
    auto = launch(args.work, "auto", args.limit, big, 1, args.steps, corpus, "--max_restarts", "3")
    load.append(os.getloadavg()[0])
    hand2 = launch(args.work, "by_hand_again", args.limit, args.fits, k_hand, args.steps, corpus)
    load.append(os.getloadavg()[0])
    block = auto["summary"]["auto_find_batch_size"]
    failures = []
    for attempt in block["attempts"]:
        # the peers of the failing rank in that attempt: the workers alive at the failure
        peers = [w for w in auto["workers"].values()
                 if w["rank"] != attempt["rank"] and w["first_seen"] <= attempt["failed_at"] <= w["last_seen"] + 1]
        waits = [w["last_seen"] - attempt["failed_at"] for w in peers]
        failures.append({**{k: attempt[k] for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                                     "rank", "where", "bytes", "wasted_seconds", "restart_seconds")},
                         "peer_exit_after_failure_seconds": max(waits) if waits else None})
    w = args.warmup
    per_step = {name: run["summary"]["step_seconds"][w:] for name, run in
                (("by_hand", hand), ("auto", auto), ("by_hand_again", hand2))}
    hand_mean = [(a + b) / 2 for a, b in zip(per_step["by_hand"], per_step["by_hand_again"])]
    result = {
        "command": " ".join(sys.argv),
        "limit_bytes": args.limit, "fits": args.fits, "started_at": big,
        "settled": block["settled"], "restarts": block["restarts"], "seconds_lost": block["seconds_lost"],
        "failures": failures,
        "step_seconds_after_warmup": per_step,
        "median_step_seconds": {k: median(v) for k, v in per_step.items()},
        "auto_over_by_hand": ratio_interval([a / h for a, h in zip(per_step["auto"], hand_mean)]),
        "by_hand_again_over_by_hand": ratio_interval([b / a for a, b in zip(per_step["by_hand"],
                                                                            per_step["by_hand_again"])]),
        "losses_equal_by_hand": auto["summary"]["train_loss"] == hand["summary"]["train_loss"],
        "launch_seconds": {"by_hand": hand["seconds"], "auto": auto["seconds"], "by_hand_again": hand2["seconds"]},
        "load_average_1min": load,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
