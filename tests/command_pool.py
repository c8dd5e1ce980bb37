"""The test side of tests/pool_worker.py: one ``accelerate launch`` that runs many accum-kit commands.

Not a test module (pytest does not collect it). conftest.py's ``ddp_pool`` and ``fsdp_pool`` are
:class:`CommandPool` objects; a module submits the 2-process commands that need no launch of their
own (no signal, no fault hook, no launcher flag) and reads their results as it would a launch's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import job_helpers as jh


class CommandPool:
    """One ``accelerate launch`` of tests/pool_worker.py that runs accum-kit commands submitted while it runs.

    Every command costs what it computes, not a launch: the launcher, the rendezvous and the
    imports of torch, transformers and datasets (most of a small job's CPU time) are paid once
    per pool. Commands run one after another, in submission order, each as if in a fresh
    process (see tests/pool_worker.py). Constructing it starts the launch; :meth:`submit` commands,
    ask each :class:`PoolCommand` for its :meth:`~PoolCommand.result`; :meth:`close` ends it.
    """

    def __init__(self, work: Path, config: str | Path = jh.DDP_CONFIG, num_processes: int = 2, timeout: float = 600):
        self.work, self.queue, self.num_processes, self.timeout = work, work / "queue", num_processes, timeout
        self.config = config
        self.queue.mkdir(parents=True)
        cmd = jh.accelerate_launch_cmd(str(jh.REPO / "tests" / "pool_worker.py"), str(self.queue),
                                       num_processes=num_processes, config=config)
        self.launch_cmd = cmd[: cmd.index("--main_process_port")]
        self.started = jh.start(cmd, jh.clean_env(), work, "pool")
        self._next, self._finished = 0, None

    def submit(self, command: str, argv: list, datasets_cache: Path | None = None,
               script: Path | None = None) -> "PoolCommand":
        """Queue ``accum-kit <command> <argv>`` (or, with ``script``, ``python <script> <argv>``; ``command`` is
        then only its name), with ``datasets_cache`` as HF_DATASETS_CACHE; returns at once."""
        i = self._next
        self._next += 1
        argv = [str(a) for a in argv]
        entry = {"command": command, "argv": argv, "datasets_cache": None if datasets_cache is None else str(datasets_cache),
                 "script": None if script is None else str(script)}
        tmp = self.queue / f".{i:04d}.json.tmp"
        tmp.write_text(json.dumps(entry))
        tmp.replace(self.queue / f"{i:04d}.json")  # the workers poll for it: never half-written
        return PoolCommand(self, i, [*self.launch_cmd, *([str(script)] if script else ["-m", "accum_kit", command]), *argv])

    def alive(self) -> bool:
        return self.started[1].poll() is None

    def close(self, timeout: float | None = None) -> jh.Finished:
        """Queue the stop and wait for the launch to end, killing it after ``timeout`` (default: the pool's);
        returns it (the first call's result)."""
        if self._finished is None:
            if self.alive():
                (self.queue / f".{self._next:04d}.json.tmp").write_text(json.dumps({"stop": True}))
                (self.queue / f".{self._next:04d}.json.tmp").replace(self.queue / f"{self._next:04d}.json")
            self._finished = jh.finish(self.started, self.timeout if timeout is None else timeout)
        return self._finished


@dataclass
class PoolCommand:
    """A command queued on a :class:`CommandPool`; :meth:`result` waits for it."""

    pool: CommandPool
    index: int
    cmd: list

    def result(self, timeout: float | None = None) -> jh.Finished:
        """Wait for the command (at most ``timeout`` seconds, never less than the pool's ``timeout``); it, as a
        :class:`Finished`: ``returncode`` its exit code (1 if it raised, the launch's if it
        never ended), ``stdout`` what it printed on rank 0, 1, ..., ``stderr`` the pool's log from the first
        rank's start line of this command to the last rank's end line (to the end if there is none), and
        the traceback if it raised."""
        import time

        t0 = time.monotonic()
        # never less than the pool's own limit: giving up on a command ends the pool (see below)
        deadline = t0 + max(self.pool.timeout, timeout or 0)
        q, i, n = self.pool.queue, self.index, self.pool.num_processes
        done = [q / f"{i:04d}.rank{r}.done" for r in range(n)]
        while not all(p.exists() for p in done) and self.pool.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        records = [json.loads(p.read_text()) for p in done if p.exists()]
        codes = {r["exit_code"] for r in records}
        if len(records) == n and None not in codes:
            rc = max(codes, key=abs)
        elif not self.pool.alive():
            rc = self.pool.close().returncode or 1
        else:  # timed out: stuck in it or in an earlier command; the commands queued after it would wait too
            self.pool.close(timeout=0.1)
            rc = -9
        err = self.pool.work / "pool.stderr"
        stderr = _command_lines(err.read_text(errors="replace") if err.exists() else "", i)
        stderr += "".join(r.get("traceback", "") for r in records)
        stdout = "".join(p.read_text() for r in range(n) if (p := q / f"{i:04d}.rank{r}.stdout").exists())
        return jh.Finished(self.cmd, rc, stdout, stderr, time.monotonic() - t0)


def _command_lines(log: str, i: int) -> str:
    """The part of a :class:`CommandPool`'s stderr that command ``i`` wrote (tests/pool_worker.py marks it)."""
    start = log.find(f" command {i} start: ")
    if start < 0:
        return log
    end = log.rfind(f" command {i} end: ")
    return log[log.rfind("\n", 0, start) + 1: None if end < 0 else (log.find("\n", end) + 1 or None)]
