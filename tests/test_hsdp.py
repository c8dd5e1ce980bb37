"""Exact accumulation under HSDP (2 replicas x 2 shards, 4 gloo processes), for every accumulation policy.

One ``accelerate launch --config_file accelerate_configs/cpu_hsdp.yaml`` of
tests/dist_worker.py runs every scenario. The worker counts, per micro-batch,
what FSDP2 sends and on which process group, by wrapping
``torch.distributed.reduce_scatter_single`` / ``all_gather_single`` /
``all_reduce`` (not accum_kit code). Everything expected comes from the plain
single-process oracle of tests/test_exactness.py (one big batch per window,
SGD) on the same variable-length examples with masked prompts: one example
per micro-batch and process, 5 micro-batches per process, so K=3 gives a
window of 3 and a partial one of 2.

The refusals (sizes that do not fit, DDP spelled as HSDP, tensor parallel,
the HSDP-only policy elsewhere) are checked in-process.
"""

from __future__ import annotations


import json

import pytest

import job_helpers as jh
import test_exactness as ex
import test_moe as moe
from conftest import example_specs

HSDP_CONFIG = jh.REPO / "accelerate_configs" / "cpu_hsdp.yaml"
TIMEOUT_S = 420
R, S = 2, 2  # replicas x shards
W = R * S
B = 1
POLICIES = ("no_sync", "sync_each_batch", "no_sync_no_reshard_after_backward", "no_sync_no_reshard",
            "reduce_scatter_each_batch")
NEW = "reduce_scatter_each_batch"
CUSTOM_LOOP_STEPS = 4  # examples/custom_loop.py's optimizer steps here (4 processes on 2 cores: kept short)


def _sc(name, K=3, policy="no_sync", **kw):
    return {**ex._sc(name, K, **kw), "B": B, "policy": policy}


SCENARIOS = [
    *[_sc(f"tok_k3_{p}", policy=p) for p in POLICIES],
    _sc("tok_k3_clip", policy=NEW, max_grad_norm=ex.MAX_GRAD_NORM),
    _sc("tok_sched_2ep", K=1, epochs=2, schedule=ex.SCHEDULE, policy=NEW),
    # the uninterrupted run saves a sharded checkpoint after every step; fresh runs resume from two of them
    {**_sc("resume_2ep", epochs=2, policy=NEW), "resume_from": [1, 3]},
]
# activation checkpointing (Accelerate's wrapper around each block unit): every policy's twin of tok_k3_<policy>
SCENARIOS += [{**_sc(f"tok_k3_{p}_gc", policy=p), "gradient_checkpointing": True} for p in POLICIES]
# LoRA adapters (peft) on a frozen model (tests/lora_oracle.py): HSDP's own policy, and no_sync
LORA_SCENARIOS = [{**_sc(f"lora_k3_{p}", policy=p), "lora": jh.LORA, "momentum": jh.LORA_MOMENTUM}
                  for p in ("no_sync", NEW)]
SCENARIOS += LORA_SCENARIOS
BY_NAME = {sc["name"]: sc for sc in SCENARIOS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{name: {"scenario", "init", "steps", "ranks", "resumed": {step: {"steps", "ranks"}}}}``."""
    root = tmp_path_factory.mktemp("hsdp")
    corpus = jh.write_corpus(root / "corpus.txt")
    custom = next(e for e in example_specs(corpus) if e["name"] == "custom_loop")
    custom = {**custom, "argv": [*custom["argv"], "--max_train_steps", str(CUSTOM_LOOP_STEPS)]}
    # the user's script, unchanged: under this HSDP launch, and as under a 4-process DDP launch (what
    # accelerate launch --config_file cpu_ddp.yaml --num_processes 4 would leave unset)
    customs = [{**custom, "name": "custom_loop_hsdp"},
               {**custom, "name": "custom_loop_ddp", "env": {"ACCELERATE_USE_FSDP": None,
                                                             "ACCELERATE_USE_PARALLELISM_CONFIG": None}},
               moe.example_script(moe.HSDP_CELLS, root / "moe")]  # tests/test_moe.py's matrix, HSDP's cells
    spec = {"model_config": ex.MODEL_CONFIG, "seed": ex.SEED, "lr": ex.LR, "pad_id": ex.PAD_ID,
            "examples": ex.EXAMPLES, "scenarios": SCENARIOS, "example_scripts": customs}
    out = jh.run_dist_worker(HSDP_CONFIG, spec, root, "hsdp", W, TIMEOUT_S)
    out["custom_loop"] = {name: [json.loads((root / "out" / f"custom_loop_{name}.rank{r}.json").read_text())
                                 for r in range(W)] for name in ("hsdp", "ddp")}
    out["checkpoints"] = root / "out" / "resume_2ep" / "ckpts"  # saved by the uninterrupted run, every step
    out["moe"] = moe.load(root / "moe", moe.HSDP_CELLS)
    return out


def _layout():
    from accum_kit.engines.costs import gpt2_units_for

    c = ex.MODEL_CONFIG
    return gpt2_units_for(c["n_layer"], c["n_embd"], c["vocab_size"], c["n_positions"])


# --------------------------------------------------------------------------- the mesh and the policy


@pytest.mark.parametrize("name", list(BY_NAME))
def test_model_is_sharded_on_the_two_dimensional_mesh(runs, name):
    for info in runs[name]["ranks"]:
        assert info["num_processes"] == W and info["is_fsdp2"], info["distributed_type"]
        assert info["accumulation_policy"] == BY_NAME[name]["policy"]
        groups = info["collective_groups"]  # rank r is shard r % S of replica r // S
        r = info["rank"]
        shard_group = [r // S * S + i for i in range(S)]
        replicate_group = [r % S + j * S for j in range(R)]
        assert groups["reduce_scatter"] == groups["all_gather"] == shard_group, (r, groups)
        assert groups["all_reduce"] == replicate_group, (r, groups)


@pytest.mark.parametrize("policy", POLICIES)
def test_collectives_per_group_follow_the_policy(runs, policy):
    """Per micro-batch, counted by the independent wrap: the reduce-scatter (shard group) runs on every
    micro-batch under sync_each_batch and reduce_scatter_each_batch, on the boundary only under the no_sync
    policies; the all-reduce across replicas only on the boundary, except under sync_each_batch."""
    run = runs[f"tok_k3_{policy}"]
    for info in run["ranks"]:
        micro = info["micro"]
        assert info["loss"]["implementation"] == "chunked", info["loss"]  # computed in the gathered output layer
        rs_every = policy in ("sync_each_batch", NEW)
        ar_every = policy == "sync_each_batch"
        assert [m["reduce_scatter_calls"] > 0 for m in micro] == [rs_every or m["boundary"] for m in micro]
        assert [m["replicate_all_reduce_calls"] > 0 for m in micro] == [ar_every or m["boundary"] for m in micro]
        assert [m["sync"] for m in micro] == [rs_every or m["boundary"] for m in micro], "LoopState.sync"
        synced = [m for m in micro if m["reduce_scatter_calls"]]
        assert len({m["reduce_scatter_calls"] for m in synced}) == 1, "unequal reduce-scatters per sync"
    windows = jh.windows_of(run["ranks"][0]["micro"])
    counts = [(sum(m["reduce_scatter_calls"] for m in w), sum(m["replicate_all_reduce_calls"] for m in w))
              for w in windows]
    print(f"\n{policy}: (reduce-scatters, all-reduces across replicas) per window {counts} for windows of "
          f"{[len(w) for w in windows]}")


@pytest.mark.parametrize("policy", POLICIES)
def test_cost_formulas_give_the_collectives_counted_per_group(runs, policy):
    """policy_costs with the mesh (torch-free) per window, full and partial, against the independent count:
    reduce-scatters and all-gathers in the shard group, all-reduces in the replicate group (calls and bytes)."""
    from accum_kit.engines.costs import policy_costs

    for w in jh.windows_of(runs[f"tok_k3_{policy}"]["ranks"][0]["micro"]):
        c = policy_costs(policy, _layout(), world_size=W, accumulation_steps=len(w), replicate_size=R)
        counted = {k: sum(m[k] for m in w) for k in ("reduce_scatter_calls", "reduce_scatter_bytes", "all_gather_calls",
                                                     "all_gather_bytes", "replicate_all_reduce_calls",
                                                     "replicate_all_reduce_bytes")}
        assert counted == {"reduce_scatter_calls": c.reduce_scatter_calls, "reduce_scatter_bytes": c.reduce_scatter_bytes,
                           "all_gather_calls": c.all_gather_calls, "all_gather_bytes": c.all_gather_bytes,
                           "replicate_all_reduce_calls": c.all_reduce_calls,
                           "replicate_all_reduce_bytes": c.all_reduce_bytes}, (policy, len(w))


@pytest.mark.parametrize("policy", POLICIES)
def test_gradient_memory_held_is_what_the_policy_predicts(runs, policy):
    """Between micro-batches: the full fp32 gradient under the no_sync policies, 1/S of it under
    sync_each_batch and reduce_scatter_each_batch (its reduce-scattered shards summed until the boundary);
    prediction within 10 %."""
    full = 4 * _layout().parameters
    for info in runs[f"tok_k3_{policy}"]["ranks"]:
        held, predicted = info["memory"]["gradient_bytes"], info["predicted_memory"][policy]["gradient_bytes"]
        if policy in ("sync_each_batch", NEW):
            assert full / S <= held <= 1.05 * full / S, info["memory"]
        else:
            assert held == full, info["memory"]
        assert abs(held / predicted - 1) <= 0.10, (held, predicted)
    kinds = set(runs[f"tok_k3_{NEW}"]["ranks"][0]["memory"]["by_kind"])
    assert kinds == {"partial_reduce_output"}, kinds


@pytest.mark.parametrize("policy", POLICIES)
def test_profiler_attributes_every_collective_to_its_mesh_dimension(runs, policy):
    """accum_kit's recorders against the independent wrap: per micro-batch, the same calls and bytes per
    kind, reduce-scatters and all-gathers on the shard group, all-reduces on the replicate group; the
    summary's per-group block adds them up per step."""
    for info in runs[f"tok_k3_{policy}"]["ranks"]:
        mine = info["profiler_calls"]
        assert {(c["kind"], c["group"]) for c in mine} == {("reduce_scatter", "shard"), ("all_gather", "shard"),
                                                           ("all_reduce", "replicate")}
        for m_index, m in enumerate(info["micro"]):
            for kind, key in (("reduce_scatter", "reduce_scatter"), ("all_gather", "all_gather"),
                              ("all_reduce", "replicate_all_reduce")):
                got = [c for c in mine if c["micro_batch"] == m_index and c["kind"] == kind]
                assert (len(got), sum(c["bytes"] for c in got)) == (m[f"{key}_calls"], m[f"{key}_bytes"]), \
                    (policy, info["rank"], m_index, kind)
        s = info["profiler_summary"]
        steps = info["optimizer_steps"]
        groups = s["by_group"]
        assert (groups["shard"]["size"], groups["replicate"]["size"]) == (S, R)
        for group, kind, key in (("shard", "reduce_scatter", "reduce_scatter"), ("shard", "all_gather", "all_gather"),
                                 ("replicate", "all_reduce", "replicate_all_reduce")):
            block = groups[group][kind]
            assert block["calls_per_step"] * steps == pytest.approx(sum(m[f"{key}_calls"] for m in info["micro"]))
            assert block["bytes_per_step"] * steps == pytest.approx(sum(m[f"{key}_bytes"] for m in info["micro"]))
            assert block["seconds_per_step"] > 0 and block["busbw_GBps"] > 0
        assert s["all_reduce_calls"] == sum(m["replicate_all_reduce_calls"] for m in info["micro"])
    g = runs[f"tok_k3_{policy}"]["ranks"][0]["profiler_summary"]["by_group"]
    print(f"\n{policy} rank 0 per step: shard reduce-scatter {g['shard']['reduce_scatter']['calls_per_step']:.1f} "
          f"calls, all-gather {g['shard']['all_gather']['calls_per_step']:.1f}; replicate all-reduce "
          f"{g['replicate']['all_reduce']['calls_per_step']:.1f} calls "
          f"({g['replicate']['all_reduce']['bytes_per_step']:.0f} B, {g['replicate']['all_reduce']['seconds_per_step'] * 1e3:.2f} ms)")


# --------------------------------------------------------------------------- the update equals one big batch


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_the_big_batch_each_step(runs, policy):
    run = runs[f"tok_k3_{policy}"]
    assert len(ex.windows_for(W, 3, B)[-1]) < 3 * W, "scenario lacks a partial window"
    ex._check_run_against_oracle(run, W)
    for wrong in ("mean_of_means", "accelerate_mean"):
        diff, excess = ex.max_excess(run["steps"][-1], ex._wrong_oracle(run, W, wrong))
        assert excess > 0, f"the {wrong} oracle is within {diff:.2e}: the comparison cannot fail"


def test_clipping_uses_the_global_norm_over_both_mesh_dimensions(runs):
    run = runs["tok_k3_clip"]
    losses = ex._check_run_against_oracle(run, W, max_grad_norm=ex.MAX_GRAD_NORM)
    assert max(l["grad_norm"] for l in losses) > ex.MAX_GRAD_NORM, "never clipped"
    assert ex.max_excess(run["steps"][-1], ex._wrong_oracle(run, W, "no_clip"))[1] > 0


def test_schedule_matches_the_big_batch_each_step(runs):
    run = runs["tok_sched_2ep"]
    ex._check_run_against_oracle(run, W)
    assert run["ranks"][0]["step_accumulation_steps"] == [k for _, _, k in ex.scheduled_run(W, run["scenario"])]


@pytest.mark.parametrize("step", BY_NAME["resume_2ep"]["resume_from"])
def test_resume_from_a_checkpoint_saved_under_hsdp_is_bitwise(runs, step):
    run = runs["resume_2ep"]
    ex.assert_resumed_equals_uninterrupted(run, step)
    ex._check_run_against_oracle(run, W)


def test_a_planted_pickle_in_each_kind_of_file_of_an_hsdp_checkpoint_is_refused(runs, tmp_path):
    """The HSDP checkpoint's files (both DCP ``.metadata``, a byte item and a tensor item of the ``.distcp``
    files, RNG and data-RNG files), each replaced in turn by a pickle that runs a command (tests/planted.py):
    the pre-check of a resume refuses each by name and nothing runs."""
    import planted

    table = planted.refused_each_kind(runs["checkpoints"] / "step_1", tmp_path)
    assert {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "pytorch_model_fsdp_0/*.distcp tensor item",
            "optimizer_0/*.distcp bytes item"} <= set(table), sorted(table)
    planted.assert_each_refused(table)


@pytest.mark.parametrize("policy", POLICIES)
def test_checkpointed_hsdp_run_is_the_big_batch_and_its_twin(runs, policy):
    """Accelerate's checkpoint wrapper on the 2 x 2 mesh, every policy: the update within 1e-6 of the big batch,
    the losses and every collective per micro-batch (all-gathers, reduce-scatters, all-reduces across replicas)
    those of the run without it."""
    run, twin = runs[f"tok_k3_{policy}_gc"], runs[f"tok_k3_{policy}"]
    worst, gap, seconds = ex.assert_checkpointed_like_its_twin(run, twin, W)
    keys = ("all_gather_calls", "all_gather_bytes", "reduce_scatter_calls", "replicate_all_reduce_calls")
    for info, plain in zip(run["ranks"], twin["ranks"]):
        assert [[m[k] for k in keys] for m in info["micro"]] == [[m[k] for k in keys] for m in plain["micro"]]
    print(f"\nHSDP {policy} with checkpointing: largest |param - oracle| {worst:.2e}, loss gap {gap:.1e}, {seconds}")


# --------------------------------------------------------------------------- refusals (in-process)


@pytest.fixture
def hsdp_env(monkeypatch):
    """What ``accelerate launch`` with cpu_hsdp.yaml exports for 4 processes, without a launch."""
    for var in ("RANK", "LOCAL_RANK", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        monkeypatch.delenv(var, raising=False)
    env = {"WORLD_SIZE": "4", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
           "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    jh.reset_accelerate_state()
    yield monkeypatch
    jh.reset_accelerate_state()


@pytest.mark.parametrize("env,kwargs,flag,fix", [
    ({"WORLD_SIZE": "2"}, {}, "--parallelism_config_dp_replicate_size / --parallelism_config_dp_shard_size",
     "--num_processes"),
    ({"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "4", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1"}, {},
     "--parallelism_config_dp_shard_size", "cpu_ddp.yaml"),
    ({"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1", "PARALLELISM_CONFIG_SP_SIZE": "2"}, {},
     "--parallelism_config_sp_size", "--parallelism_config_cp_size 2"),
    ({"PARALLELISM_CONFIG_TP_SIZE": "2"}, {}, "--parallelism_config_dp_replicate_size / "
     "--parallelism_config_dp_shard_size / --parallelism_config_tp_size / --parallelism_config_cp_size",
     "--num_processes (4)"),
    ({"ACCELERATE_USE_FSDP": "false"}, {}, "--parallelism_config_dp_replicate_size", "cpu_hsdp.yaml"),
    ({"FSDP_VERSION": "1"}, {}, "--fsdp_version", "fsdp_version: 2"),
    ({"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4"},
     {"accumulation_policy": NEW}, "--accumulation_policy", "cpu_hsdp.yaml"),
])
def test_what_cannot_work_is_refused_before_anything_is_built(hsdp_env, env, kwargs, flag, fix):
    """Each refusal names the flag and the fix, and comes before a process group or an Accelerator exists."""
    import torch.distributed as dist

    from accum_kit import UsageError, build_accelerator

    for k, v in env.items():
        hsdp_env.setenv(k, v)
    with pytest.raises(UsageError) as err:
        build_accelerator(2, cpu=True, **kwargs)
    assert err.value.flag == flag and fix in err.value.fix, str(err.value)
    assert not dist.is_initialized()


def test_the_hsdp_policy_is_refused_under_ddp(monkeypatch):
    from accum_kit import UsageError, build_accelerator

    for var in ("WORLD_SIZE", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    jh.reset_accelerate_state()
    with pytest.raises(UsageError) as err:
        build_accelerator(2, cpu=True, accumulation_policy=NEW)
    assert err.value.flag == "--accumulation_policy" and "cpu_fsdp.yaml" in err.value.fix


def test_the_bench_refuses_hsdp_only_flags_elsewhere(tmp_path, monkeypatch):
    from accum_kit import UsageError
    from accum_kit.bench.config import BenchConfig

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(UsageError) as err:
        BenchConfig(output_dir=str(tmp_path / "a"), emulate_inter_node_GBps=0.0)
    assert err.value.flag == "--emulate_inter_node_GBps"
    cfg = BenchConfig(output_dir=str(tmp_path / "b"), emulate_inter_node_GBps=0.1)
    with pytest.raises(UsageError) as err:
        cfg.check_hsdp_flags(hybrid=False)
    assert err.value.flag == "--emulate_inter_node_GBps" and "cpu_hsdp.yaml" in err.value.fix
    cfg.check_hsdp_flags(hybrid=True)  # accepted under HSDP


def test_a_users_loop_trains_under_hsdp_as_under_ddp(runs):
    """examples/custom_loop.py, unchanged, under cpu_hsdp.yaml (2 x 2): the losses of the same script under
    DDP with the same 4 processes, up to the order of the reductions; its scheduler run to the end as there."""
    for got, want in zip(runs["custom_loop"]["hsdp"], runs["custom_loop"]["ddp"]):
        assert got["world_size"] == want["world_size"] == W
        assert "FSDP" in got["distributed_type"] and want["distributed_type"] == "DistributedType.MULTI_CPU"
        gap = max(abs(a - b) / abs(b) for a, b in zip(got["train_loss"], want["train_loss"]))
        print(f"\ncustom_loop under HSDP 2 x 2: largest relative loss difference from DDP {gap:.1e}")
        assert len(got["train_loss"]) == len(want["train_loss"]) == CUSTOM_LOOP_STEPS and gap <= 1e-5
        assert got["eval_loss_after"] == pytest.approx(want["eval_loss_after"], rel=1e-5)
        assert got["final_learning_rate"] == pytest.approx(want["final_learning_rate"], abs=1e-12)


@pytest.mark.parametrize("c", moe.HSDP_CELLS, ids=lambda c: c["name"])
def test_experts_getting_tokens_late_or_on_one_rank_train_exactly(runs, c):
    """tests/test_moe.py's mixture of experts under HSDP 2 x 2 (no_sync policies, fp32 and bf16): an expert with tokens
    only in a window's first / middle / last micro-batch, only on rank 0, or never: no crash, fp32 equals the big
    batch of the 4 ranks, the never-used expert does not move (no gradient at the step, as in the big batch), bf16
    follows fp32."""
    run = runs["moe"][c["name"]]
    assert len(run["steps"]) == moe.SPEC["windows"] + 1
    moe.check_cell(run, c, W)


# --------------------------------------------------------------------------- LoRA adapters on a frozen model


@pytest.mark.parametrize("name", [sc["name"] for sc in LORA_SCENARIOS])
def test_lora_run_is_the_float64_big_batch_of_the_same_peft_model(runs, name):
    """HSDP (2 x 2): each adapter parameter within the fp32 criterion of the float64 single-process PeftModel after
    every step, each frozen one bitwise unchanged, optimizer state for the adapters only (tests/lora_oracle.py)."""
    import lora_oracle

    worst = lora_oracle.assert_lora_run(runs[name], W, f"HSDP {name}")
    print(f"\nHSDP {name}: largest |adapter - float64 oracle| {worst:.2e}")
