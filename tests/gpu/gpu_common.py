"""Shared by tests/gpu: the workloads, the plain-PyTorch oracle, the launches, and the figures' log.

Not a test module (pytest does not collect it). Importing it loads no torch:
the CPU machines collect tests/gpu and skip it, and nothing heavy may run
there. torch and transformers are imported inside the functions that need them.

Workloads (the same constants feed the worker that runs accum_kit and the
oracle that checks it):

- ``EXAMPLES``: 20 variable-length token sequences, short and long ones
  alternating, some with a masked prompt, so that the token mean of a
  window differs from the mean of its micro-batch means (as
  tests/test_exactness.py's); ``MODEL`` a 2-layer, 16-wide GPT-2.
- ``FP16_EXAMPLES``: 32 sequences of 150-256 tokens, long enough that summed
  losses times the GradScaler's initial 2^16 overflow fp16 (as
  tests/test_mixed_precision.py's); ``FP16_MODEL`` the same GPT-2 with 256 positions.

The oracle (:func:`window_gradient`, :func:`sgd_trajectory`) is plain
single-process PyTorch in float64 on the CPU, one example at a time,
unpadded: no Accelerate, no accum_kit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIGS = REPO / "accelerate_configs"
WORKER = HERE / "gpu_worker.py"

SEED = 0
PAD_ID = 0
IGNORE = -100
NO_CUDA = "needs a CUDA GPU (tests/gpu runs on a GPU machine; docs/gpu_tests.md)"
#: ``GPU_TESTS_DRY_RUN=1``: the tests that support it (the ``compile`` and ``auto_batch`` launches and the checks
#: computed in the test) run on the CPU, the launches with CUDA hidden and the CUDA allocator's cap stood in for
#: (tests/gpu/memory_cap/sitecustomize.py), to exercise the workers' and tests' code before a GPU is at hand. Every
#: other test stays skipped; figures from a dry run say nothing about a GPU.
DRY_RUN = os.environ.get("GPU_TESTS_DRY_RUN") == "1"
DEVICE = "cpu" if DRY_RUN else "cuda"  # the device type the launches' runs must report

# ---------------------------------------------------------------- workloads

MODEL = dict(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
             attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, use_cache=False)
COMPILE_MODEL = {**MODEL, "n_layer": 1}  # inductor compile time grows with the graph: one block is enough
FP16_MODEL = {**MODEL, "n_positions": 256}
#: FSDP2 memory: big enough (1.86M parameters, 7.4 MB in fp32) that the allocator's 512-byte blocks, the
#: batch and the loss scalars vanish next to the gradients and parameters the policies hold.
MEMORY_MODEL = dict(vocab_size=1024, n_embd=256, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, use_cache=False)

K, B, LR = 3, 2, 0.5  # 20 examples: 10 micro-batches per process at W = 1, windows of 3, 3, 3 and a partial 1
FP16_K, FP16_B, FP16_LR = 2, 2, 0.1  # 32 examples: 8 windows of 2
MEMORY_K, MEMORY_B = 3, 2
#: Activation checkpointing's memory: 4 blocks and micro-batches of 4 x 256 tokens, so that activations (about
#: 160 MB predicted without checkpointing, 75 MB with it) outweigh the model's state (3.4M parameters, about 55 MB
#: with AdamW); fixed-length examples (no padding, so the peak's sequence length is known); fp32 (the activation
#: count's element size is the compute precision's, and bf16 autocast keeps some activations in fp32).
CKPT_MODEL = {**MEMORY_MODEL, "n_layer": 4, "n_positions": 256}
CKPT_K, CKPT_B, CKPT_SEQ = 2, 4, 256
#: measured peak and checkpointing's saving against the prediction: the calibration of the backward's transient
#: gradients was fitted on CPU (docs/memory.md); a first bound for CUDA, to tighten with measurements
CKPT_REL = 0.2
FSDP_POLICIES = ("no_sync", "sync_each_batch", "no_sync_no_reshard_after_backward", "no_sync_no_reshard")
#: --auto_find_batch_size under a CUDA memory cap (tests/gpu/auto_batch_runs.py): the train job started at
#: AUTO_CHAIN[0] x 1, the cap set between what the last micro-batch and the one before it need, so that it must
#: settle on the last after two re-executions. fp32, the `mini` preset, blocks of 1024 tokens: activations (about
#: 150 MB per sequence by accum_kit's activation model, an estimate: the test measures) outweigh the model with its
#: gradients and AdamW state (54 MB) and cuBLAS's workspaces, so that the peaks of 8 and 16 sequences lie far apart
#: (32 sequences uncapped: about 5 GB). The dry run: the `tiny` preset on 64-token blocks, 4 -> 2 -> 1.
AUTO_CHAIN = (4, 2, 1) if DRY_RUN else (32, 16, 8)
AUTO_WORKLOAD = dict(preset="tiny", block_size=64) if DRY_RUN else dict(preset="mini", block_size=1024)
AUTO_STEPS = 3
AUTO_LOSS_RTOL = 1e-6  # the settled run's losses against the uncapped run's: the same windows, summed in another order

ROUNDINGS = 64  # m of accum_kit's derivation: sqrt(m) u, see accum_kit/verify/compare.py
BF16_RTOL = math.sqrt(ROUNDINGS) * 2.0 ** -8  # 3.1e-2: normwise, per update
FP16_RTOL = math.sqrt(ROUNDINGS) * 2.0 ** -11  # 3.9e-3
LOW_PRECISION_FLOOR = 1e-5  # a bf16 / fp16 update closer than this to the fp64 oracle did not run in low precision
ATOL, RTOL = 1e-6, 1e-5  # fp32 parameters against the fp64 oracle trajectory (tests/test_exactness.py's)
FLOOR_FACTOR = 10  # compiled run: within ATOL + 10 x (one step's compiled-vs-eager difference), tests/test_compile.py's


def make_examples(n=20, seed=1234, vocab=64):
    """Short (3-6) and long (14-24) sequences alternating; some labels mask a prompt prefix with -100."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(3, 6) if i % 2 == 0 else rng.randint(14, 24)
        ids = [rng.randint(2, vocab - 1) for _ in range(length)]
        n_prompt = rng.choice([0, 0, 1, length // 2])
        out.append({"input_ids": ids, "labels": [IGNORE] * n_prompt + ids[n_prompt:]})
    return out


def make_long_examples(n=32, low=150, high=256, seed=0, vocab=64):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(2, vocab - 1) for _ in range(rng.randint(low, high))]
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


EXAMPLES = make_examples()
PAD_TO = max(len(e["input_ids"]) for e in EXAMPLES)  # the compiled run: one static shape
FP16_EXAMPLES = make_long_examples()
MEMORY_EXAMPLES = make_examples(n=MEMORY_K * MEMORY_B * 2, seed=77, vocab=MEMORY_MODEL["vocab_size"])
CKPT_EXAMPLES = make_long_examples(n=CKPT_K * CKPT_B * 2, low=CKPT_SEQ, high=CKPT_SEQ, seed=78,
                                   vocab=CKPT_MODEL["vocab_size"])


def pad_collate(pad_id=PAD_ID, width=None):
    """Right-pad to the longest example (at least ``width``): pad id, attention_mask 0, labels -100."""
    import torch

    def collate(examples):
        w = max(max(len(e["input_ids"]) for e in examples), width or 0)
        ids, mask, labels = [], [], []
        for e in examples:
            n = len(e["input_ids"])
            ids.append(e["input_ids"] + [pad_id] * (w - n))
            mask.append([1] * n + [0] * (w - n))
            labels.append(e["labels"] + [IGNORE] * (w - n))
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": torch.tensor(labels)}

    return collate


def windows(examples, k, b, world=1):
    """The accumulation windows (lists of examples): with ``shuffle=False`` process r gets global batches
    r, r + W, ... (Accelerate's sharding), so window s is global batches s K W ... ; the last may be partial."""
    batches = [examples[i:i + b] for i in range(0, len(examples), b)]
    per_process = len(batches) // world
    return [[e for batch in batches[s * k * world:min((s + 1) * k, per_process) * world] for e in batch]
            for s in range(math.ceil(per_process / k))]


# ---------------------------------------------------------------- the oracle (plain PyTorch, float64, CPU)


def oracle_model(config: dict, params: dict | None = None):
    """A float64 ``GPT2LMHeadModel`` on the CPU, with ``params`` (name -> tensor) copied in when given."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(**config)).double().eval()
    if params is not None:
        own = dict(model.named_parameters())
        missing = set(own) - set(params)
        assert not missing, f"parameters missing from the run's record: {sorted(missing)[:5]}"
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(params[name].to(torch.float64))
    return model


def window_gradient(model, examples) -> dict:
    """Gradient of the token-mean next-token loss of ONE window: each example unpadded, summed, / target tokens."""
    import torch
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    total, tokens = 0.0, 0
    for e in examples:
        ids = torch.tensor([e["input_ids"]])
        target = torch.tensor(e["labels"][1:])
        logits = model(input_ids=ids).logits[0, :-1]
        total = total + F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum")
        tokens += int((target != IGNORE).sum())
    (total / tokens).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def mean_of_means_gradient(model, examples, k, b) -> dict:
    """WRONG on purpose (the sensitivity check): sum over the window's micro-batches of their token means / K."""
    import torch
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    total = 0.0
    for i in range(0, len(examples), b):
        s, n = 0.0, 0
        for e in examples[i:i + b]:
            ids = torch.tensor([e["input_ids"]])
            target = torch.tensor(e["labels"][1:])
            s = s + F.cross_entropy(model(input_ids=ids).logits[0, :-1], target, ignore_index=IGNORE, reduction="sum")
            n += int((target != IGNORE).sum())
        total = total + s / max(n, 1) / k
    total.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def sgd_trajectory(config: dict, init: dict, wins: list, lr: float, gradient=None) -> list[dict]:
    """Parameters (float64) after each window's SGD step of the exact big-batch gradient, from ``init``
    (``gradient(model, window)``: another gradient, for negative controls)."""
    import torch

    model = oracle_model(config, init)
    out = []
    for w in wins:
        grads = (gradient or window_gradient)(model, w)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p -= lr * grads[n]
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def update_errors(saved: dict, config: dict, examples, k: int, b: int, lr: float, oracle=None, skipped=None) -> list:
    """Normwise error of every update a run applied (plain SGD: ``(before - after) / lr``) against the oracle's
    gradient at the run's own parameters before it: :func:`window_gradient`, or ``oracle(model, window, k, b)``.
    ``saved``: ``{"init": params, "after": [params after each step]}``; None for a step ``skipped`` says was skipped."""
    wins = windows(examples, k, b)
    assert len(saved["after"]) == len(wins), (len(saved["after"]), len(wins))
    errors, before = [], saved["init"]
    for s, (w, after) in enumerate(zip(wins, saved["after"])):
        if skipped and skipped[s]:
            errors.append(None)
        else:
            model = oracle_model(config, before)
            want = window_gradient(model, w) if oracle is None else oracle(model, w, k, b)
            errors.append(rel_error(applied_gradient(before, after, lr), want))
        before = after
    return errors


def rel_error(got: dict, want: dict) -> float:
    """||got - want|| / ||want|| over every tensor of ``want`` (float64)."""
    err = sum(float((got[k].double() - want[k].double()).pow(2).sum()) for k in want)
    ref = sum(float(want[k].double().pow(2).sum()) for k in want)
    return math.sqrt(err / ref) if ref > 0 else (0.0 if err == 0 else math.inf)


def applied_gradient(before: dict, after: dict, lr: float) -> dict:
    """What a plain SGD step applied: ``(before - after) / lr`` per parameter (float64)."""
    return {k: (before[k].double() - after[k].double()) / lr for k in before}


def max_excess(got: dict, want: dict, atol: float, rtol: float) -> tuple[float, float]:
    """``(max |got - want|, max of |got - want| / (atol + rtol |want|))`` over every element of ``want``."""
    worst, used = 0.0, 0.0
    for k, w in want.items():
        d = (got[k].double() - w.double()).abs()
        worst = max(worst, float(d.max()))
        used = max(used, float((d / (atol + rtol * w.double().abs())).max()))
    return worst, used


# ---------------------------------------------------------------- figures: printed and written to $OUT


#: every figure recorded in this session, in order (tests/gpu/conftest.py prints them in pytest's terminal summary,
#: so that they reach the log of a plain ``pytest -q``, which shows no passing test's output)
RECORDED: list = []


def record(name: str, figures: dict) -> None:
    """Print ``figures`` (shown by ``pytest -s``; all of them again in the terminal summary) and merge them into
    ``$OUT/gpu_tests.json`` under ``name`` when ``OUT`` is set (each test adds its entry as it ends)."""
    text = json.dumps(figures, default=_plain, sort_keys=True)
    RECORDED.append((name, text))
    print(f"\nGPU-TEST {name}: {text}", flush=True)
    out = os.environ.get("OUT")
    if not out:
        return
    path = Path(out) / "gpu_tests.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[name] = json.loads(text)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except (OSError, ValueError) as exc:  # the figures are printed anyway
        print(f"GPU-TEST could not write {path}: {exc}", flush=True)


_NOTED: dict = {}


def note(figures: dict) -> dict:
    """Make ``figures`` the running check's (what :func:`recording` records, also when an assertion then fails)."""
    _NOTED["figures"] = figures
    return figures


@contextlib.contextmanager
def recording(name: str):
    """Record under ``name`` the figures the check noted (:func:`note`) plus what the block adds to the yielded
    dict, whether the check passes or not (a failure adds ``failed``: the exception, shortened)."""
    _NOTED.clear()
    extra: dict = {}
    try:
        yield extra
    except BaseException as exc:
        extra["failed"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        raise
    finally:
        record(name, {**_NOTED.get("figures", {}), **extra})


def _plain(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


# ---------------------------------------------------------------- the launches

LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")

#: worker name -> accelerate config (each launch: one process on the one GPU; see gpu_worker.py); None: the worker
#: runs as a plain process (``auto_batch``: it starts one-process train jobs of its own)
LAUNCHES = {"ddp": "gpu_ddp.yaml", "compile": "gpu_ddp.yaml", "fsdp": "gpu_fsdp.yaml", "zero": "gpu_deepspeed.yaml",
            "auto_batch": None}
#: all launches run at once and must have ended this many seconds after they started (pytest's limit is 180 s);
#: a worker also ends itself (SIGALRM) a little later, should this process be killed before it could stop them
DEADLINE_S = float(os.environ.get("GPU_TESTS_DEADLINE_S", "140"))
WORKER_ALARM_S = int(DEADLINE_S) + 15


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    """This environment without launcher or Accelerate variables; the repo first on PYTHONPATH (it is not installed
    on the GPU machine), offline, unbuffered."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("ACCELERATE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1", GPU_TESTS_WORKER_ALARM_S=str(WORKER_ALARM_S))
    if DRY_RUN:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def launch_cmd(name: str, out_dir: Path) -> list[str]:
    if LAUNCHES[name] is None:
        return [sys.executable, str(WORKER), name, str(out_dir)]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / LAUNCHES[name]),
            "--num_processes", "1", "--num_machines", "1", "--main_process_port", str(free_port()),
            str(WORKER), name, str(out_dir)]


class Launch:
    """One worker launch: started at once, waited for by :meth:`result` (once), killed at the deadline."""

    def __init__(self, name: str, root: Path, deadline: float):
        self.name, self.out = name, root / name
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = root / f"{name}.log"
        self.cmd = launch_cmd(name, self.out)
        self._log = open(self.log_path, "w+")
        self.t0, self.deadline = time.monotonic(), deadline
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=worker_env(), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._result = None

    def log_tail(self, n=12000) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text if len(text) <= n else "[...]\n" + text[-n:]

    def stop(self) -> None:
        """SIGTERM the launcher's group (torchrun forwards it to its worker), then SIGKILL what is left."""
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def result(self) -> dict:
        """The worker's result.json (every part's figures or error); AssertionError with the log if it has none."""
        if self._result is None:
            timed_out = False
            try:
                self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                self.stop()
            seconds = time.monotonic() - self.t0
            self.save_log()
            path = self.out / "result.json"
            res = json.loads(path.read_text()) if path.exists() else None
            if res is None:
                why = "timed out and was killed" if timed_out else f"exited with {self.proc.returncode}"
                raise AssertionError(f"worker {self.name} {why} after {seconds:.0f}s without a result\n"
                                     f"cmd: {' '.join(self.cmd)}\n--- log ---\n{self.log_tail()}")
            res.setdefault("_launch", {}).update(returncode=self.proc.returncode, timed_out=timed_out,
                                                 seconds=round(seconds, 1))
            self._result = res
        return self._result

    def task(self, key: str) -> dict:
        """One task's entry of the result; AssertionError with its traceback if it failed, or was never reached."""
        res = self.result()
        entry = res.get(key)
        if entry is None:
            raise AssertionError(f"worker {self.name}: task {key!r} has no result (launch {res['_launch']})\n"
                                 f"--- log ---\n{self.log_tail()}")
        if "error" in entry:
            raise AssertionError(f"worker {self.name}: task {key!r} failed:\n{entry['error']}")
        return entry

    def save_log(self) -> None:
        """Copy the launch's log (its tail) and its result.json to ``$OUT/gpu_tests_logs/`` when OUT is set."""
        out = os.environ.get("OUT")
        if out:
            try:
                d = Path(out) / "gpu_tests_logs"
                d.mkdir(parents=True, exist_ok=True)
                (d / f"{self.name}.log").write_text(self.log_tail(60000))
                if (self.out / "result.json").exists():
                    (d / f"{self.name}.result.json").write_text((self.out / "result.json").read_text())
            except OSError:
                pass


class Launches:
    """The worker launches the collected tests need, all started together (one GPU, one process each)."""

    def __init__(self, root: Path, names):
        deadline = time.monotonic() + DEADLINE_S
        self.launches = {n: Launch(n, root, deadline) for n in sorted(names)}

    def __getitem__(self, name: str) -> Launch:
        return self.launches[name]

    def close(self) -> None:
        for launch in self.launches.values():
            launch.stop()
            launch.save_log()

    def terminate_now(self) -> None:
        """SIGTERM every launch without waiting (torchrun forwards it to its worker): for a signal handler."""
        for launch in self.launches.values():
            if launch.proc.poll() is None:
                try:
                    os.killpg(launch.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
