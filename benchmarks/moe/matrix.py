"""The train job on moe_tiny under every engine, policy and precision: does it run, and does it agree with DDP?

    python benchmarks/moe/matrix.py --work /tmp/moe_matrix --out benchmarks/moe/matrix.json

Cells: DDP; FSDP2 with no_sync, no_sync_no_reshard_after_backward, no_sync_no_reshard, sync_each_batch;
HSDP (4 processes, 2 x 2) with those and reduce_scatter_each_batch; DeepSpeed ZeRO 1/2/3; each in fp32 and
bf16 (``--mixed_precision``). Each cell: 4 optimizer steps, K=2, micro-batch 2, ``--router_aux_loss_scope
window``. Recorded: the exit code, the losses, and their largest relative difference from DDP's run of the
same precision (2 processes; HSDP's 4 processes read twice the data, so they are compared with each other).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import job_helpers as jh  # noqa: E402
from accum_kit.outputs import atomic_write_json  # noqa: E402

FSDP = ("no_sync", "no_sync_no_reshard_after_backward", "no_sync_no_reshard", "sync_each_batch")
CELLS = [("ddp", "cpu_ddp.yaml", None, [])] + \
    [("fsdp2", "cpu_fsdp.yaml", p, []) for p in FSDP] + \
    [("hsdp", "cpu_hsdp.yaml", p, []) for p in (*FSDP, "reduce_scatter_each_batch")] + \
    [(f"zero{s}", "cpu_deepspeed.yaml", None, ["--zero_stage", str(s)]) for s in (1, 2, 3)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = jh.write_corpus(args.work / "corpus.txt")
    rows = []
    for precision in ("no", "bf16"):
        for engine, config, policy, launcher in CELLS:
            name = f"{engine}_{policy or 'default'}_{precision}"
            out = args.work / name
            flags = ["--accumulation_policy", policy] if policy else []
            cmd = jh.accelerate_launch_cmd(
                "--mixed_precision", precision, *launcher, "-m", "accum_kit", "train", "--train_file", corpus,
                "--model_preset", "moe_tiny", "--block_size", "64", "--max_train_steps", "4",
                "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                "--max_eval_samples", "8", "--router_aux_loss_scope", "window", "--output_dir", out, *flags,
                config=REPO / "accelerate_configs" / config, num_processes=4 if engine == "hsdp" else 2)
            res = jh.run(cmd, jh.clean_env(HF_DATASETS_CACHE=str(args.work / "hf_cache")), args.work / "logs", name,
                         timeout=600)
            row = {"engine": engine, "policy": policy, "precision": precision, "exit_code": res.returncode}
            if res.returncode == 0:
                s = json.loads((out / "train_summary.json").read_text())
                row.update(train_loss=s["train_loss"], tokens_per_expert_last=s["router"]["windows"][-1]["tokens_per_expert"])
            else:
                row["error"] = [l for l in res.describe().splitlines() if "rror" in l][:3]
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("engine", "policy", "precision", "exit_code", "train_loss")}),
                  flush=True)
    for row in rows:
        ref = next((r for r in rows if r["precision"] == row["precision"] and r.get("train_loss")
                    and (r["engine"] == "hsdp") == (row["engine"] == "hsdp")), None)
        if ref is not None and row.get("train_loss"):
            row["max_rel_diff_from_reference"] = max(abs(a - b) / abs(b) for a, b in zip(row["train_loss"], ref["train_loss"]))
            row["reference"] = f"{ref['engine']} {ref['policy'] or ''}".strip()
    atomic_write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
