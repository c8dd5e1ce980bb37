"""Shared helpers for the tests and their worker scripts.

Not a test module (pytest does not collect it): launching subprocesses with a
clean environment, a small real text corpus, and resetting Accelerate's
process-wide singleton state between in-process runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DDP_CONFIG = REPO / "accelerate_configs" / "cpu_ddp.yaml"
FSDP_CONFIG = REPO / "accelerate_configs" / "cpu_fsdp.yaml"

# The FSDP2 train job that tests/test_train_job.py checks and tests/test_fsdp_faults.py breaks: the tiny preset,
# 2 x 3 micro-batches of 2 packed 64-token blocks per step, 8 steps on 200 blocks (the epoch never ends), and
# the policy that changes FSDP2's defaults most. Its uninterrupted run is conftest.py's ``fsdp_reference``.
FSDP_JOB_STEPS, FSDP_JOB_K, FSDP_JOB_B, FSDP_JOB_POLICY = 8, 3, 2, "no_sync_no_reshard"
FSDP_REFERENCE_EVERY = 4  # the reference's --checkpointing_steps (test_train_job.py resumes from step_4)

# Variables a launcher sets; a test run started from inside a launched process
# (or a developer's shell) must not leak them into the jobs under test.
LAUNCHER_VARS = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_USE_CPU",
)

# Real text nobody on this project wrote: a few CPython standard library modules
# (present on every machine with Python), concatenated. ~45 KB of UTF-8.
STDLIB_FILES = ("textwrap.py", "shlex.py", "string.py")


def clean_env(**extra: str) -> dict:
    """os.environ without launcher variables, single-threaded, offline, this checkout first on PYTHONPATH, plus ``extra``.

    PYTHONPATH: launched workers run as scripts, so without it they would import whichever ``accum_kit`` is
    installed (an editable install may point at another checkout).
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TQDM_DISABLE="1",
    )
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port nobody listens on now (other test sessions may run on this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch_cmd(*args: str, num_processes: int = 2, config: str | Path = DDP_CONFIG) -> list[str]:
    """``accelerate launch --config_file <config> ...`` from this venv (default accelerate_configs/cpu_ddp.yaml)."""
    script = Path(sys.executable).with_name("accelerate")
    prog = [str(script), "launch"] if script.exists() else [sys.executable, "-m", "accelerate.commands.launch"]
    return [*prog, "--config_file", str(config), "--num_processes", str(num_processes),
            "--main_process_port", str(free_port()), *[str(a) for a in args]]


@dataclass
class Finished:
    cmd: list
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def describe(self, tail: int = 6000) -> str:
        def cut(text):
            return text if len(text) <= tail else "...\n" + text[-tail:]

        return (f"cmd: {' '.join(self.cmd)}\nrc={self.returncode} after {self.seconds:.1f}s\n"
                f"--- stderr ---\n{cut(self.stderr)}\n--- stdout ---\n{cut(self.stdout)}")


def start(cmd: list[str], env: dict, log_dir: Path, name: str) -> tuple:
    """Start ``cmd`` in its own process group; output goes to files in ``log_dir``."""
    import time

    log_dir.mkdir(parents=True, exist_ok=True)
    out, err = open(log_dir / f"{name}.stdout", "w+"), open(log_dir / f"{name}.stderr", "w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
    return cmd, proc, out, err, time.monotonic()


def stop(proc: subprocess.Popen) -> None:
    """Stop a launch started by :func:`start` and the workers it spawned.

    torchrun starts every worker in a session of its own, so killing the
    launcher's group would orphan them: SIGTERM first, which torchrun forwards
    to its workers, then SIGKILL what is left of the group.
    """
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=40)  # torchrun waits up to 30 s for its workers before killing them
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def fsdp_job_argv(corpus: Path, output_dir: Path, *extra) -> list[str]:
    """``-m accum_kit train`` with the flags of the shared FSDP2 job (put the launcher in front), then ``extra``."""
    return ["-m", "accum_kit", "train", "--train_file", str(corpus), "--model_preset", "tiny", "--block_size", "64",
            "--output_dir", str(output_dir), "--learning_rate", "3e-3", "--num_warmup_steps", "0",
            "--logging_steps", "4", "--max_train_steps", str(FSDP_JOB_STEPS), "--per_device_train_batch_size",
            str(FSDP_JOB_B), "--gradient_accumulation_steps", str(FSDP_JOB_K), "--max_train_samples", "200",
            "--max_eval_samples", "32", "--accumulation_policy", FSDP_JOB_POLICY, *[str(x) for x in extra]]


class Pending:
    """A launch from :func:`start` (or a command_pool.PoolCommand) that runs while other work goes on; :meth:`result`
    waits for it (once).

    Attributes: ``output_dir``, ``corpus``, ``datasets_cache``: what the launch was given, for runs that
    compare with it or reuse its tokenised data.
    """

    def __init__(self, started: tuple, output_dir: Path, corpus: Path, datasets_cache: Path, timeout: float):
        self.output_dir, self.corpus, self.datasets_cache = output_dir, corpus, datasets_cache
        self._started, self._timeout, self._done = started, timeout, None

    def result(self) -> Finished:
        if self._done is None:
            started = self._started  # a PoolCommand has its own result(); a launch is a tuple from start()
            self._done = started.result(self._timeout) if hasattr(started, "result") else finish(started, self._timeout)
        return self._done


def finish(started: tuple, timeout: float) -> Finished:
    """Wait for a process from :func:`start`; kill its own process group on timeout."""
    import time

    cmd, proc, out, err, t0 = started
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        rc = -9
    texts = []
    for f in (out, err):
        f.flush()
        f.seek(0)
        texts.append(f.read())
        f.close()
    return Finished(cmd, rc, texts[0], texts[1], time.monotonic() - t0)


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Poll the log file ``path`` until ``text`` appears; AssertionError if ``proc`` ends or time runs out first."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path} (rc={proc.poll()})")


def run(cmd: list[str], env: dict, log_dir: Path, name: str, timeout: float = 240) -> Finished:
    return finish(start(cmd, env, log_dir, name), timeout)


def stdlib_path(name: str) -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / name


def write_corpus(path: Path, files=STDLIB_FILES) -> Path:
    """Concatenate a few real standard-library sources into one .txt file."""
    text = "".join(stdlib_path(f).read_text(encoding="utf-8") for f in files)
    path.write_text(text, encoding="utf-8")
    return path


def text_rows(path: Path) -> list[str]:
    """The rows datasets' "text" builder makes with ``keep_linebreaks=True`` (the train job's default):
    every line with its "\\n", blank lines included (the file split after each "\\n")."""
    lines = path.read_text(encoding="utf-8").split("\n")  # the last piece is "" when the file ends with "\n"
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def text_lines(path: Path) -> list[str]:
    """The non-blank lines of a text file, as ``datasets``' "text" builder reads them (split on "\\n")."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    if text.endswith("\n"):
        lines = lines[:-1]
    return [line for line in lines if line.strip()]


def isolate_in_process(monkeypatch, datasets_cache) -> None:
    """For a job run inside the test process: no launcher variables, offline hub, a private datasets cache,
    and Accelerate's process-wide singletons forgotten (call :func:`reset_accelerate_state` again after)."""
    import datasets
    import huggingface_hub.constants

    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", datasets_cache)
    reset_accelerate_state()


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide singletons (what accelerate's own tests do between cases)."""
    from accum_kit.compat import reset_accelerate_state

    reset_accelerate_state()


def staging_leftovers(output_dir: Path) -> list[Path]:
    """Staging directories / temp files the atomic writers may leave beside or inside ``output_dir``."""
    found = list(output_dir.parent.glob(f".{output_dir.name}.staging-*"))
    if output_dir.is_dir():
        found += [p for p in output_dir.iterdir() if p.name.startswith(".")]
    return found


def pad_collate(pad_id: int, width: int | None = None):
    """Right-pad to the longest example of the micro-batch (at least ``width`` tokens): pad id, attention_mask 0, labels -100.

    A fixed ``width`` (at least the longest example) gives every micro-batch the
    same shape, which a statically compiled model then runs without recompiling.
    """

    import torch

    def collate(examples):
        longest = max(len(e["input_ids"]) for e in examples)
        width_ = max(longest, width or 0)
        ids, mask, labels = [], [], []
        for e in examples:
            n = len(e["input_ids"])
            ids.append(e["input_ids"] + [pad_id] * (width_ - n))
            mask.append([1] * n + [0] * (width_ - n))
            labels.append(e["labels"] + [-100] * (width_ - n))
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "attention_mask": torch.tensor(mask, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
        }

    return collate


def prepared_tiny_lm(accelerator, n_examples: int = 8, lr: float = 0.1):
    """A 1-layer GPT-2 (seed 0), SGD and a DataLoader of ``n_examples`` random 8-token rows (batch 2), prepared."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=None, eos_token_id=None))
    data = [{"input_ids": torch.randint(0, 50, (8,))} for _ in range(n_examples)]
    for d in data:
        d["labels"] = d["input_ids"].clone()
    return accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=lr), DataLoader(data, batch_size=2))


def assert_same_summary(got: dict, want: dict, rel: float = 1e-9) -> None:
    """Every key of two profiler summaries equal: numbers within ``rel`` (float rounding), the rest exactly."""
    import math

    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for key, w in want.items():
        g = got[key]
        if isinstance(w, float) or isinstance(g, float):
            assert g is not None and w is not None and math.isclose(g, w, rel_tol=rel, abs_tol=1e-12), (key, g, w)
        else:
            assert g == w, (key, g, w)


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the worker with ``RANK=rank`` among the launcher's descendants (torchrun's children)."""
    import psutil

    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            if child.environ().get("RANK") == str(rank):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def run_dist_worker(config: Path, spec: dict, root: Path, name: str, world: int, timeout: float, pool=None) -> dict:
    """One ``accelerate launch --config_file config`` of tests/dist_worker.py over ``spec`` (or, with ``pool``, a
    script run of that command_pool.CommandPool, which must have been launched with ``config`` on ``world`` processes);
    its scenarios loaded.

    Returns ``{scenario name: {"scenario", "init", "steps", "ranks", "resumed": {step: {"steps", "ranks"}}}}``
    (see tests/dist_worker.py for the files); fails the test with the launch's output if it fails.
    """
    import pytest
    import torch

    (root / "spec.json").write_text(json.dumps(spec))
    worker = REPO / "tests" / "dist_worker.py"
    if pool is not None:
        assert (Path(pool.config), pool.num_processes) == (Path(config), world), "the pool runs another launch"
        res = pool.submit(name, [root / "spec.json", root / "out"], datasets_cache=root / "hf_cache",
                          script=worker).result(timeout)
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--main_process_port", str(free_port()), str(worker), str(root / "spec.json"), str(root / "out")]
        res = run(cmd, clean_env(HF_DATASETS_CACHE=str(root / "hf_cache")), root / "logs", name, timeout=timeout)
    if res.returncode != 0:
        pytest.fail(f"{name} worker failed\n{res.describe()}", pytrace=False)

    def load(d):
        return {"steps": torch.load(d / "steps.pt", weights_only=True),
                "ranks": [json.loads((d / f"rank{r}.json").read_text()) for r in range(world)]}

    out = {}
    for sc in spec["scenarios"]:
        d = root / "out" / sc["name"]
        out[sc["name"]] = {"scenario": sc, "init": torch.load(d / "init.pt", weights_only=True), **load(d),
                           "resumed": {s: load(d / f"resumed_{s}") for s in sc.get("resume_from", [])}}
    return out


def windows_of(micro: list[dict]) -> list[list[dict]]:
    """dist_worker's per-micro-batch records split into windows (each ends on a boundary)."""
    out, cur = [], []
    for m in micro:
        cur.append(m)
        if m["boundary"]:
            out.append(cur)
            cur = []
    return out


def tensorboard_scalars(log_dir) -> dict:
    """{tag: {step: value}} read back with tensorboard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = [p.parent for p in log_dir.rglob("events.out.tfevents.*")]
    assert runs, f"no event file under {log_dir}"
    out = {}
    for run in set(runs):
        acc = EventAccumulator(str(run))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def fresh_process_group(prefix: str) -> None:
    """Inside a launched worker: form the default process group again if an earlier command destroyed it
    (the train job's ``end_training``).

    The launcher's TCPStore outlives the group; a second rendezvous under the first one's key prefix could
    read a peer's stale address, so every caller passes a ``prefix`` of its own (the reason
    accum_kit.launch.init_restartable_process_group prefixes restart attempts).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True", "needs torchrun's shared store"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


#: The LoRA adapters the exactness scenarios train (a scenario's ``"lora"``): rank 4 on the attention's q/k/v
#: projection of every block, no dropout (deterministic), alpha 8. Every block's FSDP2 unit then mixes frozen
#: and trainable parameters, and the root and output-head units hold frozen ones only.
LORA = {"r": 4, "alpha": 8, "target_modules": ["c_attn"]}
LORA_MOMENTUM = 0.9  # SGD's momentum in the LoRA scenarios: optimizer state that a frozen parameter must not get


def lora_model(model, lora: dict):
    """``peft.get_peft_model`` of ``model`` with ``lora`` (``r``, ``alpha``, ``target_modules``), dropout 0."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0, bias="none",
                                            target_modules=list(lora["target_modules"]), task_type="CAUSAL_LM"))


def optimizer_state_names(model, optimizer) -> list[str]:
    """Names of ``model``'s parameters that hold optimizer state (wrapper prefixes ``module.`` / ``_orig_mod.``
    removed), sorted: what a worker records to show that frozen parameters got none."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer
    with_state = {id(p) for p, s in inner.state.items() if s}
    names = set()
    for name, p in model.named_parameters():
        if id(p) in with_state:
            for prefix in ("_orig_mod.", "module."):
                name = name.removeprefix(prefix)
            names.add(name)
    return sorted(names)
