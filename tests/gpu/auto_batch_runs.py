"""The ``auto_batch`` launch of tests/gpu (not a test module): ``--auto_find_batch_size`` against a real CUDA
out-of-memory under a per-process memory cap. Runs train jobs and records what they did; checks nothing.

Started by tests/gpu/gpu_worker.py (``auto_batch``), as a plain process (no launcher: the train jobs it starts are
one-process runs, which re-execute themselves on an allocation failure). Two phases:

1. uncapped, side by side: the train job at every micro-batch of the chain ``AUTO_CHAIN`` (B0 x 1, B0/2 x 2, ...,
   the same effective batch), each process's peak ``max_memory_allocated`` / ``max_memory_reserved`` logged at exit
   by tests/gpu/memory_cap/sitecustomize.py;
2. capped: the job started at B0 x 1 with ``--auto_find_batch_size`` under a cap, set at interpreter start by that
   sitecustomize.py in the first process and in each re-execution, halfway (geometrically) between what the chain's
   last micro-batch reserved uncapped (it fits under the cap) and what the one before it allocated uncapped (it
   cannot fit: the allocator's cap bounds the bytes it reserves, and those hold the bytes allocated).

``OUT_DIR/auto_batch.json`` (the part's entry of result.json) holds each run's exit status, seconds, summary figures,
memory log and the lines of its stderr that name allocation failures.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import gpu_common as common

SITE = common.HERE / "memory_cap"


def write_corpus(path: Path, min_bytes: int) -> Path:
    """The top-level standard-library sources of this interpreter, in sorted order, until ``min_bytes``."""
    text, root = [], Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(root.glob("*.py")):
        text.append(f.read_text(encoding="utf-8", errors="replace"))
        if sum(map(len, text)) >= min_bytes:
            break
    path.write_text("".join(text), encoding="utf-8")
    return path


def job_cmd(corpus: Path, out: Path, batch: int, k: int, auto: bool) -> list[str]:
    w = common.AUTO_WORKLOAD
    return [sys.executable, "-m", "accum_kit", "train", "--train_file", str(corpus), "--model_preset", w["preset"],
            "--block_size", str(w["block_size"]), "--max_train_steps", str(common.AUTO_STEPS),
            "--max_train_samples", str(common.AUTO_CHAIN[0] * common.AUTO_STEPS), "--max_eval_samples", "2",
            "--per_device_eval_batch_size", "1", "--num_warmup_steps", "0", "--logging_steps", "1", "--seed", "0",
            "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", str(k),
            "--output_dir", str(out), *(["--auto_find_batch_size"] if auto else [])]


def job_env(work: Path, name: str, cap: int | None) -> dict:
    env = common.worker_env()
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), env["PYTHONPATH"]])  # first: Python imports the first found
    env.update(HF_DATASETS_CACHE=str(work / f"hf_cache_{name}"), GPU_TESTS_MEMORY_LOG=str(work / f"{name}.memory"))
    env.pop("ACCUM_KIT_AUTO_BATCH_ATTEMPT", None)
    if cap is not None:
        env["GPU_TESTS_MEMORY_CAP_BYTES"] = str(cap)
    return env


class Job:
    def __init__(self, work: Path, corpus: Path, name: str, batch: int, k: int, auto=False, cap=None):
        self.work, self.name, self.t0 = work, name, time.monotonic()
        self.out = work / name
        self.cmd = job_cmd(corpus, self.out, batch, k, auto)
        self.stdout, self.stderr = open(work / f"{name}.stdout", "w+"), open(work / f"{name}.stderr", "w+")
        self.proc = subprocess.Popen(self.cmd, cwd=common.REPO, env=job_env(work, name, cap), stdout=self.stdout,
                                     stderr=self.stderr)

    def finish(self, timeout: float) -> dict:
        try:
            rc = self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = f"timed out after {timeout:.0f}s"
        err = (self.work / f"{self.name}.stderr").read_text(errors="replace")
        summary_path = self.out / "train_summary.json"
        s = json.loads(summary_path.read_text()) if summary_path.exists() else None
        memory_path = self.work / f"{self.name}.memory"
        memory = [json.loads(line) for line in memory_path.read_text().splitlines()] if memory_path.exists() else []
        keys = ("train_loss", "eval_loss_after", "per_device_train_batch_size", "gradient_accumulation_steps",
                "effective_batch_size_per_step", "mixed_precision", "optimizer_steps", "auto_find_batch_size",
                "memory")
        return {"returncode": rc, "seconds": round(time.monotonic() - self.t0, 2), "cmd": " ".join(self.cmd),
                "summary": None if s is None else {k: s.get(k) for k in keys}, "memory_log": memory,
                "failure_lines": [x for x in err.splitlines() if "auto_find_batch_size" in x or "out of memory" in x],
                "stderr_tail": err[-3000:] if rc != 0 else ""}


def exit_peaks(run: dict) -> dict | None:
    """The last process's peaks (the memory log's exit line), or None."""
    exits = [e for e in run["memory_log"] if e.get("event") == "exit"]
    return exits[-1] if exits else None


def cap_between(fits_reserved: int, too_big_allocated: int) -> int | None:
    """The geometric midpoint, or None when the smaller micro-batch reserved as much as the larger allocated."""
    if fits_reserved >= too_big_allocated:
        return None
    return int(math.sqrt(fits_reserved * too_big_allocated))


def run(out: Path, deadline_s: float) -> dict:
    """Both phases within ``deadline_s`` seconds from now; returns the part's figures."""
    t0 = time.monotonic()
    left = lambda: deadline_s - (time.monotonic() - t0)  # noqa: E731
    work = out / "auto_batch"
    work.mkdir(parents=True, exist_ok=True)
    w = common.AUTO_WORKLOAD
    corpus = write_corpus(work / "corpus.txt", int(common.AUTO_CHAIN[0] * common.AUTO_STEPS * w["block_size"] * 1.3))
    b0 = common.AUTO_CHAIN[0]
    refs = {b: Job(work, corpus, f"uncapped_{b}", b, b0 // b) for b in common.AUTO_CHAIN}
    info = {"chain": list(common.AUTO_CHAIN), "workload": w, "steps": common.AUTO_STEPS,
            "uncapped": {str(b): j.finish(left() * 0.45) for b, j in refs.items()}}
    fits, too_big = common.AUTO_CHAIN[-1], common.AUTO_CHAIN[-2]
    p_fit, p_big = exit_peaks(info["uncapped"][str(fits)]), exit_peaks(info["uncapped"][str(too_big)])
    if p_fit is None or p_big is None:
        info["error"] = "an uncapped run logged no peak (see its stderr_tail)"
        return info
    cap = cap_between(p_fit["max_memory_reserved"], p_big["max_memory_allocated"])
    info.update(cap_bytes=cap, fits_reserved=p_fit["max_memory_reserved"],
                too_big_allocated=p_big["max_memory_allocated"])
    if cap is None:
        info["error"] = "the workload does not separate the last two micro-batches of the chain"
        return info
    info["capped"] = Job(work, corpus, "capped", b0, 1, auto=True, cap=cap).finish(left() - 5)
    info["seconds"] = round(time.monotonic() - t0, 2)
    return info
