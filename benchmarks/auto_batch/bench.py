"""--auto_find_batch_size under a real memory limit: retries, time lost, and steady-state speed against the
micro-batch set by hand.

    python benchmarks/auto_batch/bench.py --work /tmp/auto_batch_bench --out benchmarks/auto_batch/results.json

Two 2-process DDP launches (accelerate_configs/cpu_ddp.yaml), each under ``prlimit --as=LIMIT`` (an address-space
limit inherited by every worker): ``--auto_find_batch_size`` started 8 times larger than the micro-batch that fits
(``--fits``) with K=1 (``accelerate launch --max_restarts 3``), and, started as soon as the automatic run begins the
attempt at ``--fits``, the same job by hand at ``--fits`` x 8, so that both train at the same time on the same
cores (a shared machine's load changes by tens of percent within minutes; two runs side by side see the same).
Same effective batch, seed and data.

Reported: the micro-batch settled on and the retries; per failure its phase and the time lost (restart + work lost);
steady-state step times after ``--warmup`` steps, and the ratio automatic / by hand with its 95 % t-interval on the
log (accum_kit.stats.ratio_interval), pairing each automatic step with the by-hand step it overlaps most in time
(``auto_over_by_hand_same_time``, the comparison to read) and, for reference, by step index; whether the losses
equal the by-hand run's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def launch(work: Path, name: str, limit: int, batch: int, k: int, steps: int, corpus: Path, auto: bool = False):
    """Start one launch; returns (started, output folder)."""
    out = work / name
    launcher, train = (["--max_restarts", "3"], ["--auto_find_batch_size"]) if auto else ([], [])
    cmd = ["prlimit", f"--as={limit}", *jh.accelerate_launch_cmd(*launcher, "-m", "accum_kit", "train", *train,
           "--train_file", corpus, "--model_preset", "mini", "--block_size", "256", "--max_train_steps", steps,
           "--per_device_train_batch_size", batch, "--gradient_accumulation_steps", k, "--num_warmup_steps", "0",
           "--max_eval_samples", "8", "--per_device_eval_batch_size", "4", "--logging_steps", "1",
           "--output_dir", out)]
    cmd = [str(c) for c in cmd]
    return jh.start(cmd, jh.clean_env(HF_DATASETS_CACHE=str(work / f"hf_cache_{name}")), work, name), out


def finished(started, out: Path) -> dict:
    res = jh.finish(started, 3600)
    if res.returncode != 0:
        raise SystemExit(f"{out.name} failed\n{res.describe()}")
    return {"summary": json.loads((out / "train_summary.json").read_text()), "seconds": res.seconds}


def step_intervals(log: Path, step_seconds: list) -> dict:
    """{optimizer step: (start, end)} in seconds of the day, from the job's "step N:" log lines (its clock, 1 s
    resolution, logged with --logging_steps 1) and the summary's exact step durations."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"(\d\d):(\d\d):(\d\d) INFO accum_kit.job.train: \[RANK 0\] step (\d+):", line)
        if m:
            h, mi, sec, step = map(int, m.groups())
            end = h * 3600 + mi * 60 + sec + 0.5
            out[step] = (end - step_seconds[step - 1], end)
    return out


def paired_by_time(auto: dict, hand: dict, warmup: int) -> list:
    """(auto step seconds / by-hand step seconds) for every automatic step after ``warmup`` that lies within the
    by-hand run's steps after ``warmup``, paired with the by-hand step it overlaps most: the two ran at the same time,
    under the same load."""
    ratios = []
    hand = {s: iv for s, iv in hand.items() if s > warmup}
    lo, hi = min(iv[0] for iv in hand.values()), max(iv[1] for iv in hand.values())
    for step, (a0, a1) in auto.items():
        if step <= warmup or a0 < lo or a1 > hi:
            continue
        best = max(hand.items(), key=lambda kv: min(a1, kv[1][1]) - max(a0, kv[1][0]))
        ratios.append((a1 - a0) / (best[1][1] - best[1][0]))
    return ratios


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
    auto_started, auto_out = launch(args.work, "auto", args.limit, big, 1, args.steps, corpus, auto=True)
    log = args.work / "auto.stderr"
    settled_line = f"runs per_device_train_batch_size {args.fits} x"
    while settled_line not in log.read_text(errors="replace") and auto_started[1].poll() is None:
        time.sleep(0.2)
    hand_started, hand_out = launch(args.work, "by_hand", args.limit, args.fits, k_hand, args.steps, corpus)
    load.append(os.getloadavg()[0])
    auto, hand = finished(auto_started, auto_out), finished(hand_started, hand_out)
    load.append(os.getloadavg()[0])
    block = auto["summary"]["auto_find_batch_size"]
    failures = [{k: a[k] for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "rank", "where",
                                   "bytes", "wasted_seconds", "restart_seconds")} for a in block["attempts"]]
    w = args.warmup
    per_step = {name: run["summary"]["step_seconds"][w:] for name, run in (("by_hand", hand), ("auto", auto))}
    result = {
        "command": " ".join(sys.argv),
        "limit_bytes": args.limit, "fits": args.fits, "started_at": big,
        "settled": block["settled"], "restarts": block["restarts"], "seconds_lost": block["seconds_lost"],
        "failures": failures,
        "step_seconds_after_warmup": per_step,
        "median_step_seconds": {k: median(v) for k, v in per_step.items()},
        "auto_over_by_hand_same_step_index": ratio_interval([a / h for a, h in zip(per_step["auto"],
                                                                                   per_step["by_hand"])]),
        "auto_over_by_hand_same_time": ratio_interval(paired_by_time(
            step_intervals(args.work / "auto.stderr", auto["summary"]["step_seconds"]),
            step_intervals(args.work / "by_hand.stderr", hand["summary"]["step_seconds"]), w)),
        "losses_equal_by_hand": auto["summary"]["train_loss"] == hand["summary"]["train_loss"],
        "launch_seconds": {"by_hand": hand["seconds"], "auto": auto["seconds"]},
        "load_average_1min": load,
    }
    return write_result(args.out, result)


def write_result(out: Path, result: dict) -> int:
    """Write ``result`` as indented JSON to ``out`` and print it; returns the exit code 0."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
