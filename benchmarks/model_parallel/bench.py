"""Tensor parallel on 4 CPU processes: step time of dp x tp against data parallelism alone, and what no_sync saves.

    python benchmarks/model_parallel/bench.py --work /tmp/mp_bench --out benchmarks/model_parallel/results.json

The train job on the ``llama_small`` preset, K=8, the same global batch of 32 sequences (``--block_size``
tokens) in every arm:

- ``dp``: FSDP2 over 4 data-parallel processes (accelerate_configs/cpu_fsdp.yaml --num_processes 4),
  micro-batch 1;
- ``tp``: FSDP2 over 2 data-parallel processes x tensor parallel 2 (accelerate_configs/cpu_tp.yaml),
  micro-batch 2, ``no_sync``;
- ``tp_sync``: the same with ``--accumulation_policy sync_each_batch`` (gradients reduce-scattered on
  every micro-batch instead of once per window).

The arms run one after another in pairs whose order alternates (AB, BA, ...), so both see the same load
(the machine is shared and its load changes by tens of percent within minutes). Per run: the median
seconds per optimizer step after ``--warmup`` steps; per comparison the ratio of each pair and the 95 %
t-interval of the ratio on the log scale (accum_kit.stats.ratio_interval). The losses of ``tp`` and
``tp_sync`` must be the same run's (same update), and ``dp``'s within 1e-5 relative (the same big batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import job_helpers as jh  # noqa: E402
from accum_kit.stats import median, ratio_interval  # noqa: E402

ARMS = {
    "dp": ("cpu_fsdp.yaml", ["--num_processes", "4"], 1, []),
    "tp": ("cpu_tp.yaml", [], 2, []),
    "tp_sync": ("cpu_tp.yaml", [], 2, ["--accumulation_policy", "sync_each_batch"]),
}
COMPARISONS = (("tp", "dp"), ("tp_sync", "tp"))


def run_arm(work: Path, arm: str, i: int, args, corpus: Path) -> dict:
    config, launcher, batch, extra = ARMS[arm]
    out = work / f"{arm}_{i}"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / config),
           *launcher, "--main_process_port", str(jh.free_port()), "-m", "accum_kit", "train", "--train_file", str(corpus),
           "--model_preset", "llama_small", "--block_size", str(args.block_size), "--max_train_steps", str(args.steps),
           "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", "8", "--num_warmup_steps", "0",
           "--max_eval_samples", "8", "--per_device_eval_batch_size", "2", "--logging_steps", "100",
           "--output_dir", str(out), *extra]
    res = jh.run(cmd, jh.clean_env(HF_DATASETS_CACHE=str(work / "hf_cache")), work / "logs", f"{arm}_{i}",
                 timeout=args.timeout)
    if res.returncode != 0:
        raise SystemExit(f"{arm} run {i} failed:\n{res.describe()}")
    summary = json.loads((out / "train_summary.json").read_text())
    steady = summary["step_seconds"][args.warmup:]
    return {"arm": arm, "pair": i, "median_step_seconds": median(steady), "step_seconds": summary["step_seconds"],
            "train_loss": summary["train_loss"], "effective_batch_size": summary["effective_batch_size"],
            "world_size": summary["world_size"], "data_parallel_size": summary.get("data_parallel_size")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    if args.pairs < 2 or args.steps <= args.warmup:
        raise SystemExit("--pairs must be >= 2 and --steps > --warmup")
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = jh.write_corpus(args.work / "corpus.txt")
    runs = []
    for i in range(args.pairs):
        order = ["dp", "tp", "tp_sync"] if i % 2 == 0 else ["tp_sync", "tp", "dp"]
        for arm in order:
            runs.append(run_arm(args.work, arm, i, args, corpus))
            print(f"pair {i} {arm}: {runs[-1]['median_step_seconds']:.3f} s/step", flush=True)
    by = {(r["arm"], r["pair"]): r for r in runs}
    result = {"settings": vars(args) | {"work": str(args.work), "out": str(args.out)}, "runs": runs,
              "load_average_end": os.getloadavg(), "comparisons": {}}
    for a, b in COMPARISONS:
        ratios = [by[(a, i)]["median_step_seconds"] / by[(b, i)]["median_step_seconds"] for i in range(args.pairs)]
        result["comparisons"][f"{a}_over_{b}"] = {"ratios": ratios, **ratio_interval(ratios)}
    loss = {arm: by[(arm, 0)]["train_loss"] for arm in ARMS}
    result["losses_equal"] = {
        "tp_vs_tp_sync_max_rel": max(abs(x - y) / abs(y) for x, y in zip(loss["tp"], loss["tp_sync"])),
        "tp_vs_dp_max_rel": max(abs(x - y) / abs(y) for x, y in zip(loss["tp"], loss["dp"]))}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)
    for name, c in result["comparisons"].items():
        print(f"{name}: {c}")
    print(result["losses_equal"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
