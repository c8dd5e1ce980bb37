"""Exactness and no_sync checks of accum_kit.train_loop against independent oracles.

One run per process count runs every scenario (tests/dist_worker.py): one
plain process, and two gloo processes through ``accelerate launch`` with
accelerate_configs/cpu_ddp.yaml (a script run of conftest.py's shared ``ddp_pool``). The worker saves the parameters after every
optimizer step, the logged losses, and, per micro-batch, how many DDP gradient
all-reduces (comm-hook calls) ran. Everything expected is computed here by a
plain single-process PyTorch loop: no Accelerate and no accum_kit code.

Data layout the oracle relies on (documented Accelerate behaviour): with
``shuffle=False`` and ``split_batches=False``, process r gets global batches
r, r+W, r+2W, ...; so accumulation window s (K micro-batches per process) is
global batches s*K*W ... (s+1)*K*W-1, i.e. consecutive dataset examples. The
dataset size is a multiple of B*W so ``even_batches`` never duplicates examples,
and the number of micro-batches per process is not a multiple of K, so every
epoch ends with a partial window.

Beyond one epoch (``num_train_epochs``) Accelerate ends the window at the end of
the dataloader and restarts its counter, so every epoch has the same windows
(``shuffle=False``) and the partial window that ends an epoch is a step of its
own. ``max_train_steps`` stops the run after that many windows (possibly in the
middle of an epoch, or in a later epoch than ``num_train_epochs``). With
``max_grad_norm`` the exact big-batch gradient is clipped as by
``torch.nn.utils.clip_grad_norm_`` before the SGD step.

An accumulation schedule (``{optimizer step: K}``) changes K only at window
boundaries: the window after N optimizer steps holds the K of the largest key
<= N micro-batches per process, or what is left of the epoch. The oracle cuts
those windows here from the schedule alone (:func:`scheduled_run`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import job_helpers as jh
import torch
from transformers import GPT2Config, GPT2LMHeadModel

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dist_worker.py"
DDP_CONFIG = REPO / "accelerate_configs" / "cpu_ddp.yaml"
LAUNCH_TIMEOUT_S = 300  # both launches together

# float32 tolerance for parameters after each step: tight enough that the
# mean-of-means / per-micro-batch-mean arithmetic fails it (test_oracle_is_sensitive).
ATOL, RTOL = 1e-6, 1e-5
LOSS_RTOL = 1e-5
SENSITIVITY_FACTOR = 10  # the wrong oracles must miss by at least this many ATOLs

SEED = 0
LR = 0.5
PAD_ID = 0
B = 2  # micro-batch size per process
N_EXAMPLES = 20  # multiple of B * W for W in (1, 2); 10 resp. 5 micro-batches per process
MODEL_CONFIG = dict(
    vocab_size=64,
    n_embd=16,
    n_layer=2,
    n_head=2,
    n_positions=32,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=1,
    eos_token_id=1,
)


MAX_GRAD_NORM = 0.05  # below the unclipped big-batch gradient norm (checked in the clipping test)


#: Batch-size warm-up: K=1 for the first step, 3 for steps 2-3, then 2. On 2 processes (5 micro-batches
#: per epoch) the windows are 1, 3, 1 (partial) | 2, 2, 1 (partial); on one (10): 1, 3, 3, 2, 1 | 2 x 5.
SCHEDULE = [[0, 1], [1, 3], [3, 2]]


def _sc(name, K, mode="tokens", sync_each_batch=False, epochs=1, max_train_steps=None, max_grad_norm=None,
        mixed_precision="no", schedule=None):
    return {"name": name, "K": K, "B": B, "mode": mode, "sync_each_batch": sync_each_batch,
            "epochs": epochs, "max_train_steps": max_train_steps, "max_grad_norm": max_grad_norm,
            "mixed_precision": mixed_precision, "schedule": schedule}


SCENARIOS = {
    1: [
        _sc("tok_k1", 1),
        _sc("tok_k3", 3),
        _sc("tok_k4", 4),
        _sc("mean_k3", 3, "mean"),
        _sc("tok_k3_2ep", 3, epochs=2),  # epoch: windows of 3, 3, 3, 1 micro-batches
        _sc("tok_k3_max2", 3, max_train_steps=2),  # 2 of the epoch's 4 steps
        _sc("tok_k4_clip", 4, max_grad_norm=MAX_GRAD_NORM),
        _sc("tok_sched_2ep", 1, epochs=2, schedule=SCHEDULE),
    ],
    2: [
        _sc("tok_k1", 1),
        _sc("tok_k3", 3),
        _sc("tok_k4", 4),
        _sc("mean_k3", 3, "mean"),
        _sc("mean_k4", 4, "mean"),
        _sc("tok_k3_sync_each", 3, sync_each_batch=True),
        _sc("tok_k3_2ep", 3, epochs=2),  # epoch: windows of 3, 2 micro-batches per process
        _sc("tok_k2_max2", 2, max_train_steps=2),  # 2 of the epoch's 3 steps; 1 micro-batch left
        _sc("tok_k3_max3", 3, max_train_steps=3),  # overrides num_train_epochs=1: stops inside epoch 2
        _sc("tok_k3_clip", 3, max_grad_norm=MAX_GRAD_NORM),
        _sc("tok_sched_2ep", 1, epochs=2, schedule=SCHEDULE),  # K of the Accelerator at build time: the first
    ],
}


def _is_base(sc) -> bool:
    """One full epoch, no clipping, fp32, one K: the scenarios of the original tests (2) and (3)."""
    return (sc["epochs"] == 1 and sc["max_train_steps"] is None and sc["max_grad_norm"] is None
            and sc["mixed_precision"] == "no" and not sc["schedule"])


def make_examples(n=N_EXAMPLES, seed=1234):
    """Variable-length token sequences; short and long ones alternate so mean-of-means != token mean.

    Some examples mask a prefix ("prompt") with -100 as well, so target tokens are
    counted from labels, not from the attention mask.
    """
    rng = random.Random(seed)
    examples = []
    for i in range(n):
        length = rng.randint(3, 6) if i % 2 == 0 else rng.randint(14, 24)
        ids = [rng.randint(2, MODEL_CONFIG["vocab_size"] - 1) for _ in range(length)]
        n_prompt = rng.choice([0, 0, 1, length // 2])
        labels = [-100] * n_prompt + ids[n_prompt:]
        examples.append({"input_ids": ids, "labels": labels})
    return examples


EXAMPLES = make_examples()

#: Activation checkpointing (docs/memory.md): each scenario is the twin of the one it names with every block's forward
#: run again in backward; non-reentrant (the default) and reentrant under no_sync, and under sync_each_batch.
CHECKPOINTED = {"tok_k3_gc": "tok_k3", "tok_k3_gc_reentrant": "tok_k3", "tok_k3_sync_each_gc": "tok_k3_sync_each"}
SCENARIOS[2] += [{**_sc("tok_k3_gc", 3), "gradient_checkpointing": True},
                 {**_sc("tok_k3_gc_reentrant", 3), "gradient_checkpointing": True,
                  "gradient_checkpointing_kwargs": {"use_reentrant": True}},
                 {**_sc("tok_k3_sync_each_gc", 3, sync_each_batch=True), "gradient_checkpointing": True}]

#: LoRA adapters (peft) on a frozen model, SGD with momentum (tests/lora_oracle.py): under no_sync, sync_each_batch,
#: clipping, and reentrant activation checkpointing (frozen embeddings: transformers makes the blocks' input require
#: grad, else no gradient would reach the adapters); against the float64 single-process PeftModel.
LORA_MAX_GRAD_NORM = 0.01  # below the adapters' unclipped window gradient norms (0.018, 0.026)
LORA_SCENARIOS = [{**_sc(name, 3, **kw), "lora": jh.LORA, "momentum": jh.LORA_MOMENTUM, **extra}
                  for name, kw, extra in (("lora_k3", {}, {}), ("lora_k3_sync_each", {"sync_each_batch": True}, {}),
                                          ("lora_k3_clip", {"max_grad_norm": LORA_MAX_GRAD_NORM}, {}),
                                          ("lora_k3_gc_reentrant", {}, {"gradient_checkpointing": True,
                                           "gradient_checkpointing_kwargs": {"use_reentrant": True}}))]
SCENARIOS[2] += LORA_SCENARIOS

# bf16 autocast (Accelerator(mixed_precision="bf16"), CPU): a full window and the epoch's partial one; see (5).
SCENARIOS[1].append(_sc("bf16_k4", 4, mixed_precision="bf16"))  # windows of 4, 4, 2 micro-batches
SCENARIOS[2].append(_sc("bf16_k3", 3, mixed_precision="bf16"))  # windows of 3, 2 micro-batches per process


# --------------------------------------------------------------------------- launching


def _env():
    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_USE_CPU"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    # The workers import the accum_kit of this checkout, installed or not.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _tail(text: str, n=12000) -> str:
    """Head and tail of a log: the first rank's traceback and torchrun's summary both survive."""
    return text if len(text) <= n else text[: n // 2] + "\n[... cut ...]\n" + text[-n // 2 :]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ddp_pool):
    """Run the worker once per process count (both at once: one process, and 2 processes as a script run of
    conftest.py's shared ``ddp_pool`` launch, tests/dist_worker.py under accelerate_configs/cpu_ddp.yaml);
    load what it saved."""
    root = tmp_path_factory.mktemp("exactness")
    procs, pooled = {}, {}
    for world, scenarios in SCENARIOS.items():
        spec = {"model_config": MODEL_CONFIG, "seed": SEED, "lr": LR, "pad_id": PAD_ID,
                "examples": EXAMPLES, "scenarios": scenarios}
        spec_path = root / f"spec_w{world}.json"
        spec_path.write_text(json.dumps(spec))
        out = root / f"w{world}"
        if world != 1:
            assert world == ddp_pool.num_processes and DDP_CONFIG == jh.DDP_CONFIG
            pooled[world] = (ddp_pool.submit("dist_worker", [spec_path, out], script=WORKER), out)
            continue
        cmd = [sys.executable, str(WORKER), str(spec_path), str(out)]
        log_out, log_err = open(root / f"w{world}.stdout", "w+"), open(root / f"w{world}.stderr", "w+")
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log_out, stderr=log_err, start_new_session=True)
        procs[world] = (cmd, proc, log_out, log_err, out)

    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    failures = []
    try:
        for world, (cmd, proc, *_logs, out) in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failures.append(f"worker with {world} process(es) timed out; killed")
    finally:
        for _, proc, *_ in procs.values():
            jh.stop(proc)  # only the launches this fixture started, workers included
    for world, (cmd, proc, log_out, log_err, out) in procs.items():
        rc = proc.returncode
        for f in (log_out, log_err):
            f.flush()
            f.seek(0)
        stdout, stderr = log_out.read(), log_err.read()
        log_out.close(), log_err.close()
        if rc != 0:
            failures.append(
                f"worker with {world} process(es) failed, rc={rc}\ncmd: {' '.join(cmd)}\n"
                f"--- stderr ---\n{_tail(stderr)}\n--- stdout ---\n{_tail(stdout, 2000)}"
            )
    for world, (command, out) in pooled.items():
        res = command.result()
        if res.returncode != 0:
            failures.append(f"worker with {world} process(es) failed\n{res.describe()}")
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)

    loaded = {}
    for world, out in [(w, p[-1]) for w, p in procs.items()] + [(w, p[1]) for w, p in pooled.items()]:
        loaded[world] = {}
        for sc in SCENARIOS[world]:
            d = out / sc["name"]
            loaded[world][sc["name"]] = {
                "scenario": sc,
                "init": torch.load(d / "init.pt", weights_only=True),
                "steps": torch.load(d / "steps.pt", weights_only=True),
                "ranks": [json.loads((d / f"rank{r}.json").read_text()) for r in range(world)],
            }
    return loaded


# --------------------------------------------------------------------------- oracle


def windows_for(world: int, K: int, b: int = B, examples=EXAMPLES):
    """Accumulation windows as lists of micro-batches (lists of examples), in global-batch order."""
    assert len(examples) % (b * world) == 0
    global_batches = [examples[i : i + b] for i in range(0, len(examples), b)]
    per_process = len(global_batches) // world
    return [
        global_batches[s * K * world : min((s + 1) * K, per_process) * world]
        for s in range(math.ceil(per_process / K))
    ]


def expected_boundaries(micro_batches_per_process: int, K: int):
    """Per local micro-batch: does it end a window (every K-th, and the last of the epoch)?"""
    return [(j + 1) % K == 0 or j == micro_batches_per_process - 1 for j in range(micro_batches_per_process)]


def _epochs(sc):
    """Epoch indices the run may enter: num_train_epochs, or unbounded when max_train_steps is set."""
    return itertools.count() if sc["max_train_steps"] else range(sc["epochs"])


def scheduled_run(world: int, sc, reset_counter=True):
    """The windows of a run under ``sc["schedule"]``: ``[(epoch, [local micro-batch indices], K)]``.

    Written from the schedule's definition only: after ``s`` optimizer steps the next window takes the
    K of the largest key <= s, up to the end of the epoch (a partial window is still a step).
    ``reset_counter=False`` is WRONG on purpose: Accelerate's micro-batch counter running on across a
    K switch (it is reset only at the end of the dataloader), so a window ends when counter % K == 0.
    """
    keys = dict((int(a), int(b)) for a, b in sc["schedule"])
    per_process = N_EXAMPLES // (sc.get("B", B) * world)
    out = []
    for epoch in range(sc["epochs"]):
        window, counter = [], 0
        for j in range(per_process):
            k = keys[max(key for key in keys if key <= len(out))]
            window.append(j)
            counter += 1
            full = (counter % k == 0) if not reset_counter else len(window) == k
            if full or j == per_process - 1:
                out.append((epoch, window, k))
                window = []
    return out


def expected_schedule(world: int, sc):
    """Per local micro-batch of the whole run: (epoch, boundary). Each epoch restarts the windows;
    the run stops right after the max_train_steps-th boundary."""
    if sc.get("schedule"):
        return [(epoch, j == w[-1]) for epoch, w, _ in scheduled_run(world, sc) for j in w]
    per_process = N_EXAMPLES // (B * world)
    epoch_flags = expected_boundaries(per_process, sc["K"])
    schedule, steps = [], 0
    for epoch in _epochs(sc):
        for boundary in epoch_flags:
            schedule.append((epoch, boundary))
            steps += boundary
            if steps == sc["max_train_steps"]:
                return schedule
    return schedule


def run_windows(world: int, sc, reset_counter=True):
    """The windows of the whole run: the epoch's windows once per epoch, cut after max_train_steps."""
    b = sc.get("B", B)
    if sc.get("schedule"):
        global_batches = [EXAMPLES[i : i + b] for i in range(0, len(EXAMPLES), b)]
        return [[global_batches[j * world + r] for j in w for r in range(world)]
                for _, w, _ in scheduled_run(world, sc, reset_counter)]
    epoch_windows = windows_for(world, sc["K"], b)
    windows = []
    for _ in _epochs(sc):
        for w in epoch_windows:
            windows.append(w)
            if len(windows) == sc["max_train_steps"]:
                return windows
    return windows


def carry_over_windows(world: int, K: int, epochs: int, b: int = B, examples=EXAMPLES):
    """WRONG on purpose: windows as if the accumulation counter ran on across epochs (no reset at
    the end of the dataloader), i.e. every process's micro-batches of all epochs cut into K's."""
    global_batches = [examples[i : i + b] for i in range(0, len(examples), b)]
    per_process = len(global_batches) // world
    local = [j for _ in range(epochs) for j in range(per_process)]
    return [[global_batches[j * world + r] for j in local[i : i + K] for r in range(world)]
            for i in range(0, len(local), K)]


def example_loss(model, example):
    """(summed next-token NLL, number of target tokens) of one unpadded example."""
    ids = torch.tensor([example["input_ids"]])
    labels = torch.tensor(example["labels"])[1:]  # position t predicts token t+1
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    keep = labels != -100
    nll = -logp[keep].gather(1, labels[keep].unsqueeze(1)).sum()
    return nll, int(keep.sum())


def oracle_run(init, windows, rule, K, world, lr=LR, max_grad_norm=None, clip_before_rescale=False, model_config=None):
    """See :func:`_oracle_run`; runs single-threaded (much faster for this tiny model on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _oracle_run(init, windows, rule, K, world, lr, max_grad_norm, clip_before_rescale, model_config)
    finally:
        torch.set_num_threads(threads)


def _clip_(params, max_norm):
    """torch.nn.utils.clip_grad_norm_ semantics, written out: returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    total_norm = math.sqrt(sum((g.double() ** 2).sum().item() for g in grads))
    coef = min(1.0, max_norm / (total_norm + 1e-6))
    for g in grads:
        g.mul_(coef)
    return total_norm


def _oracle_run(init, windows, rule, K, world, lr, max_grad_norm=None, clip_before_rescale=False, model_config=None):
    """Plain single-process SGD over the windows; returns params after each step and pre-step losses.

    rule:
      "tokens"          loss = sum of all token NLLs in the window / number of target tokens (the big batch).
      "accelerate_mean" loss = (1/W) sum_r (1/K) sum_i mean_i = sum_i mean_i / (K W) over all micro-batches
                        of the window (a partial window is still divided by K).
      "mean_of_means"   loss = mean over the window's micro-batches of their token means.
    max_grad_norm: clip the window's gradient (all parameters, tied ones once) to this global L2 norm
      before the step; each step's unclipped norm is returned as ``losses[s]["grad_norm"]``.
    clip_before_rescale: WRONG on purpose ("tokens" only): clip sum(NLL) / (K W), the gradient before
      the window rescale, and rescale by K W / N afterwards.
    model_config: GPT2Config keyword arguments of the model ``init`` belongs to (None: MODEL_CONFIG).
    """
    model = GPT2LMHeadModel(GPT2Config(**(model_config or MODEL_CONFIG)))
    model.load_state_dict(init)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    params, losses = [], []
    for window in windows:
        opt.zero_grad()
        sums, counts = [], []
        for micro in window:
            parts = [example_loss(model, ex) for ex in micro]
            sums.append(sum(p[0] for p in parts))
            counts.append(sum(p[1] for p in parts))
        token_mean = sum(sums) / sum(counts)
        micro_means = [s / n for s, n in zip(sums, counts)]
        mean_of_means = sum(micro_means) / len(micro_means)
        if rule == "tokens":
            loss = token_mean
        elif rule == "accelerate_mean":
            loss = sum(micro_means) / (K * world)
        elif rule == "mean_of_means":
            loss = mean_of_means
        else:
            raise ValueError(rule)
        loss.backward()
        grad_norm = None
        if max_grad_norm is not None:
            if clip_before_rescale:
                assert rule == "tokens"
                ratio = sum(counts) / (K * world)
                for p in model.parameters():
                    p.grad.mul_(ratio)
                _clip_(model.parameters(), max_grad_norm)
                for p in model.parameters():
                    p.grad.div_(ratio)
            else:
                grad_norm = _clip_(model.parameters(), max_grad_norm)
        opt.step()
        params.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        losses.append({"tokens": token_mean.item(), "mean_of_means": mean_of_means.item(),
                       "tokens_count": sum(counts), "grad_norm": grad_norm})
    return params, losses


def max_excess(a: dict, b: dict) -> tuple[float, float]:
    """(max |a-b| over all entries, max of |a-b| - (ATOL + RTOL |b|)); the second > 0 means not close."""
    diff, excess = 0.0, -math.inf
    for k in b:
        d = (a[k].double() - b[k].double()).abs()
        diff = max(diff, d.max().item())
        excess = max(excess, (d - (ATOL + RTOL * b[k].double().abs())).max().item())
    return diff, excess


def assert_resumed_equals_uninterrupted(run, step: int) -> None:
    """dist_worker's run resumed from its step-``step`` checkpoint: every later step's parameters bit for bit,
    and on every rank the restored and continued loss history, equal to the uninterrupted run's."""
    resumed = run["resumed"][step]
    assert len(resumed["steps"]) == len(run["steps"]) - step
    for s, (got, want) in enumerate(zip(resumed["steps"], run["steps"][step:])):
        for k in want:
            assert torch.equal(got[k], want[k]), f"resumed at {step}: {k} differs after step {step + s + 1}"
    for info, full in zip(resumed["ranks"], run["ranks"]):
        assert info["resumed_from_step"] == step
        assert info["train_loss"] == full["train_loss"], "the restored and continued loss history differs"


def assert_params_match(saved_steps, oracle_params, label):
    assert len(saved_steps) == len(oracle_params), f"{label}: {len(saved_steps)} steps, oracle {len(oracle_params)}"
    for s, (got, want) in enumerate(zip(saved_steps, oracle_params)):
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], atol=ATOL, rtol=RTOL,
                msg=lambda m, s=s, k=k: f"{label}: parameter {k} after optimizer step {s + 1}: {m}",
            )


def _cases(mode):
    return [(w, sc["name"]) for w, scs in SCENARIOS.items() for sc in scs
            if sc["mode"] == mode and _is_base(sc) and not sc.get("lora")]


def _cases_where(pred):
    """The scenarios of a full-model run matching ``pred`` (the LoRA ones have their own oracle, test (7))."""
    return [(w, sc["name"]) for w, scs in SCENARIOS.items() for sc in scs if pred(sc) and not sc.get("lora")]


# --------------------------------------------------------------------------- (1) all-reduces only on boundaries


@pytest.mark.parametrize("name", [sc["name"] for sc in SCENARIOS[2]])
def test_allreduce_only_on_window_boundaries(runs, name):
    run = runs[2][name]
    sc = run["scenario"]
    per_process = N_EXAMPLES // (B * 2)
    boundary = [b for _, b in expected_schedule(2, sc)]  # every epoch restarts its windows
    should_sync = [True] * len(boundary) if sc["sync_each_batch"] else boundary
    counts_by_rank = []
    for info in run["ranks"]:
        r = info["rank"]
        assert info["num_processes"] == 2 and "MULTI_CPU" in info["distributed_type"], info["distributed_type"]
        assert info["comm_hook_registered"], f"rank {r}: prepared model is not DDP"
        assert info["len_dataloader"] == per_process
        assert info["micro_batches"] == len(boundary)
        assert info["optimizer_steps"] == sum(boundary)
        micro = info["micro"]
        counts = [m["allreduce_calls"] for m in micro]
        counts_by_rank.append(counts)
        assert [m["boundary"] for m in micro] == boundary, f"rank {r}: boundary flags"
        assert [c > 0 for c in counts] == should_sync, (
            f"rank {r}, K={sc['K']}, sync_each_batch={sc['sync_each_batch']}: all-reduce calls per micro-batch "
            f"{counts}, expected calls exactly on micro-batches {[j for j, x in enumerate(should_sync) if x]}"
        )
        assert [m["sync"] for m in micro] == should_sync, f"rank {r}: LoopState.sync disagrees with the all-reduces"
        assert info["stray_allreduce_calls"] == 0
    assert counts_by_rank[0] == counts_by_rank[1], f"ranks disagree on all-reduce counts: {counts_by_rank}"


# --------------------------------------------------------------------------- (2) tokens mode == one big batch


@pytest.mark.parametrize("world,name", _cases("tokens"))
def test_tokens_mode_matches_big_batch_each_step(runs, world, name):
    run = runs[world][name]
    sc = run["scenario"]
    windows = windows_for(world, sc["K"])
    assert any(len(w) < sc["K"] * world for w in windows[-1:]) or sc["K"] == 1, "scenario lacks a partial window"
    params, losses = oracle_run(run["init"], windows, "tokens", sc["K"], world)
    label = f"W={world} {name}"
    assert_params_match(run["steps"], params, label)
    for info in run["ranks"]:
        assert info["num_processes"] == world, f"{label}: rank {info['rank']} trained alone"
        assert info["loss"]["implementation"] == "chunked", f"{label}: {info['loss']}"  # the output layer's loss ran
        assert info["step_tokens"] == [l["tokens_count"] for l in losses], f"{label}: window token counts"
        assert info["train_loss"] == pytest.approx([l["tokens"] for l in losses], rel=LOSS_RTOL), (
            f"{label} rank {info['rank']}: logged loss is not the window token-mean at pre-step params"
        )


# --------------------------------------------------------------------------- (3) mean mode == Accelerate's arithmetic


@pytest.mark.parametrize("world,name", _cases("mean"))
def test_mean_mode_matches_accelerate_arithmetic(runs, world, name):
    run = runs[world][name]
    sc = run["scenario"]
    windows = windows_for(world, sc["K"])
    assert len(windows[-1]) < sc["K"] * world, "scenario lacks a partial window"
    params, losses = oracle_run(run["init"], windows, "accelerate_mean", sc["K"], world)
    label = f"W={world} {name}"
    assert_params_match(run["steps"], params, label)
    for info in run["ranks"]:
        assert info["num_processes"] == world, f"{label}: rank {info['rank']} trained alone"
        # In mean mode the loop logs the mean of the window's micro-batch means (LoopResult docs / loss.finish).
        assert info["train_loss"] == pytest.approx([l["mean_of_means"] for l in losses], rel=LOSS_RTOL), label


@pytest.mark.parametrize("world,name", _cases_where(lambda sc: True))
def test_no_host_read_in_a_window(runs, world, name):
    """Neither accum_kit nor Accelerate reads a tensor's value on the host in any micro-batch of a window, its
    boundary included (tests/host_reads.py wraps every tensor read; the window's count, rescale and next divisor
    stay on the device, and the logged figures are read when asked for, after the run here); the model's own
    reads (transformers' attention-mask checks) are counted apart and left alone."""
    from host_reads import loop_reads, owner_of

    for info in runs[world][name]["ranks"]:
        reads = info["host_reads"]
        inside, windows = loop_reads(reads)
        label = f"W={world} {name} rank {info['rank']}"
        assert len(windows) == info["optimizer_steps"] and len(inside) == info["micro_batches"] - len(windows), label
        assert not any(inside) and not any(windows), f"{label}: {inside} {windows}"
        assert not [s for s in (*reads["start"], *reads["end"]) if "accum_kit/" in owner_of(s)], label


# --------------------------------------------------------------------------- (4) epochs, max_train_steps, clipping

_RULE = {"tokens": "tokens", "mean": "accelerate_mean"}  # scenario mode -> oracle rule
_LOGGED = {"tokens": "tokens", "mean": "mean_of_means"}  # scenario mode -> what the loop logs


def _check_run_against_oracle(run, world, **oracle_kwargs):
    """Parameters after every step, logged losses and window token counts vs the oracle of run_windows."""
    sc = run["scenario"]
    label = f"W={world} {sc['name']}"
    params, losses = oracle_run(run["init"], run_windows(world, sc), _RULE[sc["mode"]], sc["K"], world,
                                **oracle_kwargs)
    assert_params_match(run["steps"], params, label)
    for info in run["ranks"]:
        assert info["num_processes"] == world, f"{label}: rank {info['rank']} trained alone"
        if sc["mode"] == "tokens":
            assert info["step_tokens"] == [l["tokens_count"] for l in losses], f"{label}: window token counts"
        assert info["train_loss"] == pytest.approx([l[_LOGGED[sc["mode"]]] for l in losses], rel=LOSS_RTOL), (
            f"{label} rank {info['rank']}: logged losses"
        )
    return losses


@pytest.mark.parametrize("world,name", _cases_where(lambda sc: True))
def test_micro_batch_schedule(runs, world, name):
    """Epoch and boundary of every micro-batch, on every process: windows restart at each epoch,
    the run stops right after the max_train_steps-th step."""
    run = runs[world][name]
    sc = run["scenario"]
    schedule = expected_schedule(world, sc)
    for info in run["ranks"]:
        label = f"W={world} {name} rank {info['rank']}"
        assert info["len_dataloader"] == N_EXAMPLES // (B * world), label
        assert [(m["epoch"], m["boundary"]) for m in info["micro"]] == schedule, f"{label}: (epoch, boundary) flags"
        assert info["micro_batches"] == len(schedule), label
        assert info["optimizer_steps"] == sum(b for _, b in schedule) == len(run_windows(world, sc)), label
        assert info["epochs"] == schedule[-1][0] + 1, f"{label}: LoopResult.epochs"
    assert len(run["steps"]) == len(run_windows(world, sc)), f"W={world} {name}: saved steps"


@pytest.mark.parametrize("world,name", _cases_where(lambda sc: sc["epochs"] > 1 and not sc["schedule"]))
def test_epochs_restart_windows_and_match_big_batch(runs, world, name):
    """Epoch 2 repeats epoch 1's windows; epoch 1's partial window is a step of its own."""
    run = runs[world][name]
    sc = run["scenario"]
    epoch_windows = windows_for(world, sc["K"])
    assert len(epoch_windows[-1]) < sc["K"] * world, "scenario lacks a partial window at the end of an epoch"
    assert len(run_windows(world, sc)) == sc["epochs"] * len(epoch_windows)
    _check_run_against_oracle(run, world)
    for info in run["ranks"]:
        assert info["epochs"] == sc["epochs"]
        assert info["micro_batches"] == sc["epochs"] * info["len_dataloader"]


@pytest.mark.parametrize("world,name", _cases_where(lambda sc: sc["max_train_steps"] is not None))
def test_max_train_steps_stops_mid_epoch(runs, world, name):
    """Exactly max_train_steps steps, the last one inside an epoch (also past num_train_epochs=1)."""
    run = runs[world][name]
    sc = run["scenario"]
    per_process = N_EXAMPLES // (B * world)
    steps_per_epoch = math.ceil(per_process / sc["K"])
    full_epochs, rest = divmod(sc["max_train_steps"], steps_per_epoch)
    assert rest > 0, "scenario does not stop in the middle of an epoch"
    assert len(run["steps"]) == sc["max_train_steps"], f"W={world} {name}: saved steps"
    _check_run_against_oracle(run, world)
    for info in run["ranks"]:
        assert info["optimizer_steps"] == sc["max_train_steps"]
        # the rest < steps_per_epoch windows of the last epoch are all full ones
        assert info["micro_batches"] == full_epochs * per_process + rest * sc["K"] < (full_epochs + 1) * per_process
        assert info["epochs"] == full_epochs + 1


@pytest.mark.parametrize("world,name", _cases_where(lambda sc: sc["max_grad_norm"] is not None))
def test_clipping_matches_clipped_big_batch(runs, world, name):
    """clip_grad_norm_ of the exact big-batch gradient (after the window rescale), then SGD."""
    run = runs[world][name]
    sc = run["scenario"]
    losses = _check_run_against_oracle(run, world, max_grad_norm=sc["max_grad_norm"])
    norms = [l["grad_norm"] for l in losses]
    assert max(norms) > sc["max_grad_norm"], f"unclipped norms {norms} never exceed {sc['max_grad_norm']}: no clipping"


# --------------------------------------------------------------------------- the checks can fail


def _wrong_oracle(run, world, wrong):
    """Final parameters of a wrong oracle: a wrong loss rule, or a wrong reading of the new options."""
    sc = run["scenario"]
    rule, windows = _RULE[sc["mode"]], run_windows(world, sc)
    kwargs = {"max_grad_norm": sc["max_grad_norm"]}
    if wrong == "carry_over":  # accumulation counter not reset at the end of the dataloader
        windows = carry_over_windows(world, sc["K"], sc["epochs"])
    elif wrong == "no_clip":
        kwargs = {}
    elif wrong == "clip_before_rescale":
        kwargs["clip_before_rescale"] = True
    elif wrong == "counter_not_reset":  # Accelerate's micro-batch counter not reset when K changes
        windows = run_windows(world, sc, reset_counter=False)
    elif wrong == "first_k_only":  # the schedule ignored: K of step 0 throughout
        windows = run_windows(world, {**sc, "schedule": [[0, sc["schedule"][0][1]]]})
    else:
        rule = wrong
    params, _ = oracle_run(run["init"], windows, rule, sc["K"], world, **kwargs)
    return params[-1]


@pytest.mark.parametrize(
    "world,name,wrong_rule",
    [
        (1, "tok_k4", "mean_of_means"),
        (1, "tok_k4", "accelerate_mean"),
        (2, "tok_k3", "mean_of_means"),
        (2, "tok_k1", "mean_of_means"),  # K=1 but two ranks: DDP's mean of per-rank means is wrong too
        (2, "mean_k3", "tokens"),
        (2, "mean_k3", "mean_of_means"),  # partial window divided by its own count instead of K
        (1, "mean_k3", "mean_of_means"),
        (1, "tok_k3_2ep", "carry_over"),
        (2, "tok_k3_2ep", "carry_over"),
        (1, "tok_k4_clip", "no_clip"),
        (2, "tok_k3_clip", "no_clip"),
        (1, "tok_k4_clip", "clip_before_rescale"),
        (2, "tok_k3_clip", "clip_before_rescale"),
        (1, "tok_sched_2ep", "counter_not_reset"),
        (2, "tok_sched_2ep", "counter_not_reset"),
        (1, "tok_sched_2ep", "first_k_only"),
        (2, "tok_sched_2ep", "first_k_only"),
    ],
)
def test_oracle_is_sensitive(runs, world, name, wrong_rule):
    """The parameter comparison above would fail for the classic wrong arithmetic."""
    run = runs[world][name]
    diff, excess = max_excess(run["steps"][-1], _wrong_oracle(run, world, wrong_rule))
    assert excess > 0 and diff > SENSITIVITY_FACTOR * ATOL, (
        f"W={world} {name}: the {wrong_rule!r} oracle is within {diff:.2e} of the saved parameters; "
        "the tolerance cannot tell the arithmetics apart"
    )


# --------------------------------------------------------------------------- (5) bf16 autocast vs the fp32 oracle

# Tolerance of a bf16 run, derived from bf16's precision. Which quantities are rounded: under autocast every
# matmul-type op (GPT-2's Conv1D addmm, the attention matmuls, lm_head) takes bf16 inputs and returns a bf16
# output, and elementwise ops on bf16 activations (GELU, residual branches) return bf16; each such rounding
# has relative error <= u = 2^-8 (bf16 keeps 8 significant bits). The GEMMs accumulate in fp32 inside the
# kernel, and layer norm, softmax and the cross-entropy run in fp32 (autocast's fp32 list;
# causal_lm_loss upcasts the logits): their errors are O(2^-24), negligible. Backward rounds the activation
# gradients the same way, and each weight gradient once more when it is cast back to the fp32 parameter.
# How many accumulations: a weight's gradient depends on at most m = 64 bf16 roundings of this 2-layer model
# (about 12 per block forward, 12 back, plus the lm_head, the embeddings and the final casts: < 64).
# Everything after backward is fp32: .grad sums the K micro-batches, DDP sums W processes, the window
# rescale multiplies once; that adds O((K + W) 2^-24), again negligible. Why the bound holds: to first
# order the gradient's relative error is the sum of the m rounding errors propagated to the output; treating
# them as independent, zero-mean (the probabilistic rounding-error model of Higham and Mary, "A New Approach
# to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019) they add in quadrature:
# ||g_bf16 - g|| / ||g|| <= sqrt(m) u = 8 u = 2^-5 ~ 3.1e-2 (normwise, per optimizer step). A per-element
# relative bound would be meaningless (elements near zero lose all relative accuracy), so the test checks
# the norm, and the largest element error against sqrt(m) u times the largest gradient element.
# Compared per step, each at the run's own parameters before that step: bf16 differences would otherwise
# compound over steps. Measured: about 3e-3 (~0.8 u) normwise; mean-of-means misses by 6e-2 to 0.25.
BF16_UNIT_ROUNDOFF = 2.0 ** -8
BF16_ROUNDINGS = 64
BF16_RTOL = math.sqrt(BF16_ROUNDINGS) * BF16_UNIT_ROUNDOFF  # 2^-5


def _update(before: dict, after: dict) -> dict:
    """The gradient an SGD step applied: (before - after) / LR, float64, per parameter."""
    return {k: (before[k].double() - after[k].double()) / LR for k in before}


def _normwise(got: dict, want: dict) -> tuple[float, float]:
    """(||got - want|| / ||want|| over all parameters, max |got - want| / max |want|)."""
    err = math.sqrt(sum(float((got[k] - want[k]).pow(2).sum()) for k in want))
    ref = math.sqrt(sum(float(want[k].pow(2).sum()) for k in want))
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    return err / ref, worst / max(float(want[k].abs().max()) for k in want)


@pytest.mark.parametrize("world,name", _cases_where(lambda sc: sc["mixed_precision"] == "bf16"))
def test_bf16_update_matches_fp32_oracle_each_step(runs, world, name):
    """Each step's update of a bf16 autocast run (full windows and the partial one) equals the fp32 big-batch
    token-mean gradient at the same parameters within sqrt(m) u (BF16_RTOL), and bf16 really ran."""
    run = runs[world][name]
    sc = run["scenario"]
    label = f"W={world} {name}"
    windows = windows_for(world, sc["K"])
    assert len(windows[-1]) < sc["K"] * world, f"{label}: scenario lacks a partial window"
    assert len(run["steps"]) == len(windows), f"{label}: saved steps"
    for info in run["ranks"]:
        assert info["num_processes"] == world and info["mixed_precision"] == "bf16", info
    before, errors = run["init"], []
    for s, window in enumerate(windows):
        after = run["steps"][s]
        oracle_params, losses = oracle_run(before, [window], "tokens", sc["K"], world)
        want = _update(before, oracle_params[0])
        rel, worst = _normwise(_update(before, after), want)
        errors.append(rel)
        assert rel <= BF16_RTOL and worst <= BF16_RTOL, (
            f"{label} step {s + 1} ({len(window)} micro-batches): normwise {rel:.2e}, largest element "
            f"{worst:.2e} of the largest gradient element; tolerance sqrt(m) u = {BF16_RTOL:.2e}")
        for info in run["ranks"]:
            assert info["step_tokens"][s] == losses[0]["tokens_count"], f"{label}: window token counts"
            assert info["train_loss"][s] == pytest.approx(losses[0]["tokens"], rel=BF16_RTOL), label
        if s == 0:  # the tolerance still tells the arithmetics apart
            wrong, _ = oracle_run(before, [window], "mean_of_means", sc["K"], world)
            miss, _ = _normwise(_update(before, wrong[0]), want)
            assert miss > 2 * BF16_RTOL, f"{label}: mean-of-means misses by only {miss:.2e}"
        before = after
    print(f"{label}: bf16 normwise deviation per step {['%.2e' % e for e in errors]}, tolerance {BF16_RTOL:.2e}")
    # fp32 lands near 1e-7 (test (2)); a deviation this small would mean autocast did not run.
    assert max(errors) > 1e-5, f"{label}: deviations {errors} look like fp32: did bf16 autocast run?"


# --------------------------------------------------------------------------- (6) accumulation schedule

_SCHEDULED = _cases_where(lambda sc: bool(sc["schedule"]))


@pytest.mark.parametrize("world,name", _SCHEDULED)
def test_schedule_windows_have_the_schedules_sizes(runs, world, name):
    """The run's windows follow the schedule: K per step, partial windows at epoch ends, and sizes that differ."""
    run = runs[world][name]
    sc = run["scenario"]
    planned = scheduled_run(world, sc)
    ks = [k for _, _, k in planned]
    sizes = [len(w) for _, w, _ in planned]
    assert len(set(ks)) == len(sc["schedule"]) and any(n < k for n, k in zip(sizes, ks)), "scenario too simple"
    if world == 2:
        assert sizes == [1, 3, 1, 2, 2, 1], sizes  # the layout SCHEDULE's comment promises
    for info in run["ranks"]:
        assert info["step_accumulation_steps"] == ks, f"W={world} rank {info['rank']}: K per step"
        assert info["gradient_accumulation_steps"] == ks[-1], "the Accelerator ends on the last window's K"


@pytest.mark.parametrize("world,name", _SCHEDULED)
def test_schedule_matches_big_batch_each_step(runs, world, name):
    """Every window (sizes 1, 3, 2 and partial ones) equals one big batch on one process; prints the
    largest parameter deviation per phase of the schedule."""
    run = runs[world][name]
    sc = run["scenario"]
    losses = _check_run_against_oracle(run, world)
    params, _ = oracle_run(run["init"], run_windows(world, sc), "tokens", sc["K"], world)
    planned = scheduled_run(world, sc)
    phases: dict = {}
    for s, ((_, w, k), got, want) in enumerate(zip(planned, run["steps"], params)):
        diff, _ = max_excess(got, want)
        key = max(a for a, _ in sc["schedule"] if a <= s)
        phases[(key, k)] = max(phases.get((key, k), 0.0), diff)
    print(f"\nW={world} {name}: largest |param - oracle| per phase (from step, K): "
          + ", ".join(f"{key}: {d:.2e}" for key, d in sorted(phases.items())))
    assert len(losses) == len(planned)


# --------------------------------------------------------------------------- (6) activation checkpointing


def assert_checkpointed_like_its_twin(run, twin, world, counted=True) -> tuple[float, float]:
    """A run with ``gradient_checkpointing`` against the oracle and its twin without: the plan recorded it on every
    rank; every block ran its forward twice per micro-batch (the worker's forward hooks on the blocks' attention;
    ``counted=False`` under compilation, where no Python hook runs in a compiled recompute), the twin once; the
    parameters after every step within ATOL of the single-process big batch (not only the elementwise
    ATOL + RTOL |x|); the losses those of the twin. Returns (largest |param - oracle|, largest relative loss gap,
    "seconds of the run / of its twin" on rank 0, as the worker timed them)."""
    n_layer = run["ranks"][0].get("n_layer", MODEL_CONFIG["n_layer"])
    for info, plain in zip(run["ranks"], twin["ranks"]):
        assert info["gradient_checkpointing"] and not plain["gradient_checkpointing"], info["gradient_checkpointing"]
        if counted:
            forwards = [m["block_forwards"] for m in info["micro"]]
            assert set(forwards) == {2 * n_layer}, forwards
            assert {m["block_forwards"] for m in plain["micro"]} == {n_layer}
    _check_run_against_oracle(run, world)
    sc = run["scenario"]
    params, _ = oracle_run(run["init"], run_windows(world, sc), _RULE[sc["mode"]], sc["K"], world)
    worst = max(max_excess(got, want)[0] for got, want in zip(run["steps"], params))
    assert worst <= ATOL, f"{sc['name']}: largest |param - oracle| {worst:.2e}"
    gap = max(abs(a - b) / abs(b) for info, plain in zip(run["ranks"], twin["ranks"])
              for a, b in zip(info["train_loss"], plain["train_loss"]))
    assert len(run["ranks"][0]["train_loss"]) == len(twin["ranks"][0]["train_loss"]) and gap <= LOSS_RTOL, gap
    seconds = [r["ranks"][0].get("scenario_seconds", math.nan) for r in (run, twin)]
    return worst, gap, "{:.1f} s / {:.1f} s".format(*seconds)


@pytest.mark.parametrize("name", list(CHECKPOINTED))
def test_checkpointed_ddp_run_is_the_big_batch_and_its_twin(runs, name):
    """Under DDP (no_sync and sync_each_batch), reentrant included: recomputing the blocks changes no update."""
    worst, gap, seconds = assert_checkpointed_like_its_twin(runs[2][name], runs[2][CHECKPOINTED[name]], 2)
    kwargs = runs[2][name]["ranks"][0]["gradient_checkpointing_kwargs"]
    assert kwargs == {"use_reentrant": name.endswith("reentrant")}, kwargs
    print(f"\n{name} (DDP, {kwargs}): largest |param - oracle| {worst:.2e}, largest loss gap to "
          f"{CHECKPOINTED[name]} {gap:.1e}; {seconds}")


# --------------------------------------------------------------------------- (7) LoRA adapters on a frozen model


@pytest.mark.parametrize("name", [sc["name"] for sc in LORA_SCENARIOS])
def test_lora_run_is_the_float64_big_batch_of_the_same_peft_model(runs, name):
    """Under DDP (no_sync, sync_each_batch, clipping, reentrant checkpointing): every adapter parameter within the
    fp32 criterion of the float64 single-process PeftModel after every step, every frozen parameter bitwise its
    initial value, optimizer state for the adapters only (tests/lora_oracle.py); the loss computed in the output
    layer (LoRA is not on it)."""
    import lora_oracle

    run = runs[2][name]
    worst = lora_oracle.assert_lora_run(run, 2, f"DDP {name}")
    for info in run["ranks"]:
        assert info["loss"]["implementation"] == "chunked", info["loss"]
    if run["scenario"].get("gradient_checkpointing"):
        forwards = {m["block_forwards"] for m in run["ranks"][0]["micro"]}
        assert forwards == {2 * MODEL_CONFIG["n_layer"]}, f"the blocks did not recompute: {forwards}"
    print(f"\nDDP {name}: largest |adapter - float64 oracle| {worst:.2e}")
