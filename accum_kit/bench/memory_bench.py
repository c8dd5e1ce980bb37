"""The memory benchmark: the measured peak per process against the predicted one, row by row (a command, not a test).

Usage::

    python -m accum_kit.bench.memory_bench [--model_preset small] [--block_size 256]
        [--per_device_train_batch_size 4] [--gradient_accumulation_steps 2] [--max_train_steps 3]
        [--rows ddp:no_sync,ddp:sync_each_batch,fsdp2:sync_each_batch,fsdp2:no_sync_no_reshard]
        [--fused_linear_cross_entropy auto] [--lora_r 8 [--lora_dropout 0.05]] [--output memory_bench.json]

Each row is one ``accelerate launch`` of the train job on 2 CPU processes (DDP: accelerate_configs/cpu_ddp.yaml,
FSDP2: cpu_fsdp.yaml) with ``--accumulation_policy`` and, for the checkpointing half of the rows,
``--gradient_checkpointing``, and the train job's ``--fused_linear_cross_entropy`` (default ``auto``, the job's
default: the loss in the output layer; ``off``: from the logits). From each run's ``train_summary.json["memory"]`` it prints per row: the measured
peak per process (``VmHWM``), the predicted one (:func:`accum_kit.engines.activation_memory.peak_parts`: the
resident set before training + gradients + optimizer state + gathered parameters + activations + logits), their
ratio, and the training's own part (peak minus the resident set before training, measured and predicted); then,
per engine and policy, the memory checkpointing saves, measured ((peak - before) without minus with) against
predicted (the activations' difference). ``--lora_r R`` runs every row with LoRA adapters of rank R
(``--use_peft --lora_r R --lora_alpha 2R``, peft's default targets) instead of full fine-tuning.

glibc's allocator keeps freed memory of up to 32 MB per block in the heap after the first such block is freed
(its dynamic mmap threshold, ``mallopt(3)``), so the resident peak then grows from step to step with
fragmentation that no tensor accounts for. The rows run with ``MALLOC_MMAP_THRESHOLD_=131072`` (a fixed
threshold: every tensor above 128 KiB is its own mapping, returned when freed), so that ``VmHWM`` measures the
live peak as ``torch.cuda.max_memory_allocated`` does on a GPU; ``--default_malloc`` runs without it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"ddp": "accelerate_configs/cpu_ddp.yaml", "fsdp2": "accelerate_configs/cpu_fsdp.yaml"}
DEFAULT_ROWS = "ddp:no_sync,ddp:sync_each_batch,fsdp2:sync_each_batch,fsdp2:no_sync_no_reshard"
MIB = 2 ** 20


def run_row(engine: str, policy: str, checkpointing: bool, args, workdir: Path) -> dict:
    """One launch of the train job; returns its ``memory`` block and the seconds it took.

    Raises:
        RuntimeError: the launch failed (its last output lines in the message).
    """
    out = workdir / f"{engine}_{policy}_{'ckpt' if checkpointing else 'full'}"
    launcher = Path(sys.executable).with_name("accelerate")
    cmd = [str(launcher), "launch", "--config_file", str(REPO / CONFIGS[engine]), "--num_processes", "2",
           "--main_process_port", str(args.port), "-m", "accum_kit", "train",
           "--model_preset", args.model_preset, "--block_size", str(args.block_size),
           "--per_device_train_batch_size", str(args.per_device_train_batch_size),
           "--gradient_accumulation_steps", str(args.gradient_accumulation_steps),
           "--max_train_steps", str(args.max_train_steps), "--accumulation_policy", policy,
           "--max_eval_samples", "2", "--per_device_eval_batch_size", "1",
           "--fused_linear_cross_entropy", args.fused_linear_cross_entropy, "--output_dir", str(out)]
    if checkpointing:
        cmd.append("--gradient_checkpointing")
    if args.lora_r:
        cmd += ["--use_peft", "--lora_r", str(args.lora_r), "--lora_alpha", str(2 * args.lora_r),
                "--lora_dropout", str(args.lora_dropout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if not args.default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n" + done.stderr[-3000:])
    memory = json.loads((out / "train_summary.json").read_text())["memory"]
    loss = json.loads((out / "train_summary.json").read_text()).get("loss")
    return {"engine": engine, "policy": policy, "checkpointing": checkpointing, "memory": memory, "loss": loss,
            "seconds": time.monotonic() - start}


def row_figures(row: dict) -> dict:
    """Measured and predicted peak (mean over processes, bytes), their ratio, and the training's part of each."""
    m = row["memory"]
    peaks, before = m["process_peak_bytes_by_rank"], m["resident_before_training_bytes_by_rank"]
    predicted = m.get("predicted_peak_bytes_by_rank") or [None] * len(peaks)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    measured, pred, base = mean(peaks), mean(predicted), mean(before)
    return {"measured": measured, "predicted": pred, "ratio": measured / pred, "before": base,
            "measured_training": measured - base, "predicted_training": pred - base,
            "ratio_by_rank": m.get("peak_measured_over_predicted_by_rank"),
            "parts": m.get("predicted_peak_by_part")}


def savings(rows: list[dict]) -> list[dict]:
    """Per engine and policy with both halves: the bytes checkpointing saves, measured and predicted."""
    by = {(r["engine"], r["policy"], r["checkpointing"]): row_figures(r) for r in rows}
    out = []
    for (engine, policy, ckpt), full in by.items():
        on = by.get((engine, policy, True))
        if ckpt or on is None:
            continue
        measured = full["measured_training"] - on["measured_training"]
        predicted = full["predicted_training"] - on["predicted_training"]
        out.append({"engine": engine, "policy": policy, "measured": measured, "predicted": predicted,
                    "ratio": measured / predicted if predicted else None})
    return out


def format_table(rows: list[dict]) -> str:
    """The printed table: one line per row, then the savings."""
    lines = [f"{'engine':6} {'policy':20} {'ckpt':4} {'measured MiB':>12} {'predicted MiB':>13} {'ratio':>6} "
             f"{'before MiB':>10} {'training: meas.':>15} {'pred.':>7} {'ratio':>6}"]
    for r in rows:
        f = row_figures(r)
        lines.append(f"{r['engine']:6} {r['policy']:20} {'on' if r['checkpointing'] else 'off':4} "
                     f"{f['measured'] / MIB:12.1f} {f['predicted'] / MIB:13.1f} {f['ratio']:6.3f} "
                     f"{f['before'] / MIB:10.1f} {f['measured_training'] / MIB:15.1f} "
                     f"{f['predicted_training'] / MIB:7.1f} {f['measured_training'] / f['predicted_training']:6.3f}")
    lines.append("")
    lines.append("checkpointing saves (MiB, training's part without minus with):")
    for s in savings(rows):
        lines.append(f"  {s['engine']:6} {s['policy']:20} measured {s['measured'] / MIB:8.1f}  predicted "
                     f"{s['predicted'] / MIB:8.1f}  ratio {s['ratio']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m accum_kit.bench.memory_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model_preset", default="small")
    p.add_argument("--block_size", type=int, default=256)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--max_train_steps", type=int, default=3)
    p.add_argument("--rows", default=DEFAULT_ROWS, help="engine:policy pairs, comma-separated")
    p.add_argument("--checkpointing", default="off,on", help="off, on or off,on")
    p.add_argument("--default_malloc", action="store_true", help="keep glibc's dynamic mmap threshold")
    p.add_argument("--fused_linear_cross_entropy", default="auto", choices=("auto", "chunked", "torch", "off"),
                   help="the train job's causal-LM loss (default auto: in the output layer; off: from the logits)")
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--lora_r", type=int, default=None, help="LoRA adapters of this rank on every row (--use_peft)")
    p.add_argument("--lora_dropout", type=float, default=0.05, help="with --lora_r: dropout (TRL's default 0.05)")
    p.add_argument("--output", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in args.rows.split(","):
            engine, policy = pair.split(":")
            for ckpt in args.checkpointing.split(","):
                row = run_row(engine, policy, ckpt == "on", args, Path(tmp))
                rows.append(row)
                f = row_figures(row)
                print(f"{engine} {policy} checkpointing {ckpt}: measured {f['measured'] / MIB:.1f} MiB, predicted "
                      f"{f['predicted'] / MIB:.1f} MiB, ratio {f['ratio']:.3f} ({row['seconds']:.0f} s)", flush=True)
    print(format_table(rows))
    if args.output:
        from ..outputs import atomic_write_json

        atomic_write_json(args.output, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
