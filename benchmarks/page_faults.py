"""Minor page faults per forward and per backward, by accumulation policy, in the FSDP2 bench (CPU).

Run it as the bench, with the bench's flags::

    accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml benchmarks/page_faults.py \\
        --model_presets small --accumulation_steps 8 --accumulation_policies no_sync sync_each_batch \\
        --repeats 1 --steps 4 --output_dir runs/page_faults

It runs ``accum-kit bench`` unchanged except that its profiler also reads the
process's minor page faults (``getrusage(RUSAGE_SELF).ru_minflt``, pages the
kernel had to map, zero-filled, on first touch) at the start of every
micro-batch, at the end of its forward and at the end of its backward. Rank
0 prints, per policy, the mean faults per forward and per backward over the
measured windows, and writes them to ``<output_dir>/page_faults.json``.

Why: on CPU, syncing every micro-batch allocates and frees FSDP2's
unit-sized reduce-scatter buffers in every backward; glibc's ``malloc``
gives blocks above its mmap threshold back to the kernel, so later buffers
are faulted in again. Setting ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` in the environment (glibc's ``mallopt`` tunables,
https://www.gnu.org/software/libc/manual/html_node/Memory-Allocation-Tunables.html)
changes that; run this script with and without them to compare.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import accum_kit.bench.part_fsdp2 as fsdp_bench
from accum_kit.bench.bench_config import BenchConfig
from accum_kit.cli import main, parse
from accum_kit.profiler import CommProfiler


def parse_args(argv: list[str]) -> BenchConfig:
    """The bench's flags (:class:`accum_kit.bench.bench_config.BenchConfig`).

    Raises:
        accum_kit.cli.ArgumentError, accum_kit.errors.UsageError: as ``accum-kit bench`` does.
    """
    return parse(BenchConfig, argv, prog="page_faults.py")


def minor_faults() -> int:
    """The process's minor page faults so far (all threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class FaultCountingProfiler(CommProfiler):
    """The bench's profiler, also counting minor page faults per forward and backward of measured windows."""

    faults: dict[str, list[tuple[int, int]]] = defaultdict(list)  # policy -> [(forward, backward)]

    def on_micro_batch_begin(self, state):
        super().on_micro_batch_begin(state)
        self._begin = minor_faults()

    def on_forward_end(self, state):
        self._forward_end = minor_faults()
        super().on_forward_end(state)

    def on_backward_end(self, state):
        super().on_backward_end(state)
        tag = self.labels.tag or ""
        if self.labels.enabled and tag and not tag.startswith("warmup"):
            self.faults[tag.split("/")[0]].append((self._forward_end - self._begin, minor_faults() - self._forward_end))


def report(output_dir: str) -> dict:
    """Mean faults per forward and backward per policy; written atomically to ``page_faults.json``."""
    out = {policy: {"micro_batches": len(xs), "forward_mean": sum(f for f, _ in xs) / len(xs),
                    "backward_mean": sum(b for _, b in xs) / len(xs)}
           for policy, xs in FaultCountingProfiler.faults.items() if xs}
    out = {"faults": out, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
           "MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_")}
    path = Path(output_dir) / "page_faults.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as fh:
        json.dump(out, fh, indent=1)
    os.replace(fh.name, path)
    return out


if __name__ == "__main__":
    fsdp_bench.CommProfiler = FaultCountingProfiler  # the bench builds its profiler from this name
    code = main(["bench"] + sys.argv[1:])
    if code == 0 and os.environ.get("RANK", "0") == "0":  # set by accelerate launch
        for policy, f in report(parse_args(sys.argv[1:]).output_dir)["faults"].items():
            print(f"{policy}: {f['forward_mean']:.0f} minor faults per forward, {f['backward_mean']:.0f} per backward "
                  f"({f['micro_batches']} micro-batches)")
    sys.exit(code)
