"""Exact accumulation under FSDP2 (fully_shard) on 2 gloo processes, for every accumulation policy.

One run of tests/dist_worker.py under ``accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml``
(a script run of conftest.py's shared ``fsdp_pool``) runs every scenario; the worker counts, per micro-batch,
the reduce-scatters and all-gathers FSDP2 issues by wrapping
``torch.distributed.reduce_scatter_single`` / ``all_gather_single`` (not
accum_kit code), and saves the gathered parameters after each optimizer step.
Everything expected comes from the plain single-process oracle of
tests/test_exactness.py (one big batch per window, SGD), on the same
variable-length examples with masked prompts; each epoch (5 micro-batches per
process) ends with a partial window for K=3.

The refusals (FSDP1, policies that cannot work) are checked in-process.
"""

from __future__ import annotations

import csv
import json
import math
import statistics

import pytest
import torch

import job_helpers as jh
import test_exactness as ex
from conftest import example_specs, ok

FSDP_CONFIG = jh.REPO / "accelerate_configs" / "cpu_fsdp.yaml"
TIMEOUT_S = 300
W = 2
POLICIES = ("no_sync", "sync_each_batch", "no_sync_no_reshard_after_backward", "no_sync_no_reshard")


def _sc(name, K=3, policy="no_sync", **kw):
    return {**ex._sc(name, K, **kw), "policy": policy}


SCENARIOS = [
    *[_sc(f"tok_k3_{p}", policy=p) for p in POLICIES],  # windows of 3 and 2 micro-batches per process
    _sc("mean_k3", mode="mean"),
    _sc("tok_k3_clip", max_grad_norm=ex.MAX_GRAD_NORM),
    _sc("tok_sched_2ep", K=1, epochs=2, schedule=ex.SCHEDULE, policy="no_sync_no_reshard"),
    _sc("bf16_k3", mixed_precision="bf16"),
    # the uninterrupted run saves a sharded checkpoint after every step; fresh runs resume from two of them
    {**_sc("resume_2ep", epochs=2, policy="no_sync_no_reshard_after_backward"), "resume_from": [1, 3]},
]
# activation checkpointing (Accelerate's FSDP2 wrapper around each block unit): every policy's twin of tok_k3_<policy>
SCENARIOS += [{**_sc(f"tok_k3_{p}_gc", policy=p), "gradient_checkpointing": True} for p in POLICIES]
# LoRA adapters (peft) on a frozen model, every policy (tests/lora_oracle.py): each block's unit mixes frozen weights and
# adapters, the root and output-head units hold frozen weights only
LORA_SCENARIOS = [{**_sc(f"lora_k3_{p}", policy=p), "lora": jh.LORA, "momentum": jh.LORA_MOMENTUM} for p in POLICIES]
LORA_SCENARIOS.append({**_sc("lora_k3_no_sync_gc"), "lora": jh.LORA, "momentum": jh.LORA_MOMENTUM,
                       "gradient_checkpointing": True})
SCENARIOS += LORA_SCENARIOS
BY_NAME = {sc["name"]: sc for sc in SCENARIOS}
# `accum-kit bench` under FSDP2, last in the same launch: every policy (with the logits' loss) and no_sync with the
# default fused loss (the loss axis) at two K, two passes
BENCH_KS, BENCH_BLOCK, BENCH_VOCAB = (2, 3), 32, 384
BENCH_ARGV = ["--model_presets", "tiny", "--accumulation_steps", *map(str, BENCH_KS), "--repeats", "2", "--steps", "2",
              "--warmup_steps", "1", "--block_size", str(BENCH_BLOCK), "--accumulation_policies", *POLICIES,
              "no_sync_fused"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fsdp_pool):
    """``{name: {"scenario", "init", "steps", "ranks", "resumed": {step: {"steps", "ranks"}}}}``."""
    root = tmp_path_factory.mktemp("fsdp")
    corpus = jh.write_corpus(root / "corpus.txt")  # the examples fixture's corpus and flags (tests/conftest.py)
    custom = next(e for e in example_specs(corpus) if e["name"] == "custom_loop")
    customs = [{**custom, "name": f"custom_loop_{p}", "argv": [*custom["argv"], "--accumulation_policy", p]}
               for p in POLICIES]  # the user's script, unchanged, under every policy (a flag of the script)
    # and with the accelerate config's fsdp_activation_checkpointing: true (what accelerate launch exports)
    customs.append({**custom, "name": "custom_loop_config_gc", "env": {"FSDP_ACTIVATION_CHECKPOINTING": "true"}})
    # a plain nn.Module, checkpointed by Accelerate's wrapper only where its auto-wrap policy finds the blocks
    customs.append({"name": "plain_module", "path": str(jh.REPO / "tests" / "fsdp_plain_module.py"), "argv": []})
    spec = {"model_config": ex.MODEL_CONFIG, "seed": ex.SEED, "lr": ex.LR, "pad_id": ex.PAD_ID,
            "examples": ex.EXAMPLES, "scenarios": SCENARIOS, "example_scripts": customs, "bench_argv": BENCH_ARGV}
    out = jh.run_dist_worker(FSDP_CONFIG, spec, root, "fsdp", W, TIMEOUT_S, pool=fsdp_pool)  # conftest.py's shared launch
    out["bench"] = root / "out" / "bench"
    out["custom_loop"] = {p: [json.loads((root / "out" / f"custom_loop_{p}.rank{r}.json").read_text()) for r in range(W)]
                          for p in (*POLICIES, "config_gc")}
    out["plain_module"] = [json.loads((root / "out" / f"plain_module.rank{r}.json").read_text()) for r in range(W)]
    return out


def _largest_deviation(run, rule="tokens", **kw) -> float:
    sc = run["scenario"]
    params, _ = ex.oracle_run(run["init"], ex.run_windows(W, sc), rule, sc["K"], W, **kw)
    return max(ex.max_excess(got, want)[0] for got, want in zip(run["steps"], params))


@pytest.mark.parametrize("name", list(BY_NAME))
def test_model_is_sharded_with_fsdp2_and_the_policy_applied(runs, name):
    for info in runs[name]["ranks"]:
        assert info["num_processes"] == W and info["is_fsdp2"], info["distributed_type"]
        assert "FSDP" in info["distributed_type"] and info["model_class"].startswith("FSDP"), info
        assert not info["comm_hook_registered"], "a DDP wrapper was prepared"
        assert info["accumulation_policy"] == BY_NAME[name]["policy"]


# --------------------------------------------------------------------------- collectives per micro-batch


@pytest.mark.parametrize("policy", POLICIES)
def test_reduce_scatters_only_where_the_policy_says(runs, policy):
    """no_sync policies reduce-scatter on the boundary micro-batch only, sync_each_batch on every one;
    every synchronised backward sends the same number (one per FSDP parameter group)."""
    run = runs[f"tok_k3_{policy}"]
    per_rank = []
    for info in run["ranks"]:
        micro = info["micro"]
        calls = [m["reduce_scatter_calls"] for m in micro]
        expect_sync = [True] * len(micro) if policy == "sync_each_batch" else [m["boundary"] for m in micro]
        assert [c > 0 for c in calls] == expect_sync, f"{policy} rank {info['rank']}: reduce-scatters {calls}"
        assert len({c for c in calls if c}) == 1, f"{policy}: unequal reduce-scatters per sync {calls}"
        assert [m["sync"] for m in micro] == expect_sync, "LoopState.sync disagrees with the reduce-scatters"
        assert info["stray_allreduce_calls"] == 0, "reduce-scatters outside any micro-batch"
        assert all(m["allreduce_calls"] == 0 for m in micro)
        assert info["loss"]["implementation"] == "chunked", info["loss"]  # computed in the gathered output layer
        per_rank.append(calls)
    assert per_rank[0] == per_rank[1]
    windows = jh.windows_of(run["ranks"][0]["micro"])
    print(f"\n{policy}: reduce-scatters per window {[sum(m['reduce_scatter_calls'] for m in w) for w in windows]} "
          f"for windows of {[len(w) for w in windows]} micro-batches")


def test_all_gathers_follow_the_policy(runs):
    """Inside a window (after its first micro-batch): no_sync and sync_each_batch gather every unit for
    forward and backward; keeping parameters after backward leaves only the layers' backward gathers
    (n_layer, the units resharded after forward); keeping them all window, none."""
    n_layer = ex.MODEL_CONFIG["n_layer"]
    first, later = {}, {}
    for policy in POLICIES:
        info = runs[f"tok_k3_{policy}"]["ranks"][0]
        windows = jh.windows_of(info["micro"])
        firsts = {w[0]["all_gather_calls"] for w in windows}
        rest = {m["all_gather_calls"] for w in windows for m in w[1:]}
        assert len(firsts) == 1 and len(rest) == 1, f"{policy}: all-gathers vary between windows {info['micro']}"
        first[policy], later[policy] = firsts.pop(), rest.pop()
    every = later["no_sync"]  # all units for the forward, the layers again for the backward
    assert every > 2 * n_layer and later["sync_each_batch"] == every
    assert first["no_sync"] == first["sync_each_batch"] == first["no_sync_no_reshard_after_backward"] == every
    assert later["no_sync_no_reshard_after_backward"] == n_layer
    assert first["no_sync_no_reshard"] == every - n_layer and later["no_sync_no_reshard"] == 0
    print(f"\nall-gathers on a window's first micro-batch {first}, on the later ones {later}")


SAVING = ("accelerate/utils/fsdp_utils.py:save_fsdp_",)  # Accelerate's sharded checkpoint save


@pytest.mark.parametrize("name", list(BY_NAME))
def test_no_host_read_in_a_window(runs, name):
    """Under FSDP2, every policy: accum_kit and Accelerate read no tensor's value on the host in a micro-batch
    that does not end a window (tests/host_reads.py wraps every tensor read; the profiler and HeldMemory run
    here too), and none at its end except where a checkpoint is saved (resume_2ep saves after every step: the
    main process reads the steps' losses and tokens for the history then, one copy; the sharded save reads for
    itself, on every process)."""
    from host_reads import loop_reads, owner_of

    run = runs[name]
    for info in [*run["ranks"], *(i for r in run["resumed"].values() for i in r["ranks"])]:
        inside, windows = loop_reads(info["host_reads"])
        saves = bool(BY_NAME[name].get("resume_from")) and info["resumed_from_step"] is None
        label = f"{name} rank {info['rank']} (resumed from {info['resumed_from_step']})"
        assert not any(inside), f"{label}: {inside}"
        # a save's own reads (Accelerate's sharded save: DCP gathers the plan, copies shards to the host) apart
        loop = [{s: n for s, n in w.items() if not owner_of(s).startswith(SAVING)} for w in windows]
        figures = 1 if saves and info["rank"] == 0 else 0
        assert [sum(w.values()) for w in loop] == [figures] * len(windows), f"{label}: {loop}"
        assert all(any(owner_of(s).startswith(SAVING) for s in w) == saves for w in windows), label


# --------------------------------------------------------------------------- profiler, memory, cost formulas


def _model_parameters() -> int:
    """P of the test model, deduplicated (the tied embedding once), from a plain in-process GPT-2."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(**ex.MODEL_CONFIG)).parameters())


def _layout():
    """The test model's FSDP2 units counted from its config alone (torch-free formulas)."""
    from accum_kit.engines.costs import gpt2_units_for

    c = ex.MODEL_CONFIG
    return gpt2_units_for(c["n_layer"], c["n_embd"], c["vocab_size"], c["n_positions"])


@pytest.mark.parametrize("policy", POLICIES)
def test_profiler_sees_every_collective_the_independent_count_sees(runs, policy):
    """accum_kit's recorders (FSDP2's set_custom_all_gather / set_custom_reduce_scatter) against the test's own
    wrap of torch.distributed's functions: the same calls and bytes in every micro-batch, and summary totals."""
    for info in runs[f"tok_k3_{policy}"]["ranks"]:
        for m_index, m in enumerate(info["micro"]):
            for kind in ("reduce_scatter", "all_gather"):
                mine = [c for c in info["profiler_calls"] if c["micro_batch"] == m_index and c["kind"] == kind]
                assert (len(mine), sum(c["bytes"] for c in mine)) == (m[f"{kind}_calls"], m[f"{kind}_bytes"]), \
                    f"{policy} rank {info['rank']} micro-batch {m_index} {kind}"
        s = info["profiler_summary"]
        for kind in ("reduce_scatter", "all_gather"):
            assert s[f"{kind}_calls"] == sum(m[f"{kind}_calls"] for m in info["micro"]) > 0
            assert s[f"{kind}_bytes"] == sum(m[f"{kind}_bytes"] for m in info["micro"])
            assert s[f"{kind}_busbw_GBps"] > 0
        assert s["syncs"] == sum(m["sync"] for m in info["micro"]) and "allreduce_calls" not in s
        assert s["ideal_seconds_per_step"] > 0 and s["compute_seconds"] > 0
        # from the bounded running aggregates; on this short run equal to the summary from every record
        jh.assert_same_summary(s, info["profiler_summary_from_records"])
    s = runs[f"tok_k3_{policy}"]["ranks"][0]["profiler_summary"]
    print(f"\n{policy}: reduce-scatters {s['reduce_scatter_calls']} ({s['reduce_scatter_bytes']} B), all-gathers "
          f"{s['all_gather_calls']} ({s['all_gather_bytes']} B) on rank 0, equal to the independent count")


@pytest.mark.parametrize("policy", POLICIES)
def test_post_backward_timed_once_per_unit_and_marked_where_it_reduced(runs, policy):
    """The estimate's timing (each unit's post-backward hook): one record per unit per micro-batch, units counted
    from the config; marked ``reduced`` in exactly the micro-batches where the independent count saw
    reduce-scatters, one per unit then; under no_sync the deferred micro-batches carry unreduced records only."""
    units = len(_layout().resharded) + len(_layout().kept)
    for info in runs[f"tok_k3_{policy}"]["ranks"]:
        for m_index, m in enumerate(info["micro"]):
            mine = [r for r in info["profiler_post_backwards"] if r["micro_batch"] == m_index]
            assert sorted(r["unit"] for r in mine) == list(range(units)), f"{policy} micro-batch {m_index}"
            reduced = sum(r["reduced"] for r in mine)
            assert reduced == m["reduce_scatter_calls"] == (units if m["boundary"] or policy == "sync_each_batch"
                                                            else 0), f"{policy} micro-batch {m_index}: {mine}"
        s = info["profiler_summary"]
        assert s["post_backward_sync_seconds"] > 0
        if policy == "sync_each_batch":  # every micro-batch reduces: windows of 3 and 2 have adding ones
            assert s["post_backward_adding_seconds"] is not None and s["shard_add_source"] == "measured"
        else:
            assert s["post_backward_adding_seconds"] is None and s["post_backward_no_sync_seconds"] is not None
            assert s["shard_add_source"] == "assumed: accumulation / S"


@pytest.mark.parametrize("policy", POLICIES)
def test_autograd_accumulation_timed_once_per_parameter_per_micro_batch(runs, policy):
    """G's timing: the hooks around autograd's accumulation fire once per parameter (counted from the model)
    per recorded micro-batch, every micro-batch record carries a part of its backward, and the summary's G
    comes from them rather than from differences of whole backwards."""
    for info in runs[f"tok_k3_{policy}"]["ranks"]:
        mbs = info["profiler_micro_batches"]
        assert info["profiler_accumulations"] == info["parameters_with_grad"] * len(mbs) > 0
        assert all(0 <= m["accumulate_seconds"] <= m["backward_seconds"] for m in mbs), mbs
        s = info["profiler_summary"]
        want = "timed around autograd's accumulation" if policy != "sync_each_batch" else "none"
        assert s["accumulation_source"] == want, s["accumulation_source"]


def test_units_counted_from_the_config_are_fsdp2s_units(runs):
    measured = runs["tok_k3_no_sync"]["ranks"][0]["profiler_summary"]["fsdp_units"]
    layout = _layout()
    assert sorted(u["parameters"] for u in measured if u["reshard_after_forward"]) == sorted(layout.resharded)
    assert sorted(u["parameters"] for u in measured if not u["reshard_after_forward"]) == sorted(layout.kept)
    assert layout.parameters == _model_parameters()  # the tied weight counted once, as FSDP2 holds it


@pytest.mark.parametrize("policy", POLICIES)
def test_cost_formulas_give_the_collectives_counted_in_every_window(runs, policy):
    """policy_costs (torch-free) per window, full (K=3) and partial (2 micro-batches), against the independent
    count of calls and bytes (nccl-tests' S: the gathered output, the reduce-scattered input)."""
    from accum_kit.engines.costs import policy_costs

    for w in jh.windows_of(runs[f"tok_k3_{policy}"]["ranks"][0]["micro"]):
        c = policy_costs(policy, _layout(), world_size=W, accumulation_steps=len(w))
        counted = {k: sum(m[k] for m in w) for k in ("reduce_scatter_calls", "reduce_scatter_bytes",
                                                     "all_gather_calls", "all_gather_bytes")}
        assert counted == {"reduce_scatter_calls": c.reduce_scatter_calls, "reduce_scatter_bytes": c.reduce_scatter_bytes,
                           "all_gather_calls": c.all_gather_calls, "all_gather_bytes": c.all_gather_bytes}, len(w)


@pytest.mark.parametrize("name", [*(f"tok_k3_{p}" for p in POLICIES), "bf16_k3"])
def test_memory_held_between_micro_batches_is_what_the_policy_predicts(runs, name):
    """Gradient bytes held between two micro-batches: the full fp32 gradient under the no_sync policies (bf16
    compute included: FSDP2's fp32 unsharded_accumulated_grad), 1/W of it when syncing each micro-batch; the
    keep-gathered policies add the gathered parameters. Prediction within 10% (the target)."""
    policy = BY_NAME[name]["policy"]
    full = 4 * _model_parameters()
    for info in runs[name]["ranks"]:
        mem, predicted = info["memory"], info["predicted_memory"][policy]
        held = mem["gradient_bytes"]
        if policy == "sync_each_batch":
            assert full / W <= held <= 1.05 * full / W and set(mem["by_kind"]) == {"sharded_grad"}, mem
        else:
            kind = "accumulated_grad" if name == "bf16_k3" else "unsharded_grad"
            assert held == full and set(mem["by_kind"]) - {"gathered_parameter"} == {kind}, mem
        gathered = mem["gathered_parameter_bytes"]
        assert gathered == (full if policy.startswith("no_sync_no_reshard") else 0), mem
        assert abs(held / predicted["gradient_bytes"] - 1) <= 0.10
        assert gathered == pytest.approx(predicted["gathered_parameter_bytes"], rel=0.10, abs=0)
    print(f"\n{name}: gradient bytes held {held} (predicted {predicted['gradient_bytes']:.0f}), gathered {gathered} "
          f"(predicted {predicted['gathered_parameter_bytes']:.0f}); full fp32 gradient {full}")


@pytest.fixture(scope="module")
def bench(runs):
    d = runs["bench"]
    return json.loads((d / "bench.json").read_text()), list(csv.DictReader((d / "bench.csv").open())), d


def test_fsdp_bench_sweeps_every_policy_and_writes_its_files(bench):
    result, rows, d = bench
    assert result["schema"] == "accum_kit.bench.fsdp/1" and result["machine"]["world_size"] == W
    assert [(int(r["K"]), r["policy"]) for r in rows] == [(k, p) for k in BENCH_KS for p in POLICIES]
    for col in ("reduce_scatter_calls_per_step", "all_gather_calls_per_step", "gradient_mb_peak",
                "speedup_vs_sync_each_batch", "speedup_ci_low", "speedup_ci_high", "memory_added_mb"):
        assert all(r[col] != "" for r in rows), col
    assert (d / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for K in BENCH_KS:  # the repeats rotate the policies in other orders over the same windows: same training
        runs = {r["repeat"]: r for r in result["runs"] if r["K"] == K}
        assert len(runs) == 2 and runs[1]["losses"] == pytest.approx(runs[0]["losses"], rel=1e-5)
        assert {r["policy"] for r in result["runs"] if r["K"] == K} == {*POLICIES, "no_sync_fused"}
    # the speedups and their intervals, recomputed from the per-window step times: one ratio per cycle
    # (sync_each_batch's window over this policy's in the same cycle), t-interval on their logarithms
    t_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365}  # Student's t, by df
    for r in result["rows"]:
        def windows(policy):
            return {(x["repeat"], c): t for x in result["runs"] if x["K"] == r["K"] and x["policy"] == policy
                    for c, t in zip(x["cycles"], x["step_seconds"])}
        base, mine = windows("sync_each_batch"), windows(r["policy"])
        logs = [math.log(base[c] / mine[c]) for c in mine]
        assert len(logs) == 2 * 2  # --repeats 2 x --steps 2 cycles
        m, half = statistics.fmean(logs), t_975[len(logs) - 1] * statistics.stdev(logs) / math.sqrt(len(logs))
        assert r["speedup_vs_sync_each_batch"] == pytest.approx(math.exp(m), rel=1e-9)
        if half > 0:
            assert (r["speedup_ci_low"], r["speedup_ci_high"]) == pytest.approx((math.exp(m - half), math.exp(m + half)),
                                                                              rel=1e-3)
    # the loss axis: no_sync_fused's windows against no_sync's of the same cycle (the first losses are not compared:
    # the two arms' windows hold different data)
    axis = result["fused_loss"]
    assert [(r["K"], r["arm"], r["against"], r["n_pairs"]) for r in axis] == [(K, "no_sync_fused", "no_sync", 4)
                                                                              for K in BENCH_KS]
    for r in axis:
        windows = {p: {(x["repeat"], c): t for x in result["runs"] if x["K"] == r["K"] and x["policy"] == p
                       for c, t in zip(x["cycles"], x["step_seconds"])} for p in ("no_sync_fused", "no_sync")}
        ratios = [windows["no_sync_fused"][c] / windows["no_sync"][c] for c in sorted(windows["no_sync"])]
        assert r["fused_over_logits"] == pytest.approx(statistics.median(ratios)) and r["first_loss_rel_diff"] is None


def test_fsdp_bench_counts_and_memory_follow_the_formulas(bench):
    """Collectives per step and gradient bytes held in the bench's table equal the cost formulas for the tiny
    preset's units (counted from its config, not from the run)."""
    from accum_kit.engines.costs import gpt2_units, policy_costs

    result, _, _ = bench
    layout = gpt2_units("tiny", BENCH_VOCAB, BENCH_BLOCK)
    units = result["presets"]["tiny"]["units"]
    assert (sorted(units["resharded"]), sorted(units["kept"])) == (sorted(layout.resharded), sorted(layout.kept))
    for r in result["rows"]:
        c = policy_costs(r["policy"], layout, world_size=W, accumulation_steps=r["K"])
        assert (r["reduce_scatter_calls_per_step"], r["all_gather_calls_per_step"]) == \
            (c.reduce_scatter_calls, c.all_gather_calls), (r["K"], r["policy"])
        assert r["all_gather_mb_per_step"] * 2**20 == pytest.approx(c.all_gather_bytes)
        assert r["gradient_mb_peak"] * 2**20 == c.gradient_bytes and r["gradient_measured_over_predicted"] == 1.0
        assert r["gathered_parameter_mb_peak"] * 2**20 == c.gathered_parameter_bytes
    base = {r["K"]: r for r in result["rows"] if r["policy"] == "sync_each_batch"}
    for r in result["rows"]:
        added = r["gradient_mb_peak"] + r["gathered_parameter_mb_peak"] - base[r["K"]]["gradient_mb_peak"]
        assert r["memory_added_mb"] == pytest.approx(added)


# --------------------------------------------------------------------------- the update equals one big batch


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_the_big_batch_each_step(runs, policy):
    run = runs[f"tok_k3_{policy}"]
    assert len(ex.windows_for(W, 3)[-1]) < 3 * W, "scenario lacks a partial window"
    ex._check_run_against_oracle(run, W)
    print(f"\n{policy}: largest |param - oracle| {_largest_deviation(run):.2e}")


def test_mean_mode_matches_accelerates_arithmetic_and_the_token_oracle_rejects_it(runs):
    run = runs["mean_k3"]
    ex._check_run_against_oracle(run, W)
    diff, excess = ex.max_excess(run["steps"][-1], ex._wrong_oracle(run, W, "tokens"))
    assert excess > 0 and diff > ex.SENSITIVITY_FACTOR * ex.ATOL, f"per-micro-batch means within {diff:.2e}"
    print(f"\nmean_k3: per-micro-batch means miss the big batch by {diff:.2e}")


@pytest.mark.parametrize("wrong", ["mean_of_means", "accelerate_mean"])
def test_the_comparison_can_fail(runs, wrong):
    run = runs["tok_k3_no_sync"]
    diff, excess = ex.max_excess(run["steps"][-1], ex._wrong_oracle(run, W, wrong))
    assert excess > 0 and diff > ex.SENSITIVITY_FACTOR * ex.ATOL, f"{wrong} oracle within {diff:.2e}"


def test_clipping_uses_the_global_norm_over_shards(runs):
    run = runs["tok_k3_clip"]
    losses = ex._check_run_against_oracle(run, W, max_grad_norm=ex.MAX_GRAD_NORM)
    assert max(l["grad_norm"] for l in losses) > ex.MAX_GRAD_NORM, "never clipped"
    for wrong in ("no_clip", "clip_before_rescale"):
        diff, excess = ex.max_excess(run["steps"][-1], ex._wrong_oracle(run, W, wrong))
        assert excess > 0, f"{wrong}: within {diff:.2e}"
    print(f"\nclip: largest |param - oracle| {_largest_deviation(run, max_grad_norm=ex.MAX_GRAD_NORM):.2e}")


def test_schedule_matches_the_big_batch_each_step(runs):
    run = runs["tok_sched_2ep"]
    ex._check_run_against_oracle(run, W)
    assert run["ranks"][0]["step_accumulation_steps"] == [k for _, _, k in ex.scheduled_run(W, run["scenario"])]
    for wrong in ("counter_not_reset", "first_k_only"):
        assert ex.max_excess(run["steps"][-1], ex._wrong_oracle(run, W, wrong))[1] > 0, wrong
    print(f"\nschedule: largest |param - oracle| {_largest_deviation(run):.2e}")


def test_bf16_through_fsdp2_mixed_precision_matches_the_fp32_big_batch(runs):
    """bf16 compute (FSDP2 MixedPrecisionPolicy, fp32 reduction), each step's update within sqrt(m) u
    (the bound and its derivation: tests/test_exactness.py, BF16_RTOL) of the fp32 big-batch gradient."""
    run = runs["bf16_k3"]
    before, errors = run["init"], []
    for s, window in enumerate(ex.windows_for(W, 3)):
        after = run["steps"][s]
        oracle_params, _ = ex.oracle_run(before, [window], "tokens", 3, W)
        want = ex._update(before, oracle_params[0])
        rel, worst = ex._normwise(ex._update(before, after), want)
        errors.append(rel)
        assert rel <= ex.BF16_RTOL and worst <= ex.BF16_RTOL, f"step {s + 1}: {rel:.2e} / {worst:.2e}"
        if s == 0:
            wrong, _ = ex.oracle_run(before, [window], "mean_of_means", 3, W)
            assert ex._normwise(ex._update(before, wrong[0]), want)[0] > 2 * ex.BF16_RTOL
        before = after
    print(f"\nbf16: normwise deviation per step {['%.2e' % e for e in errors]}, tolerance {ex.BF16_RTOL:.2e}")
    assert max(errors) > 1e-5, f"deviations {errors} look like fp32: did bf16 run?"


@pytest.mark.parametrize("policy", POLICIES)
def test_a_script_built_on_build_accelerator_trains_sharded_as_under_ddp(runs, example_results, policy):
    """examples/custom_loop.py, unchanged, under cpu_fsdp.yaml and each policy: the same losses as its DDP run
    (exact accumulation: equal up to the order of the reductions), its scheduler run to its end as under DDP."""
    sharded, replicated = runs["custom_loop"][policy], ok(example_results["custom_loop"])
    for got, want in zip(sharded, replicated):
        assert got["world_size"] == want["world_size"] == W
        assert "FSDP" in got["distributed_type"] and "FSDP" not in want["distributed_type"], got["distributed_type"]
        gap = max(abs(a - b) / abs(b) for a, b in zip(got["train_loss"], want["train_loss"]))
        print(f"\ncustom_loop under FSDP2 {policy}: largest relative loss difference from DDP {gap:.1e}")
        assert len(got["train_loss"]) == len(want["train_loss"]) and gap <= 1e-5
        assert got["eval_loss_after"] == pytest.approx(want["eval_loss_after"], rel=1e-5)
        assert got["final_learning_rate"] == pytest.approx(want["final_learning_rate"], abs=1e-12)


# --------------------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("policy", POLICIES)
def test_checkpointed_run_is_the_big_batch_and_its_twin_under_every_policy(runs, policy):
    """Accelerate's checkpoint wrapper around each block unit: the update within 1e-6 of the big batch and the
    losses of the run without it, with the settings Accelerate's wrapper uses on the plan."""
    run = runs[f"tok_k3_{policy}_gc"]
    worst, gap, seconds = ex.assert_checkpointed_like_its_twin(run, runs[f"tok_k3_{policy}"], W)
    assert run["ranks"][0]["gradient_checkpointing_kwargs"] == {"use_reentrant": False, "preserve_rng_state": False}
    print(f"\n{policy} with checkpointing: largest |param - oracle| {worst:.2e}, loss gap {gap:.1e}, {seconds}")


@pytest.mark.parametrize("policy", POLICIES)
def test_checkpointing_adds_no_all_gather_in_any_window(runs, policy):
    """The recompute inside each block unit's backward gathers nothing more (FSDP2 skips the forward's gather
    there: the backward gathered the unit already): per window, the independent count of all-gathers (calls and
    bytes) and accum_kit's profiler's are those of the run without checkpointing and of the cost table with
    ``activation_checkpointing=True``, whose compute term is the blocks' share of a forward."""
    from accum_kit.engines.costs import policy_costs

    info, plain = runs[f"tok_k3_{policy}_gc"]["ranks"][0], runs[f"tok_k3_{policy}"]["ranks"][0]
    per_window = []
    for w, w0 in zip(jh.windows_of(info["micro"]), jh.windows_of(plain["micro"]), strict=True):
        c = policy_costs(policy, _layout(), world_size=W, accumulation_steps=len(w), activation_checkpointing=True)
        counted = (sum(m["all_gather_calls"] for m in w), sum(m["all_gather_bytes"] for m in w))
        assert counted == (sum(m["all_gather_calls"] for m in w0), sum(m["all_gather_bytes"] for m in w0))
        assert counted == (c.all_gather_calls, c.all_gather_bytes), (policy, len(w))
        assert sum(m["reduce_scatter_calls"] for m in w) == c.reduce_scatter_calls
        mine = [x for x in info["profiler_calls"] if x["kind"] == "all_gather"
                and info["micro"].index(w[0]) <= x["micro_batch"] <= info["micro"].index(w[-1])]
        assert len(mine) == counted[0]
        per_window.append(counted[0])
    layout = _layout()
    assert c.recompute_forward_fraction == layout.layer_parameters / layout.parameters > 0
    assert policy_costs(policy, layout, world_size=W, accumulation_steps=3).recompute_forward_fraction == 0
    print(f"\n{policy}: all-gathers per window {per_window} with checkpointing, the same without; "
          f"recompute {c.recompute_forward_fraction:.2f} of a forward")


def test_a_config_with_fsdp_activation_checkpointing_is_the_same_run(runs, example_results):
    """``fsdp_activation_checkpointing: true`` in the accelerate config, no flag: the plan records it and
    examples/custom_loop.py trains to the losses of its DDP run."""
    got, want = runs["custom_loop"]["config_gc"], ok(example_results["custom_loop"])
    for g, w in zip(got, want):
        assert g["gradient_checkpointing"] and not w["gradient_checkpointing"]
        gap = max(abs(a - b) / abs(b) for a, b in zip(g["train_loss"], w["train_loss"]))
        assert len(g["train_loss"]) == len(w["train_loss"]) and gap <= 1e-5, gap
    print(f"\ncustom_loop, config's fsdp_activation_checkpointing: largest loss gap to DDP {gap:.1e}")


def test_a_plain_module_is_checkpointed_where_accelerate_finds_blocks_and_refused_where_not(runs):
    """tests/fsdp_plain_module.py: a stack of blocks with no _no_split_modules gets no checkpoint from Accelerate's
    auto-wrap policy, which is refused naming the flag (rather than a run that silently keeps every activation);
    with the block class named there, every block is wrapped and the sharded gradient (x W: FSDP2 averages) is
    plain PyTorch's on the big batch, within the fp32 criterion of tests/test_exactness.py (1e-6 + 1e-5 |g|)."""
    for r in runs["plain_module"]:
        assert r["Stack"]["refused"].startswith("--gradient_checkpointing: no transformer blocks found in Stack"), r
        assert r["NamedStack"]["wrappers"] == 3 and r["NamedStack"]["max_grad_excess"] <= 0, r["NamedStack"]
    print(f"\nplain module under FSDP2 with checkpointing: largest gradient gap {r['NamedStack']['max_grad_gap']:.1e}")


# --------------------------------------------------------------------------- sharded checkpoints


@pytest.mark.parametrize("step", BY_NAME["resume_2ep"]["resume_from"])
def test_resume_from_a_sharded_checkpoint_equals_the_uninterrupted_run(runs, step):
    run = runs["resume_2ep"]
    ex.assert_resumed_equals_uninterrupted(run, step)
    ex._check_run_against_oracle(run, W)


# --------------------------------------------------------------------------- refusals (in-process)


@pytest.fixture
def fsdp_env(monkeypatch):
    """What ``accelerate launch`` with an FSDP config exports, without a launch; Accelerate's state reset."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    jh.reset_accelerate_state()
    yield monkeypatch
    jh.reset_accelerate_state()


@pytest.mark.parametrize("kwargs,env,flag", [
    (dict(), {"FSDP_VERSION": "1"}, "--fsdp_version"),
    (dict(), {}, "--num_processes"),  # FSDP on CPU with one process
    (dict(cpu=None), {}, "--num_processes"),  # the same on a machine without a GPU, CPU not asked for
    (dict(ddp_kwargs={"bucket_cap_mb": 5.0}), {}, "--ddp_bucket_cap_mb"),  # DDP's settings mean nothing here
    (dict(accumulation_policy="no_sync_no_reshard_after_backward"), {"FSDP_RESHARD_AFTER_FORWARD": "false"},
     "--accumulation_policy"),
    (dict(accumulation_policy="no_sync", sync_each_batch=True), {}, "--sync_each_batch"),
    (dict(accumulation_policy="gathered"), {}, "--accumulation_policy"),
])
def test_what_cannot_work_is_refused_naming_the_flag(fsdp_env, kwargs, env, flag):
    from accum_kit import UsageError, build_accelerator

    for k, v in env.items():
        fsdp_env.setenv(k, v)
    with pytest.raises(UsageError) as err:
        build_accelerator(2, **{"cpu": True, **kwargs})
    assert err.value.flag == flag and "Fix:" in str(err.value), str(err.value)


@pytest.mark.parametrize("policy", ["no_sync_no_reshard_after_backward", "no_sync_no_reshard"])
def test_fsdp_only_policies_are_refused_under_ddp(monkeypatch, policy):
    from accum_kit import UsageError, build_accelerator

    for var in ("WORLD_SIZE", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(var, raising=False)
    jh.reset_accelerate_state()
    with pytest.raises(UsageError) as err:
        build_accelerator(2, cpu=True, accumulation_policy=policy)
    assert err.value.flag == "--accumulation_policy" and "cpu_fsdp.yaml" in err.value.fix
    jh.reset_accelerate_state()


def test_bf16_gets_an_fp32_reduction_and_the_gathered_policy_its_reshard_setting():
    from accelerate.utils import FullyShardedDataParallelPlugin

    from accum_kit.engines.policies import POLICIES as P
    from accum_kit.engines.fsdp2_plugin import fsdp_plugin_for

    plugin = fsdp_plugin_for(P["no_sync_no_reshard"], FullyShardedDataParallelPlugin(fsdp_version=2), "bf16")
    assert plugin.reshard_after_forward is False
    mp = plugin.mixed_precision_policy
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    kept = fsdp_plugin_for(P["no_sync"], FullyShardedDataParallelPlugin(fsdp_version=2), "no")
    assert kept.reshard_after_forward is True and kept.mixed_precision_policy is None



# --------------------------------------------------------------------------- LoRA adapters on a frozen model


@pytest.mark.parametrize("name", [sc["name"] for sc in LORA_SCENARIOS])
def test_lora_run_is_the_float64_big_batch_of_the_same_peft_model(runs, name):
    """Every policy (and checkpointing), units mixing frozen weights and adapters: each adapter parameter within the
    fp32 criterion of the float64 single-process PeftModel after every step, each frozen one bitwise unchanged,
    optimizer state for the adapters only (tests/lora_oracle.py); reduce-scatters only where the policy says."""
    import lora_oracle

    run = runs[name]
    worst = lora_oracle.assert_lora_run(run, W, f"FSDP2 {name}")
    policy = run["scenario"]["policy"]
    for info in run["ranks"]:
        syncs = [m["reduce_scatter_calls"] > 0 for m in info["micro"]]
        assert syncs == [policy == "sync_each_batch" or m["boundary"] for m in info["micro"]], syncs
        assert info["loss"]["implementation"] == "chunked", info["loss"]
    print(f"\nFSDP2 {name}: largest |adapter - float64 oracle| {worst:.2e}")


@pytest.mark.parametrize("policy", POLICIES)
def test_lora_reduces_and_holds_the_adapters_gradients_only(runs, policy):
    """Counted by hand (each c_attn's adapter: lora_A r x d and lora_B 3d x r, T elements in all): every
    synchronised micro-batch reduce-scatters the L block units (the root and head units hold frozen weights only)
    carrying 4 T bytes; the window holds 4 T bytes of gradients under no_sync (4 T / W when syncing each), and the
    engine's prediction (the cost table's row) says the same; every frozen weight is still all-gathered."""
    c = ex.MODEL_CONFIG
    d, L, r = c["n_embd"], c["n_layer"], jh.LORA["r"]
    T = L * r * (d + 3 * d)
    full = _layout()  # the same units without adapters: their all-gathered bytes plus the adapters'
    for info in runs[f"lora_k3_{policy}"]["ranks"]:
        for w in jh.windows_of(info["micro"]):
            syncs = len(w) if policy == "sync_each_batch" else 1
            assert sum(m["reduce_scatter_calls"] for m in w) == syncs * L, (policy, w)
            assert sum(m["reduce_scatter_bytes"] for m in w) == syncs * 4 * T, (policy, w)
            counted = sum(m["all_gather_bytes"] for m in w)
            ref = sum(m["all_gather_bytes"] for m in next(v for v in jh.windows_of(
                runs[f"tok_k3_{policy}"]["ranks"][info["rank"]]["micro"]) if len(v) == len(w)))
            assert counted > ref, "the frozen weights were not all-gathered"
        want = 4 * T / W if policy == "sync_each_batch" else 4 * T
        assert info["memory"]["gradient_bytes"] == want, info["memory"]
        predicted = info["predicted_memory"][policy]
        assert predicted["gradient_bytes"] == want and predicted["optimizer_state_bytes"] == 8 * T / W
        assert predicted["parameter_shard_bytes"] == 4 * (full.parameters + T) / W
        assert predicted["frozen_parameter_bytes"] == 4 * full.parameters / W
