"""What a run reports while it trains: experiment trackers through Accelerate, and quiet non-main processes.

:class:`TrackerLogger` is a loop callback that sends the per-step figures to
``accelerator.log``, so whatever trackers the Accelerator was built with
(``log_with="tensorboard"``, ``"wandb"``, ...; see Accelerate's "Experiment
trackers" guide) receive them; Accelerate logs on the main process only. It
works the same from the train job (``--with_tracking``), a script or a
notebook.
"""

from __future__ import annotations

import math
import time

import torch

from ..core.callbacks import LoopCallback
from ..core.window_figures import read_together
from ..errors import UsageError
from ..profiler.records import of_step
from ..stats import median

#: ``--report_to`` values: "all" (every tracker library installed) or one of Accelerate's tracker names.
TRACKERS = ("all", "tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio")  # accelerate 1.15's LoggerType


def check_trackers(report_to: str, logging_dir: str) -> None:
    """Fail before training when ``--report_to`` names no installed tracker library.

    Raises:
        UsageError: unknown name, or nothing installed for it (Accelerate
            would otherwise drop the request silently).
    """
    from accelerate.tracking import filter_trackers

    if report_to not in TRACKERS:
        raise UsageError("--report_to", f"unknown tracker {report_to!r}", f"use one of {list(TRACKERS)}")
    if not filter_trackers(report_to, logging_dir):
        raise UsageError("--report_to", f"no installed tracker library for {report_to!r}",
                         "pip install tensorboard (or wandb, comet_ml, ...), or drop --with_tracking")


class TrackerLogger(LoopCallback):
    """Loop callback: per optimizer step, ``accelerator.log`` of the window's figures.

    Logged at step N (the number of optimizer steps done):

    - ``train/loss``: the window's loss, nats (token mean over all processes in ``tokens`` mode);
    - ``train/learning_rate``: the first parameter group's learning rate used by that step;
    - ``train/grad_norm``: the global gradient L2 norm before clipping (only
      when the loop clips, which computes it anyway);
    - ``train/tokens_per_second``: target tokens of the window over all
      processes / wall seconds since the previous step;
    - ``train/window_tokens``: target tokens of the window, all processes.
    - ``train/gradient_accumulation_steps``: the window's K (an accumulation schedule changes it);
    - ``train/effective_batch_size``: examples per full window of that K, all
      processes (``B x K x P``; when the loop knows the dataloader's batch size).

    With a :class:`accum_kit.profiler.CommProfiler` (``profiler=``), also
    ``comm/allreduce_calls``, ``comm/allreduce_bytes`` (gradient buckets
    all-reduced by this process in that step) and ``comm/exposed_seconds`` (the
    step's synchronised backward passes minus the median no-sync backward of
    the latest window that had one: all-reduce time not hidden behind compute).
    The step's collectives are counted by the profiler's engine part
    (:meth:`accum_kit.profiler.CommProfiler.step_figures`): under FSDP2,
    ``comm/reduce_scatter_calls``, ``comm/reduce_scatter_bytes``,
    ``comm/all_gather_calls`` and ``comm/all_gather_bytes`` (the collectives of
    that step, bytes as the profiler counts them) replace the all-reduce pair;
    under HSDP also ``comm/all_reduce_calls`` and ``comm/all_reduce_bytes``
    (gradient shards all-reduced across replicas) and ``comm/shard_seconds`` /
    ``comm/replicate_seconds`` (seconds in each mesh dimension's collectives).
    Each step reads the profiler's most recent records back to the step's
    first, so the cost per step does not grow with the run.

    The figures that live on the device (loss, tokens, gradient norm) are read every
    ``logging_steps`` steps and at the end of training, all the steps since the last read
    in one copy, and then logged step by step: a GPU waits for them once per
    ``logging_steps`` windows, not on every step.

    Args:
        accelerator: built with ``log_with=...``; call ``init_trackers`` first.
        optimizer: the (prepared) optimizer, for the learning rate.
        profiler: optional CommProfiler of the same run.
        logging_steps: read and log every this many optimizer steps (every step is still logged).
    """

    def __init__(self, accelerator, optimizer, profiler=None, logging_steps: int = 1):
        self.accelerator, self.optimizer, self.profiler = accelerator, optimizer, profiler
        self.logging_steps = logging_steps
        self._t = None
        self._lr = None
        self._no_sync = None  # median no-sync backward seconds of the latest window with one
        self._pending: list[tuple] = []  # (step, seconds, host values, WindowFigures, grad norm or None)

    def on_train_begin(self, state):
        self._t = time.perf_counter()

    def on_step_begin(self, state):
        self._lr = self.optimizer.param_groups[0]["lr"]  # before the scheduler moves it

    def on_step_end(self, state):
        now = time.perf_counter()
        seconds, self._t = now - self._t, now
        values = {"train/learning_rate": self._lr, "train/gradient_accumulation_steps": state.accumulation_steps}
        if state.effective_batch_size is not None:
            values["train/effective_batch_size"] = state.effective_batch_size
        if self.profiler is not None:
            values.update(self._comm(state.step - 1))
        self._pending.append((state.step, seconds, values, state.figures, state.grad_norm))
        if state.step % self.logging_steps == 0:
            self.flush()

    def on_train_end(self, state):
        self.flush()

    def flush(self) -> None:
        """Read the pending steps' losses, tokens and gradient norms in one copy and log them, step by step.
        Every process calls it at the same steps (a sharded norm is gathered first)."""
        pending, self._pending = self._pending, []
        tensors = [_whole(g) for *_, g in pending if isinstance(g, torch.Tensor)]  # DeepSpeed's may be a float
        log = next((f.log for *_, f, _ in pending if f.log is not None), None)
        norms = iter(log.read_all(extra=tensors) if log is not None else [v[0] for v in read_together(
            [g.reshape(1) for g in tensors])])
        for step, seconds, values, figures, grad_norm in pending:
            loss, tokens = figures.read()
            values = {"train/loss": loss, **values, "train/window_tokens": tokens,
                      "train/tokens_per_second": tokens / seconds if seconds > 0 else math.nan}
            if grad_norm is not None:
                values["train/grad_norm"] = next(norms) if isinstance(grad_norm, torch.Tensor) else float(grad_norm)
            self.accelerator.log(values, step=step)

    def _comm(self, step: int) -> dict:
        calls, micro = of_step(self.profiler.calls, step), of_step(self.profiler.micro_batches, step)
        self._no_sync = median(m.backward_seconds for m in micro if not m.sync) or self._no_sync
        synced = [m.backward_seconds for m in micro if m.sync]
        exposed = sum(max(b - self._no_sync, 0.0) for b in synced) if (self._no_sync is not None and calls) else 0.0
        counted = self.profiler.step_figures(step)  # the engine's part counts the step's collectives
        return {**{f"comm/{k}": v for k, v in counted.items()}, "comm/exposed_seconds": exposed}


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain scalar tensor (a sharded one gathered: a collective on every process)."""
    from torch.distributed.tensor import DTensor

    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).reshape(())


def quiet_other_processes(accelerator) -> None:
    """One set of progress bars and warnings per job: silence datasets and transformers off the local main process.

    As transformers' ``run_clm_no_trainer.py`` does.
    """
    if not accelerator.is_local_main_process:
        import datasets
        import transformers

        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        transformers.utils.logging.set_verbosity_error()
