"""Worker for tests/test_faults.py (not a test module: pytest does not collect it).

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml \
        tests/fault_worker.py OUT_DIR [DDP_TIMEOUT_SECONDS]

A small real job: ``accum_kit.build_accelerator`` + ``accum_kit.train_loop`` on a
linear model (K=2), so that the collectives that fail are the job's own (DDP's
gradient all-reduce, the window's token-count all-reduce). Torch is imported
first and the ranks meet through files before building the Accelerator, so that
a short ``DDP_TIMEOUT_SECONDS`` cannot expire while the other rank is still importing.

After 2 optimizer steps each rank writes ``OUT_DIR/rank<r>.pid`` (its pid), then
trains on, slowly (50 ms per micro-batch), for up to 5 minutes: the test stops
or kills one of them. A rank that gets through writes ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import accum_kit

K, B, FEATURES = 2, 4, 8


def _meet(out_dir: Path, rank: int, world: int) -> None:
    """Both ranks have imported everything: start the group's clock together."""
    (out_dir / f"imported.rank{rank}").touch()
    while not all((out_dir / f"imported.rank{r}").exists() for r in range(world)):
        time.sleep(0.05)


def _loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).sum(), torch.tensor(float(y.numel()))


class _Hooks(accum_kit.LoopCallback):
    def __init__(self, out_dir: Path, rank: int):
        self.out_dir, self.rank = out_dir, rank

    def on_micro_batch_begin(self, state):
        time.sleep(0.05)

    def on_step_end(self, state):
        if state.step == 2:
            (self.out_dir / f"rank{self.rank}.pid").write_text(str(os.getpid()))


def main(out_dir: Path, ddp_timeout: float | None) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_dir.mkdir(parents=True, exist_ok=True)
    _meet(out_dir, rank, world)
    acc = accum_kit.build_accelerator(K, ddp_timeout=ddp_timeout)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4000, FEATURES), torch.randn(4000, 1))
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, dl = acc.prepare(model, optimizer, DataLoader(data, batch_size=B))
    # ~5 min at 50 ms per micro-batch: the test signals a worker long before.
    result = accum_kit.train_loop(acc, model, optimizer, dl, max_train_steps=3000, loss_fn=_loss,
                                  callbacks=[_Hooks(out_dir, rank)], progress=False)
    acc.wait_for_everyone()
    record = {"pid": os.getpid(), "steps": result.optimizer_steps}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    acc.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else None))
