"""Exactness and no_sync checks of accum_kit.train_loop against independent oracles.

One launch per process count runs every scenario (tests/dist_worker.py): one
plain process, and two gloo processes through ``accelerate launch`` with
accelerate_configs/cpu_ddp.yaml. The worker saves the parameters after every
optimizer step, the logged losses, and, per micro-batch, how many DDP gradient
all-reduces (comm-hook calls) ran. Everything expected is computed here by a
plain single-process PyTorch loop: no Accelerate and no accum_kit code.

Data layout the oracle relies on (documented Accelerate behaviour): with
``shuffle=False`` and ``split_batches=False``, process r gets global batches
r, r+W, r+2W, ...; so accumulation window s (K micro-batches per process) is
global batches s*K*W ... (s+1)*K*W-1, i.e. consecutive dataset examples. The
dataset size is a multiple of B*W so ``even_batches`` never duplicates examples,
and the number of micro-batches per process is not a multiple of K, so every
scenario ends with a partial window.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dist_worker.py"
DDP_CONFIG = REPO / "accelerate_configs" / "cpu_ddp.yaml"

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


def _sc(name, K, mode="tokens", sync_each_batch=False):
    return {"name": name, "K": K, "B": B, "mode": mode, "sync_each_batch": sync_each_batch}


SCENARIOS = {
    1: [_sc("tok_k1", 1), _sc("tok_k3", 3), _sc("tok_k4", 4), _sc("mean_k3", 3, "mean")],
    2: [
        _sc("tok_k1", 1),
        _sc("tok_k3", 3),
        _sc("tok_k4", 4),
        _sc("mean_k3", 3, "mean"),
        _sc("mean_k4", 4, "mean"),
        _sc("tok_k3_sync_each", 3, sync_each_batch=True),
    ],
}


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


# --------------------------------------------------------------------------- launching


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
def runs(tmp_path_factory):
    """Run the worker once per process count (both launches concurrently); load what it saved."""
    root = tmp_path_factory.mktemp("exactness")
    procs = {}
    for world, scenarios in SCENARIOS.items():
        spec = {"model_config": MODEL_CONFIG, "seed": SEED, "lr": LR, "pad_id": PAD_ID,
                "examples": EXAMPLES, "scenarios": scenarios}
        spec_path = root / f"spec_w{world}.json"
        spec_path.write_text(json.dumps(spec))
        out = root / f"w{world}"
        if world == 1:
            cmd = [sys.executable, str(WORKER), str(spec_path), str(out)]
        else:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG),
                   "--num_processes", str(world), "--main_process_port", str(_free_port()),
                   str(WORKER), str(spec_path), str(out)]
        log_out, log_err = open(root / f"w{world}.stdout", "w+"), open(root / f"w{world}.stderr", "w+")
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log_out, stderr=log_err, start_new_session=True)
        procs[world] = (cmd, proc, log_out, log_err, out)

    deadline = time.monotonic() + 300
    failures = []
    try:
        for world, (cmd, proc, *_logs, out) in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failures.append(f"worker with {world} process(es) timed out; killed")
    finally:
        for cmd, proc, *_ in procs.values():
            if proc.poll() is None:  # only the launches this fixture started (own session / group)
                os.killpg(proc.pid, 9)
                proc.wait()
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
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)

    loaded = {}
    for world, (*_, out) in procs.items():
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


def example_loss(model, example):
    """(summed next-token NLL, number of target tokens) of one unpadded example."""
    ids = torch.tensor([example["input_ids"]])
    labels = torch.tensor(example["labels"])[1:]  # position t predicts token t+1
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    keep = labels != -100
    nll = -logp[keep].gather(1, labels[keep].unsqueeze(1)).sum()
    return nll, int(keep.sum())


def oracle_run(init, windows, rule, K, world, lr=LR):
    """See :func:`_oracle_run`; runs single-threaded (much faster for this tiny model on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _oracle_run(init, windows, rule, K, world, lr)
    finally:
        torch.set_num_threads(threads)


def _oracle_run(init, windows, rule, K, world, lr):
    """Plain single-process SGD over the windows; returns params after each step and pre-step losses.

    rule:
      "tokens"          loss = sum of all token NLLs in the window / number of target tokens (the big batch).
      "accelerate_mean" loss = (1/W) sum_r (1/K) sum_i mean_i = sum_i mean_i / (K W) over all micro-batches
                        of the window (a partial window is still divided by K).
      "mean_of_means"   loss = mean over the window's micro-batches of their token means.
    """
    model = GPT2LMHeadModel(GPT2Config(**MODEL_CONFIG))
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
        opt.step()
        params.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        losses.append({"tokens": token_mean.item(), "mean_of_means": mean_of_means.item(), "tokens_count": sum(counts)})
    return params, losses


def max_excess(a: dict, b: dict) -> tuple[float, float]:
    """(max |a-b| over all entries, max of |a-b| - (ATOL + RTOL |b|)); the second > 0 means not close."""
    diff, excess = 0.0, -math.inf
    for k in b:
        d = (a[k].double() - b[k].double()).abs()
        diff = max(diff, d.max().item())
        excess = max(excess, (d - (ATOL + RTOL * b[k].double().abs())).max().item())
    return diff, excess


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
    return [(w, sc["name"]) for w, scs in SCENARIOS.items() for sc in scs if sc["mode"] == mode]


# --------------------------------------------------------------------------- (1) all-reduces only on boundaries


@pytest.mark.parametrize("name", [sc["name"] for sc in SCENARIOS[2]])
def test_allreduce_only_on_window_boundaries(runs, name):
    run = runs[2][name]
    sc = run["scenario"]
    per_process = N_EXAMPLES // (B * 2)
    boundary = expected_boundaries(per_process, sc["K"])
    should_sync = [True] * per_process if sc["sync_each_batch"] else boundary
    counts_by_rank = []
    for info in run["ranks"]:
        r = info["rank"]
        assert info["num_processes"] == 2 and "MULTI_CPU" in info["distributed_type"], info["distributed_type"]
        assert info["comm_hook_registered"], f"rank {r}: prepared model is not DDP"
        assert info["len_dataloader"] == per_process
        assert info["micro_batches"] == per_process
        assert info["optimizer_steps"] == math.ceil(per_process / sc["K"])
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


# --------------------------------------------------------------------------- the checks can fail


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
    ],
)
def test_oracle_is_sensitive(runs, world, name, wrong_rule):
    """The parameter comparison above would fail for the classic wrong arithmetic."""
    run = runs[world][name]
    sc = run["scenario"]
    wrong, _ = oracle_run(run["init"], windows_for(world, sc["K"]), wrong_rule, sc["K"], world)
    diff, excess = max_excess(run["steps"][-1], wrong[-1])
    assert excess > 0 and diff > SENSITIVITY_FACTOR * ATOL, (
        f"W={world} {name}: the {wrong_rule!r} oracle is within {diff:.2e} of the saved parameters; "
        "the tolerance cannot tell the arithmetics apart"
    )
