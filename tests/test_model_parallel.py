"""Tensor and context parallel under accumulation: each token counted once, every FSDP2 policy exact.

Two command pools of 4 gloo processes, one per mesh: accelerate_configs/cpu_tp.yaml (dp_shard 2 x tp 2) and
cpu_cp.yaml (dp_shard 2 x cp 2, the Ulysses sequence split). Each runs tests/mesh_worker.py (a seeded
Llama with the same variable-length, partly masked examples as tests/test_exactness.py: one example per
micro-batch and data-parallel rank, 10 micro-batches per rank, so K=3 ends each epoch with a partial window)
and then the train job on the Llama preset. The oracle is the plain single-process big batch (one window,
SGD, written here); the train job's losses are compared with the same job under DDP on 2 processes.

Wrong counts are run for real too: the token count over every process (tp ranks included) and over the
local cp slice only, the miscounts reported against several public trainers.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import command_pool
import job_helpers as jh
import test_exactness as ex

TP_CONFIG = jh.REPO / "accelerate_configs" / "cpu_tp.yaml"
CP_CONFIG = jh.REPO / "accelerate_configs" / "cpu_cp.yaml"
TIMEOUT_S = 480
DP, SPLIT = 2, 2  # data-parallel ranks; tp (or cp) ranks per data-parallel rank
POLICIES = ("no_sync", "sync_each_batch", "no_sync_no_reshard_after_backward", "no_sync_no_reshard")
MODEL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
K = 3
SCENARIOS = [
    *[{"name": f"k3_{p}", "K": K, "policy": p} for p in POLICIES],
    {"name": "k3_clip", "K": K, "policy": "no_sync", "max_grad_norm": ex.MAX_GRAD_NORM},
    {"name": "k3_resume", "K": K, "policy": "no_sync", "epochs": 2, "resume_from": [2]},
]
WRONG = {"tp": "world", "cp": "cp_slice"}
JOB = ["--model_preset", "llama_tiny", "--block_size", "64", "--learning_rate", "3e-3", "--num_warmup_steps", "0",
       "--max_train_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
       "--max_train_samples", "64", "--max_eval_samples", "16", "--logging_steps", "2"]
VERIFY_K = 2  # accum-kit verify on the mesh: a full window of 2 micro-batches and a partial one of 1
VERIFY = ["--model_preset", "llama_tiny", "--gradient_accumulation_steps", VERIFY_K]
MISCOUNT_ROWS = {"tp": "tokens counted over every process", "cp": "tokens of the local cp slice only"}


def _load(d, world):
    return {"steps": torch.load(d / "steps.pt", weights_only=True),
            "ranks": [json.loads((d / f"rank{r}.json").read_text()) for r in range(world)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ddp_pool):
    """``{"tp"|"cp": {scenario name: {"scenario", "init", "steps", "ranks", "resumed"}, "job": summary},
    "ddp_job": summary}``: both pools run at once, the DDP job on the session's DDP pool."""
    root = tmp_path_factory.mktemp("model_parallel")
    corpus = jh.write_corpus(root / "corpus.txt")
    pools, pending, verifies = {}, {}, {}
    try:
        for kind, config in (("tp", TP_CONFIG), ("cp", CP_CONFIG)):
            work = root / kind
            work.mkdir()
            scenarios = [*SCENARIOS, {"name": f"k3_wrong_{WRONG[kind]}", "K": K, "policy": "no_sync",
                                      "wrong": WRONG[kind]}]
            spec = {"model_config": MODEL, "seed": ex.SEED, "lr": ex.LR, "pad_id": ex.PAD_ID,
                    "examples": ex.EXAMPLES, "scenarios": scenarios}
            (work / "spec.json").write_text(json.dumps(spec))
            pools[kind] = pool = command_pool.CommandPool(work / "pool", config, num_processes=4, timeout=TIMEOUT_S)
            # first: a tp model fails once the train job has ended the process group and the pool formed a new one
            verifies[kind] = pool.submit("verify", [*VERIFY, "--json", work / "verify.json"])
            pending[kind] = (pool.submit("mesh_worker", [work / "spec.json", work / "out"],
                                         script=jh.REPO / "tests" / "mesh_worker.py"),
                             pool.submit("train", ["--train_file", corpus, "--output_dir", work / "job", *JOB,
                                                   "--profile_comm"],
                                         datasets_cache=root / f"hf_cache_{kind}"), scenarios)
        ddp_job = ddp_pool.submit("train", ["--train_file", corpus, "--output_dir", root / "ddp_job", *JOB],
                                  datasets_cache=root / "hf_cache_ddp")
        out = {}
        for kind, (worker, job, scenarios) in pending.items():
            for name, cmd in (("worker", worker), ("job", job)):
                res = cmd.result(TIMEOUT_S)
                if res.returncode != 0:
                    pytest.fail(f"{kind} {name} failed\n{res.describe()}", pytrace=False)
            base = root / kind / "out"
            out[kind] = {sc["name"]: {"scenario": sc, "init": torch.load(base / sc["name"] / "init.pt", weights_only=True),
                                      **_load(base / sc["name"], 4),
                                      "resumed": {s: _load(base / sc["name"] / f"resumed_{s}", 4)
                                                  for s in sc.get("resume_from", [])}}
                         for sc in scenarios}
            out[kind]["job"] = json.loads((root / kind / "job" / "train_summary.json").read_text())
            out[kind]["job_dir"] = root / kind / "job"
        for kind, cmd in verifies.items():
            res = cmd.result(TIMEOUT_S)
            if res.returncode != 0:
                pytest.fail(f"{kind} verify failed\n{res.describe()}", pytrace=False)
            out[kind]["verify"] = json.loads((root / kind / "verify.json").read_text())
        res = ddp_job.result(TIMEOUT_S)
        if res.returncode != 0:
            pytest.fail(f"DDP job failed\n{res.describe()}", pytrace=False)
        out["ddp_job"] = json.loads((root / "ddp_job" / "train_summary.json").read_text())
        out["ddp_job_dir"] = root / "ddp_job"
        return out
    finally:
        for pool in pools.values():
            pool.close()


# --------------------------------------------------------------------------- the single-process oracle


def _model(init):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    missing, unexpected = model.load_state_dict(init, strict=False)
    assert not unexpected and not [k for k in missing if k in dict(model.named_parameters())]
    return model


def oracle(init, epochs=1, max_grad_norm=None, count_factor=1.0):
    """Parameters after each step and the windows' (token-mean loss, target tokens) of one process running the big
    batch of every window (all data-parallel ranks' micro-batches), SGD; ``count_factor`` multiplies the token
    count the loss is divided by (``tp``: what counting over every process does)."""
    model = _model(init)
    opt = torch.optim.SGD(model.parameters(), lr=ex.LR)
    params, windows = [], []
    torch.set_num_threads(1)
    for _ in range(epochs):
        for window in ex.windows_for(DP, K, 1):
            opt.zero_grad()
            parts = [ex.example_loss(model, e) for micro in window for e in micro]
            total, n = sum(p[0] for p in parts), sum(p[1] for p in parts)
            (total / (n * count_factor)).backward()
            if max_grad_norm is not None:
                ex._clip_(list(model.parameters()), max_grad_norm)
            opt.step()
            params.append({k: v.detach().clone() for k, v in model.named_parameters()})
            windows.append((total.item() / n, n))
    return params, windows


def _check(run, label, **kw):
    params, windows = oracle(run["init"], epochs=run["scenario"].get("epochs", 1), **kw)
    ex.assert_params_match(run["steps"], params, label)
    for info in run["ranks"]:
        assert info["num_processes"] == 4
        # cp: the loss in the output layer; tp: from the gathered logits (a vocabulary-split layer cannot)
        assert info["loss"]["implementation"] == ("logits" if "tp" in label else "chunked"), (label, info["loss"])
        assert info["step_tokens"] == [n for _, n in windows], f"{label} rank {info['rank']}: tokens counted"
        assert info["train_loss"] == pytest.approx([l for l, _ in windows], rel=ex.LOSS_RTOL), label
    return params, windows


def _distance(steps, params) -> float:
    return max((a[k] - b[k]).abs().max().item() for a, b in zip(steps, params) for k in b)


# --------------------------------------------------------------------------- exact, and counted once


@pytest.mark.parametrize("kind", ["tp", "cp"])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_equals_the_single_process_big_batch(runs, kind, policy):
    """dp x tp and dp x cp, K=3 with a partial last window, variable lengths and masked prompts: the parameters
    after every step within 1e-6 of the oracle, each window's tokens counted once (never tp times, never a
    slice), the logged losses the big batch's."""
    run = runs[kind][f"k3_{policy}"]
    assert len(ex.windows_for(DP, K, 1)[-1]) < K * DP, "no partial window"
    params, _ = _check(run, f"{kind} {policy}")
    print(f"\n{kind} {policy}: largest |param - oracle| {_distance(run['steps'], params):.1e}")
    assert {r["label"] for r in run["ranks"]} == {f"FSDP2 2 x {kind} 2"}


@pytest.mark.parametrize("kind", ["tp", "cp"])
def test_clipping_takes_the_global_norm_over_every_mesh_dimension(runs, kind):
    """Clipped by the norm over all parameters of the model, tp shards and the plain norm weights counted once:
    the clipped big batch; the unclipped one is far off."""
    run = runs[kind]["k3_clip"]
    _check(run, f"{kind} clip", max_grad_norm=ex.MAX_GRAD_NORM)
    norms = [n for n in run["ranks"][0]["grad_norms"]]
    assert max(norms) > ex.MAX_GRAD_NORM and all(r["grad_norms"] == norms for r in run["ranks"])
    unclipped, _ = oracle(run["init"])
    assert _distance(run["steps"], unclipped) > ex.SENSITIVITY_FACTOR * ex.ATOL


def test_counting_over_every_process_would_divide_the_update_by_tp(runs):
    """The miscount "each token counted tp_size times": the window's tokens summed over all 4 processes. Run for
    real, it is the big batch's update divided by tp (exactly, as an oracle with twice the count shows), far
    from what the loop does."""
    run, right = runs["tp"]["k3_wrong_world"], runs["tp"]["k3_no_sync"]
    params, _ = oracle(run["init"], count_factor=SPLIT)
    ex.assert_params_match(run["steps"], params, "tp counted over the world")
    assert run["ranks"][0]["step_tokens"] == [SPLIT * t for t in right["ranks"][0]["step_tokens"]]
    good, _ = oracle(run["init"])
    assert _distance(run["steps"], good) > ex.SENSITIVITY_FACTOR * ex.ATOL
    print(f"\ncounted over every process: largest |param - big batch| {_distance(run['steps'], good):.1e}")


def test_counting_only_the_local_cp_slice_is_not_what_the_loop_does(runs):
    """The miscount "undercounted by a factor of cp": each rank divides by its own slice's tokens summed over the
    data-parallel ranks. Run for real: fewer tokens counted than the window has, an update far from the big
    batch, and ranks that disagree on the count."""
    run, right = runs["cp"]["k3_wrong_cp_slice"], runs["cp"]["k3_no_sync"]
    good, windows = oracle(run["init"])
    assert _distance(run["steps"], good) > ex.SENSITIVITY_FACTOR * ex.ATOL
    print(f"\nlocal cp slice counted: largest |param - big batch| {_distance(run['steps'], good):.1e}, "
          f"counts {[r['step_tokens'] for r in run['ranks']]} vs {[n for _, n in windows]}")
    counts = [r["step_tokens"] for r in run["ranks"]]
    assert all(sum(c) < sum(n for _, n in windows) for c in counts)
    assert len({tuple(c) for c in counts}) > 1, "every rank counted the same"
    assert right["ranks"][0]["step_tokens"] == [n for _, n in windows]


@pytest.mark.parametrize("kind", ["tp", "cp"])
def test_resume_is_bitwise_on_the_mesh(runs, kind):
    """A sharded checkpoint saved after step 2 of a 2-epoch run, resumed in a fresh run: every later step bit for
    bit the uninterrupted run's, and that run the big batch."""
    run = runs[kind]["k3_resume"]
    ex.assert_resumed_equals_uninterrupted(run, 2)
    _check(run, f"{kind} resume")


# --------------------------------------------------------------------------- the train job


@pytest.mark.parametrize("kind", ["tp", "cp"])
def test_the_train_job_on_the_mesh_equals_ddp(runs, kind):
    """The train job on llama_tiny under cpu_tp.yaml / cpu_cp.yaml and under DDP on 2 processes, same data: the
    losses within 1e-5 relative, the same effective batch (tp and cp ranks share their data-parallel rank's
    examples) and the same token throughput basis (each token once)."""
    got, want = runs[kind]["job"], runs["ddp_job"]
    assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
    assert got["eval_loss_before"] == pytest.approx(want["eval_loss_before"], rel=1e-5)
    assert got["eval_loss_after"] == pytest.approx(want["eval_loss_after"], rel=1e-5)
    assert (got["world_size"], got["data_parallel_size"], got["effective_batch_size"]) == \
        (4, DP, want["effective_batch_size"])
    assert want["world_size"] == DP


@pytest.mark.parametrize("kind", ["tp", "cp"])
def test_the_profiler_counts_each_mesh_dimensions_collectives_as_the_cost_table_does(runs, kind):
    """The tp and cp jobs ran with --profile_comm: per micro-batch, synchronising or not, the tp group's
    all-reduces and the logits' all-gather (2 L + 1 + 1 forward, 5 L + 1 backward, L = 2) and the cp group's
    all-to-alls (8 L) are what engines/mesh_costs.py's table says, and none of them is gradient
    synchronisation; the window's token count is one scalar all-reduce per window on the dp x cp group."""
    from accum_kit.engines.mesh_costs import cp_collectives, dense_transformer, tp_collectives

    by = runs[kind]["job"]["comm"]["by_mesh_dim"]["by_dim"]
    model = dense_transformer("llama_tiny")  # calls do not depend on the vocabulary
    table = tp_collectives(model, 2, 1, 1, 4) if kind == "tp" else cp_collectives(model, 2, 1, 1, 1, 4)
    per_micro_batch = sum(c.calls for c in table)  # K = 1: calls per micro-batch
    assert per_micro_batch == (17 if kind == "tp" else 16)
    dim = by[kind]
    assert dim["calls_per_sync_micro_batch"] == dim["calls_per_no_sync_micro_batch"] == per_micro_batch, dim
    assert "gradient_sync" not in dim["by_class"]
    counts = by["dp_cp"] if kind == "tp" else by["dp_shard_cp"]  # under cp the dp x cp ranks are FSDP2's group
    assert counts["by_phase"]["step"]["calls_per_window"] >= 1


def test_a_tp_trained_model_saves_whole_and_loads_on_one_process(runs):
    """save_pretrained under tp writes the full weights (not a shard): one process loads them, and they are the
    DDP run's within 1e-5 (four AdamW steps of the same update)."""
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(runs["tp"]["job_dir"]).state_dict()
    want = AutoModelForCausalLM.from_pretrained(runs["ddp_job_dir"]).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- accum-kit verify on the mesh


@pytest.mark.parametrize("kind", ["tp", "cp"])
def test_verify_on_the_mesh_passes_and_reports_the_public_miscount(runs, kind):
    """accum-kit verify under cpu_tp.yaml / cpu_cp.yaml (llama_tiny, K=2 and a partial window): each example taken
    once (the tp / cp ranks of a data-parallel rank ran the same ones), the tokens row within tolerance, and the
    miscount of that mesh (over every process under tp, the local cp slice under cp) run for real as an
    informational row, more than 10x outside the tolerance; the sum row shows FSDP2 averaging over R x S x cp."""
    rep = runs[kind]["verify"]
    split = {"tp": (DP, DP), "cp": (DP * SPLIT, DP * SPLIT)}[kind]  # token ranks, processes a gradient is averaged over
    assert (rep["world_size"], rep["data_parallel_size"], (rep["token_ranks"], rep["gradient_mean_size"])) == \
        (4, DP, split)
    assert rep["mesh"] == {"dp_replicate_size": 1, "dp_shard_size": DP, "tp_size": SPLIT if kind == "tp" else 1,
                           "cp_size": SPLIT if kind == "cp" else 1, "world_size": 4}
    r = (VERIFY_K + 1) // 2
    assert [w["examples"] for w in rep["windows"]] == [VERIFY_K * 2 * DP, r * 2 * DP]  # B=2 per micro-batch
    assert sorted(i for w in rep["windows"] for i in w["indices"]) == list(range((VERIFY_K + r) * 2 * DP))
    for w in rep["windows"]:  # the oracle's count: each example's targets once (ids of length n: n - 1 targets)
        assert w["target_tokens"] == sum(len(ids) - 1 for ids in w["input_ids"])
    rows = rep["rows"]
    assert rep["passed"] and rep["exit_code"] == 0
    assert rows["tokens"]["passed"] and rows["tokens"]["tolerance_used"] <= 1.0
    wrong = rows[MISCOUNT_ROWS[kind]]
    assert MISCOUNT_ROWS[{"tp": "cp", "cp": "tp"}[kind]] not in rows
    assert wrong["informational"] and not wrong["passed"] and wrong["tolerance_used"] > 10
    assert {"tp": "count over the world x tp", "cp": "count of the local cp slice"}[kind] in wrong["summary"]["reproduces"]
    if kind == "tp":  # every token counted tp times: exactly 1/tp of the update
        assert wrong["summary"]["factor"] == pytest.approx(1 / SPLIT, rel=1e-5)
    else:  # a slice's tokens only: too few counted, a larger update
        assert wrong["summary"]["factor"] > 1.2
    assert rep["ddp_sum_ratio"] == pytest.approx(1 / split[1], rel=1e-5)
    assert rows["trainer"]["skipped"]


def test_verify_takes_each_data_parallel_ranks_examples_once():
    """What 4 processes of a 2 x 2 mesh ran: one entry per data-parallel rank; peers that disagree are refused."""
    from accum_kit.verify.mesh import one_per_data_parallel_rank

    assert one_per_data_parallel_rank(["a", "a", "b", "b"], 2) == ["a", "b"]
    assert one_per_data_parallel_rank(["a", "b"], 2) == ["a", "b"]
    with pytest.raises(RuntimeError, match="process 3"):
        one_per_data_parallel_rank(["a", "a", "b", "c"], 2)


# --------------------------------------------------------------------------- bad input (in-process)


def test_the_sequence_split_counts_each_target_once():
    """split_sequences against the unsplit shift: the slices' targets, concatenated, are the shifted labels
    (padded to a multiple of cp), positions are global, and a left-padded batch is refused."""
    from accum_kit import UsageError
    from accum_kit.engines.sequence_split import split_sequences

    collate = jh.pad_collate(0)
    batch = collate(ex.EXAMPLES[:3])  # widths 3-24: an odd width is padded
    for size in (2, 3):
        parts = [split_sequences(batch, r, size) for r in range(size)]
        shifted = torch.cat([p["shift_labels"] for p in parts], dim=1)
        width = batch["labels"].shape[1]
        assert shifted.shape[1] == math.ceil(width / size) * size
        assert torch.equal(shifted[:, : width - 1], batch["labels"][:, 1:])
        assert (shifted[:, width - 1:] == -100).all()
        assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1)[0], torch.arange(shifted.shape[1]))
    left = {**batch, "attention_mask": batch["attention_mask"].flip(1)}
    with pytest.raises(UsageError) as err:
        split_sequences(left, 0, 2)
    assert err.value.flag == "--parallelism_config_cp_size" and "right" in err.value.fix


@pytest.mark.parametrize("env,flag,fix", [
    ({"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2", "ACCELERATE_USE_FSDP": "false",
      "ACCELERATE_USE_DEEPSPEED": "true"}, "--parallelism_config_tp_size", "cpu_tp.yaml"),
    ({"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_CP_SIZE": "2", "ACCELERATE_USE_FSDP": "false"},
     "--parallelism_config_cp_size", "cpu_cp.yaml"),
    ({"PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "PARALLELISM_CONFIG_TP_SIZE": "4"}, "--parallelism_config_dp_shard_size",
     "cpu_tp.yaml"),
    ({"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "4"},
     "--parallelism_config_dp_replicate_size / --parallelism_config_dp_shard_size / --parallelism_config_tp_size / "
     "--parallelism_config_cp_size", "--num_processes (4)"),
])
def test_a_mesh_that_cannot_work_is_refused_before_anything_is_built(monkeypatch, env, flag, fix):
    import torch.distributed as dist

    from accum_kit import UsageError, build_accelerator

    for var in ("RANK", "LOCAL_RANK", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        monkeypatch.delenv(var, raising=False)
    base = {"WORLD_SIZE": "4", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
            "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1"}
    for k, v in {**base, **env}.items():
        monkeypatch.setenv(k, v)
    jh.reset_accelerate_state()
    try:
        with pytest.raises(UsageError) as err:
            build_accelerator(2, cpu=True)
    finally:
        jh.reset_accelerate_state()
    assert err.value.flag == flag and fix in err.value.fix, str(err.value)
    assert not dist.is_initialized()


def test_heads_that_tp_does_not_divide_are_refused():
    from accum_kit import UsageError
    from accum_kit.engines.sequence_split import check_heads
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{**MODEL, "num_attention_heads": 2, "num_key_value_heads": 1}))
    check_heads(model, 1, "--parallelism_config_tp_size")
    with pytest.raises(UsageError) as err:
        check_heads(model, 2, "--parallelism_config_tp_size")
    assert err.value.flag == "--parallelism_config_tp_size" and "num_key_value_heads" in err.value.problem
