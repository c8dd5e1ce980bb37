"""Worker for tests/test_faults.py (not a test module: pytest does not collect it).

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml [--max_restarts 1] \
        tests/fault_worker.py MODE OUT_DIR [DDP_TIMEOUT_SECONDS]

A small real job: ``accum_kit.build_accelerator`` + ``accum_kit.train_loop`` on a
linear model (K=2), so that the collectives that fail are the job's own (DDP's
gradient all-reduce, the window's token-count all-reduce). Torch is imported
first and the ranks meet through files before building the Accelerator, so that
a short ``DDP_TIMEOUT_SECONDS`` cannot expire while the other rank is still importing.

MODE ``run``: after 2 optimizer steps each rank writes ``OUT_DIR/rank<r>.pid``
(its pid), then trains on, slowly (50 ms per micro-batch), for up to 10 minutes:
the test stops or kills one of them.

MODE ``restart`` (launch with ``--max_restarts 1``): attempt 0
(``TORCHELASTIC_RESTART_COUNT``) trains 2 steps, then rank 1 kills itself with
``os._exit(9)`` while rank 0 waits in the next collective; attempt 1 trains 6
steps and writes ``OUT_DIR/rank<r>.json`` (attempt, pid, group size, a raw
all-reduce of the ranks, the final parameters).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import accum_kit

K, B, FEATURES = 2, 4, 8


def _meet(out_dir: Path, rank: int, world: int, attempt: str) -> None:
    """Both ranks have imported everything: start the group's clock together."""
    (out_dir / f"imported.{attempt}.rank{rank}").touch()
    while not all((out_dir / f"imported.{attempt}.rank{r}").exists() for r in range(world)):
        time.sleep(0.05)


def _loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).sum(), torch.tensor(float(y.numel()))


class _Hooks(accum_kit.LoopCallback):
    def __init__(self, out_dir: Path, rank: int, mode: str, attempt: int):
        self.out_dir, self.rank, self.mode, self.attempt = out_dir, rank, mode, attempt

    def on_micro_batch_begin(self, state):
        if self.mode == "run":
            time.sleep(0.05)

    def on_step_end(self, state):
        if state.step == 2 and self.mode == "run":
            (self.out_dir / f"rank{self.rank}.pid").write_text(str(os.getpid()))
        if state.step == 2 and self.mode == "restart" and self.attempt == 0 and self.rank == 1:
            print(f"rank 1 (pid {os.getpid()}): attempt 0 kills itself after step 2", flush=True)
            os._exit(9)


def main(mode: str, out_dir: Path, ddp_timeout: float | None) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out_dir.mkdir(parents=True, exist_ok=True)
    _meet(out_dir, rank, world, str(attempt))
    acc = accum_kit.build_accelerator(K, ddp_timeout=ddp_timeout)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4000, FEATURES), torch.randn(4000, 1))
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, dl = acc.prepare(model, optimizer, DataLoader(data, batch_size=B))
    steps = {"run": 3000, "restart": 2 if attempt == 0 else 6}[mode]  # run: ~5 min at 50 ms per micro-batch
    result = accum_kit.train_loop(acc, model, optimizer, dl, max_train_steps=steps, loss_fn=_loss,
                                  callbacks=[_Hooks(out_dir, rank, mode, attempt)], progress=False)
    if mode == "restart" and attempt == 0:
        acc.wait_for_everyone()  # rank 0 waits here for rank 1, which is gone
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    record = {
        "attempt": attempt, "pid": os.getpid(), "group_size": dist.get_world_size(),
        "num_processes": acc.num_processes, "distributed_type": str(acc.distributed_type),
        "allreduce_rank_sum": t.item(), "steps": result.optimizer_steps, "train_loss": result.train_loss,
        "params": [p.detach().flatten().tolist() for p in acc.unwrap_model(model).parameters()],
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    acc.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else None))
