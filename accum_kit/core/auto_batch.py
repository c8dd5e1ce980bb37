"""``--auto_find_batch_size`` with the effective batch held fixed: on an allocation failure the micro-batch
shrinks and K grows by the same factor, exactly.

transformers' Trainer (``--auto_find_batch_size``, Accelerate's ``find_executable_batch_size``) halves the
micro-batch and keeps K, so the effective batch ``B x K x W`` silently halves too. Here the re-split rule is

    B' = B / p,  K' = K x p,  p = the smallest prime factor of B

(halving for an even B; an odd B is divided by its smallest prime, e.g. 12 -> 6 -> 3 -> 1, 9 -> 3 -> 1, 7 -> 1),
so ``B' x K' = B x K``. Accelerate's sharded sampler gives process r global micro-batch ``j x W + r`` of the
seeded permutation, so window w still covers the same ``B x K x W`` consecutive examples, and the token-normalised
window loss (:mod:`accum_kit.core.loss`) makes its update the one B' would have given from the start (up to the
order of floating-point sums). Under an ``--accumulation_schedule`` every K of the schedule is multiplied by p.

How a run changes its micro-batch: nothing in a process that failed an allocation is trusted (its gradients are
half accumulated, its optimizer may be half stepped), so the process does not recover in place. The rank that
fails writes the new ``(B', K')`` to :data:`STATE_FILE` in ``--output_dir`` (atomically), prints one line and
exits with :data:`RESPLIT_EXIT_CODE` without running any collective; its peers fail in their next collective
("connection closed") or are stopped by torchrun's agent, which restarts the group (``accelerate launch
--max_restarts N``). The restarted workers read the state file, resume from the newest complete checkpoint (or
start afresh) with ``(B', K')``: the checkpoint's data position converts exactly (micro-batches done x p;
:func:`accum_kit.core.checkpoint.check_resumable` with ``resplit=True``). One process without torchrun re-executes
itself (``os.execv``; :data:`ATTEMPT_ENV` counts the attempts). A multi-process launch that cannot restart is
refused at start.
"""

from __future__ import annotations

import json
import logging
import gc
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from .callbacks import LoopCallback

FLAG = "--auto_find_batch_size"
#: The file in --output_dir that carries the micro-batch from a failed attempt to the next.
STATE_FILE = "auto_find_batch_size.json"
#: Exit code of the rank that failed an allocation (the group is to restart with a smaller micro-batch).
RESPLIT_EXIT_CODE = 85
#: Attempt counter of a one-process run that re-executes itself (no torchrun).
ATTEMPT_ENV = "ACCUM_KIT_AUTO_BATCH_ATTEMPT"

_CPU_BYTES = re.compile(r"you tried to allocate (\d+) bytes")
_CUDA_BYTES = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def smallest_prime_factor(n: int) -> int:
    """The smallest prime dividing ``n`` (>= 2); ``n`` itself when it is prime."""
    if n < 2:
        raise ValueError(f"{n} has no prime factor")
    f = 2
    while f * f <= n:
        if n % f == 0:
            return f
        f += 1
    return n


def resplit(batch: int, k: int) -> tuple[int, int, int]:
    """``(B', K', p)``: the next smaller micro-batch of ``batch`` examples with K grown by the same factor p."""
    p = smallest_prime_factor(batch)
    return batch // p, k * p, p


def is_allocation_failure(exc: BaseException) -> bool:
    """True for a failed memory allocation: ``torch.OutOfMemoryError`` (CUDA), ``MemoryError``, or the RuntimeError of
    torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory"); never for a collective's failure."""
    import torch

    seen = 0
    while exc is not None and seen < 4:  # an allocation failure re-raised by a wrapper keeps it as its cause
        if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
            return True
        dist_error = getattr(torch.distributed, "DistError", ())
        if isinstance(exc, RuntimeError) and not isinstance(exc, dist_error):
            text = str(exc)
            if "can't allocate memory" in text or "CUDA out of memory" in text:
                return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def requested_bytes(exc: BaseException) -> int | None:
    """Bytes the failed allocation asked for, parsed from torch's message (CPU or CUDA); None if it does not say."""
    text = str(exc)
    if m := _CPU_BYTES.search(text):
        return int(m.group(1))
    if m := _CUDA_BYTES.search(text):
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    return None


def restart_count() -> int:
    """This attempt's number: torchrun's ``TORCHELASTIC_RESTART_COUNT``, else :data:`ATTEMPT_ENV` (re-exec), else 0."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(ATTEMPT_ENV) or "0"
    return int(value) if value.isdigit() else 0


def _pair(batch: int, k: int) -> dict:
    return {"per_device_train_batch_size": batch, "gradient_accumulation_steps": k}


class PhaseWatch(LoopCallback):
    """Where the loop is (forward, backward, optimizer step ...) and when its steps ended, for the failure line.

    Attributes: ``phase`` (str), ``micro_batch`` (micro-batches done on this process), ``step`` (optimizer steps
    done), ``began`` (wall-clock seconds, ``time.time()``, when the loop started), ``began_step`` (optimizer steps
    done then: the resumed step), ``step_ended`` (optimizer step -> wall-clock seconds it ended).

    It also stops this process before a micro-batch when another rank of this attempt has failed an allocation
    (``state_file``'s modification time no longer ``since``, the one seen when the attempt began; no clocks are
    compared, so a shared file system's clock does not matter): a peer computing under ``no_sync`` would otherwise
    run on to its next collective, up to a whole window (torchrun's SIGTERM only asks the checkpointer for a save at
    the window's end). One ``stat`` per micro-batch.
    """

    def __init__(self, state_file: Path | None = None, since: float | None = None):
        self.phase, self.micro_batch, self.step, self.began, self.step_ended = "start-up", 0, 0, None, {}
        self.began_step, self.state_file, self.since = 0, state_file, since

    def on_train_begin(self, state):
        self.began, self.step, self.micro_batch, self.phase = time.time(), state.step, state.micro_step, "data loading"
        self.began_step = state.step

    def on_micro_batch_begin(self, state):
        self.phase, self.micro_batch = "forward", state.micro_step
        if self.state_file is not None and _mtime(self.state_file) not in (self.since, float("-inf")):
            print(f"auto_find_batch_size: stopping this process (micro-batch {state.micro_step}): another rank failed "
                  f"an allocation and wrote {self.state_file}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(RESPLIT_EXIT_CODE)

    def on_forward_end(self, state):
        self.phase = "backward"

    def on_backward_end(self, state):
        self.phase = "optimizer step" if state.boundary else "data loading"

    def on_step_begin(self, state):
        self.phase = "optimizer step"

    def on_step_end(self, state):
        self.step, self.phase = state.step, "after the optimizer step (callbacks, checkpoint)"
        self.step_ended[state.step] = time.time()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("-inf")


@dataclass
class AutoBatch:
    """The micro-batch a run settled on and the attempts that led there (train_summary.json's auto_find_batch_size).

    Attributes:
        output_dir: where :data:`STATE_FILE` lives.
        started_at: ``(B, K)`` the flags asked for.
        batch, k: ``(B, K)`` this attempt runs.
        attempts: one dict per failed attempt: its B and K, the rank, phase, micro-batch, optimizer step and bytes
            of the failure, ``failed_at`` (wall-clock s), ``wasted_seconds`` (its work since its resume point, lost),
            ``restart_seconds`` (from the failure to the next attempt's first micro-batch).
    """

    output_dir: Path
    started_at: tuple[int, int]
    batch: int
    k: int
    attempts: list = field(default_factory=list)
    watch: PhaseWatch | None = None

    def __post_init__(self):  # a state file written after this moment is this attempt's
        self.watch = PhaseWatch(Path(self.output_dir) / STATE_FILE, _mtime(Path(self.output_dir) / STATE_FILE))

    @property
    def factor(self) -> int:
        """p of all re-splits so far: ``B_started / B``."""
        return self.started_at[0] // self.batch

    def summary(self) -> dict:
        """``train_summary.json["auto_find_batch_size"]``: ``started_at`` and ``settled`` (B and K), ``attempts``,
        ``restarts`` and ``seconds_lost`` (s: per failed attempt its wasted work plus the restart)."""
        self._train_began()
        lost = sum((a.get("wasted_seconds") or 0) + (a.get("restart_seconds") or 0) for a in self.attempts)
        return {"started_at": _pair(*self.started_at), "attempts": self.attempts, "settled": _pair(self.batch, self.k),
                "restarts": len(self.attempts), "seconds_lost": round(lost, 3)}

    def _state(self, batch: int, k: int, gave_up: str | None = None) -> dict:
        return {"started_at": _pair(*self.started_at), "current": _pair(batch, k), "attempts": self.attempts,
                "gave_up": gave_up}

    def _train_began(self) -> None:
        """The previous failure's restart time: from the failure to this attempt's first micro-batch."""
        if self.attempts and self.attempts[-1].get("restart_seconds") is None and self.watch.began is not None:
            self.attempts[-1]["restart_seconds"] = round(self.watch.began - self.attempts[-1]["failed_at"], 3)

    def failed(self, exc: BaseException, rank: int, saved: list) -> "BatchTooLarge":
        """Record an allocation failure of this process: write the state file, print one line, return the exception
        to raise (the caller exits without any collective).

        ``saved``: the checkpoints this attempt saved (folders ``step_<N>``): the work since the newest is lost.

        Raises:
            UsageError: the micro-batch was already 1 example (nothing smaller to try); the state file then says so,
                and restarted workers refuse at once.
        """
        now, watch = time.time(), self.watch
        self._train_began()
        asked = requested_bytes(exc)
        steps = [int(p.name.split("_")[1]) for p in saved if p.name.startswith("step_")]
        since = watch.step_ended.get(max(steps, default=watch.began_step), watch.began or now)
        record = {**_pair(self.batch, self.k), "rank": rank, "where": watch.phase, "micro_batch": watch.micro_batch,
                  "optimizer_step": watch.step, "bytes": asked, "failed_at": round(now, 3),
                  "wasted_seconds": round(now - since, 3), "restart_seconds": None}
        self.attempts.append(record)
        needed = f"{asked} bytes" if asked is not None else "memory (the error did not say how much)"
        where = (f"the {watch.phase} (micro-batch {watch.micro_batch} of this process, from 0; {watch.step} optimizer "
                 "steps done)")
        if self.batch == 1:
            problem = (f"even a micro-batch of 1 example does not fit: rank {rank} failed to allocate {needed} in "
                       f"{where}")
            error = UsageError(FLAG, problem, "lower --block_size, turn on --gradient_checkpointing, or run on more "
                                              "memory or more processes")
            _write(self.output_dir, self._state(self.batch, self.k, gave_up=str(error)))
            raise error
        batch, k, p = resplit(self.batch, self.k)
        _write(self.output_dir, self._state(batch, k))
        line = (f"auto_find_batch_size: rank {rank} failed to allocate {needed} in {where} at "
                f"per_device_train_batch_size {self.batch} x gradient_accumulation_steps {self.k}; next attempt: "
                f"{batch} x {k} (p={p}, the same effective batch)")
        print(line, file=sys.stderr, flush=True)
        return BatchTooLarge(line, batch, k)


class BatchTooLarge(Exception):
    """This process failed an allocation; :data:`STATE_FILE` holds the next ``(batch, k)``.

    :func:`exit_for_retry` turns it into the restart (torchrun) or the re-exec (one process).
    """

    def __init__(self, line: str, batch: int, k: int):
        super().__init__(line)
        self.batch, self.k = batch, k


def _write(output_dir: Path, state: dict) -> None:
    from ..outputs import atomic_write_json

    atomic_write_json(Path(output_dir) / STATE_FILE, state)


def settle(cfg, world_size: int, restarts_possible: bool, resume_path) -> AutoBatch:
    """The ``(B, K)`` this attempt runs, written into ``cfg`` (and its schedule scaled by the same factor).

    From the flags; after a restart (:func:`restart_count` > 0) from :data:`STATE_FILE`; when resuming, from the
    checkpoint if it holds a smaller re-split of the flags (a resume keeps what an earlier attempt settled on). A
    first attempt deletes a state file left by an earlier run.

    Args:
        cfg: the train job's :class:`accum_kit.job.config.TrainConfig` (``per_device_train_batch_size``,
            ``gradient_accumulation_steps``, ``accumulation_schedule`` are changed in place).
        world_size: processes launched (``WORLD_SIZE``).
        restarts_possible: torchrun may restart the workers (:func:`accum_kit.launch.elastic_restarts_possible`).
        resume_path: the checkpoint this attempt resumes from, or None.

    Raises:
        UsageError: several processes that cannot be restarted; an earlier attempt found that even one example
            does not fit; a state file or checkpoint whose micro-batch is not a re-split of the flags.
    """
    from .settings import resolve_accumulation_steps

    log = logging.getLogger(__name__)

    if world_size > 1 and not restarts_possible:
        raise UsageError(FLAG, f"a {world_size}-process launch takes a smaller micro-batch by restarting its workers, "
                               "but this launch cannot restart them (no --max_restarts)",
                         "launch with accelerate launch --max_restarts N (N >= the halvings you allow, e.g. 3)")
    k0 = resolve_accumulation_steps(cfg.gradient_accumulation_steps)
    auto = AutoBatch(Path(cfg.output_dir), (cfg.per_device_train_batch_size, k0), cfg.per_device_train_batch_size, k0)
    file = Path(cfg.output_dir) / STATE_FILE
    if restart_count() == 0:
        if file.exists() and int(os.environ.get("RANK", "0") or 0) == 0:
            file.unlink()  # an earlier run's; every failure happens after the first collective of the job
    elif file.exists():
        state = json.loads(file.read_text())
        if state.get("gave_up"):
            raise UsageError(FLAG, f"an earlier attempt of this run failed: {state['gave_up']}", "see above")
        if tuple(state["started_at"].values()) == auto.started_at:
            auto.attempts = state["attempts"]
            _adopt(auto, state["current"]["per_device_train_batch_size"],
                   state["current"]["gradient_accumulation_steps"], str(file))
    if resume_path is not None:  # K is then checked against the checkpoint's (its schedule's K at its step)
        b = json.loads((Path(resume_path) / "loop_state.json").read_text()).get("per_device_batch_size")
        if b and b < auto.batch and auto.started_at[0] % b == 0:
            _adopt(auto, b, auto.started_at[1] * (auto.started_at[0] // b), str(resume_path))
    p = auto.factor
    if int(os.environ.get("RANK", "0") or 0) == 0:
        log.info("auto_find_batch_size: attempt %d runs per_device_train_batch_size %d x gradient_accumulation_steps "
                 "%d (started at %d x %d)", restart_count(), auto.batch, auto.k, *auto.started_at)
    if p > 1:
        cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps = auto.batch, auto.k
        if cfg.accumulation_schedule:
            cfg.accumulation_schedule = {step: k * p for step, k in cfg.accumulation_schedule.items()}
        if os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):  # the one-K rule: flag and launcher agree
            os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(auto.k)
    return auto


def _adopt(auto: AutoBatch, batch: int, k: int, source: str) -> None:
    b0, k0 = auto.started_at
    if batch < 1 or b0 % batch or batch * k != b0 * k0:
        raise UsageError(FLAG, f"{source} holds per_device_train_batch_size {batch} x gradient_accumulation_steps "
                               f"{k}, which is no re-split of the flags' {b0} x {k0}",
                         "pass the flags the run started with, or another --output_dir")
    auto.batch, auto.k = batch, k


def resplit_factor(path, saved: dict, k: int, batch: int | None, examples: int | None) -> int:
    """p > 1 when this run's ``(batch, k)`` is checkpoint ``path``'s micro-batch / p and its K x p; else 1.

    Raises:
        UsageError: a re-split checkpoint saved with another number of training examples (``examples``).
    """
    b_saved, k_saved = saved.get("per_device_batch_size"), saved.get("gradient_accumulation_steps")
    if not (batch and b_saved and k_saved) or b_saved <= batch or b_saved % batch or k_saved * (b_saved // batch) != k:
        return 1
    if examples is not None and saved.get("examples_per_epoch") not in (None, examples):
        raise UsageError("--train_file", f"{path} was saved with {saved['examples_per_epoch']} training examples "
                         f"but this run has {examples}", "resume with the same data flags "
                         "(--train_file/--dataset_name, --max_train_samples, --block_size)")
    return b_saved // batch


def in_resplit_units(saved: dict) -> None:
    """Multiply a checkpoint's micro-batch counts (data position, micro-batches done, K, the per-step K history) by
    ``saved["resplit"]`` (p), in place: counted in this run's micro-batches, they cover the same examples."""
    p = saved.get("resplit", 1)
    if p > 1:
        for key in ("batches_done_in_epoch", "micro_batches", "gradient_accumulation_steps"):
            saved[key] *= p
        if saved.get("step_accumulation_steps"):
            saved["step_accumulation_steps"] = [k * p for k in saved["step_accumulation_steps"]]


def for_job(cfg, resume) -> AutoBatch | None:
    """The train job's :func:`settle` (None without ``--auto_find_batch_size``), with ``resume``, the checkpoint
    the job will resume from (``--resume_from_checkpoint``, else after a restart the newest in ``--output_dir``;
    None: none). Call before building the Accelerator (it takes K).

    Raises:
        UsageError: see :func:`settle`.
    """
    if not cfg.auto_find_batch_size:
        return None
    from ..launch import elastic_restarts_possible

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return settle(cfg, world, elastic_restarts_possible(), resume)


@contextmanager
def on_failure(auto: AutoBatch | None, rank: int, checkpointer):
    """Around the train loop: an allocation failure becomes :meth:`AutoBatch.failed`'s :class:`BatchTooLarge`
    (nothing on the way runs a collective); any other exception, or any exception without ``auto``, passes."""
    # 1 MiB kept aside and given back on a failure, so that writing the state file and the message still finds
    # memory when the process is at its limit (seen under an address-space limit: a MemoryError in json.dumps)
    failure, reserve = None, bytearray(2**20) if auto is not None else None
    try:
        yield
    except Exception as exc:
        if auto is None or not is_allocation_failure(exc):
            raise
        failure = exc
    if failure is not None:
        del reserve
        failure.__traceback__ = None  # its frames hold the failed step's tensors
        gc.collect()
        raise auto.failed(failure, rank, checkpointer.saved) from None


def watch(auto: AutoBatch | None) -> list:
    """The loop callbacks ``auto`` needs (its :class:`PhaseWatch`), or none."""
    return [auto.watch] if auto is not None else []


def exit_for_retry() -> None:
    """End this process (after :class:`BatchTooLarge`) so that the run goes on with the smaller micro-batch; never
    returns.

    Under torchrun with restarts: ``os._exit`` (:data:`RESPLIT_EXIT_CODE`; no atexit handler, no collective), and
    the agent restarts the group. One process: ``os.execv`` of the same command line with :data:`ATTEMPT_ENV` + 1.
    """
    from ..launch import elastic_restarts_possible

    sys.stdout.flush()
    sys.stderr.flush()
    if elastic_restarts_possible():
        os._exit(RESPLIT_EXIT_CODE)
    os.environ[ATTEMPT_ENV] = str(restart_count() + 1)
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
