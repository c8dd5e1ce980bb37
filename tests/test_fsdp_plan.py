"""The FSDP2 cost formulas and ``accum-kit plan --fsdp``, in-process (no launch).

The closed-form counts of :func:`accum_kit.engines.costs.policy_costs` are
checked against a step-by-step simulation of FSDP2's gather/free rules
written here (tests/test_fsdp.py checks both against the collectives a real
2-process FSDP2 run sends); the GPT-2 unit sizes against ``transformers``
models; the plan's choices against the formulas' own numbers with memory
limits placed between them; the profile reader against the keys a real
FSDP2 profile has (tests/test_train_job.py writes one).
"""

from __future__ import annotations

import json

import pytest

from accum_kit import cli
from accum_kit.errors import UsageError
from accum_kit.engines.costs import ShardedModel, gpt2_units, gpt2_units_for, policy_costs
from accum_kit.planning.fsdp_plan import make_fsdp_plan
from accum_kit.planning.measured_profile import load_profile
from accum_kit.engines.policies import POLICIES, policies_for

LAYOUT = ShardedModel(resharded=(1000, 1000, 1000), kept=(300, 50))


def simulate(policy: str, layout: ShardedModel, K: int) -> dict:
    """FSDP2's rules, one unit and one micro-batch at a time: a unit all-gathers before its forward and its
    backward unless its parameters are already gathered; after forward it frees them if it reshards after
    forward (the layers; under no_sync_no_reshard none does); after backward it frees them unless the policy
    keeps them inside the window (never on the window's last micro-batch); a synchronised backward
    reduce-scatters every unit."""
    p = POLICIES[policy]
    units = [(n, True) for n in layout.resharded] + [(n, False) for n in layout.kept]
    if p.reshard_after_forward is False:
        units = [(n, False) for n, _ in units]
    gathered = [False] * len(units)
    out = {"ag_calls": 0, "ag_elems": 0, "rs_calls": 0, "rs_elems": 0}

    def gather(i):
        if not gathered[i]:
            out["ag_calls"] += 1
            out["ag_elems"] += units[i][0]
            gathered[i] = True

    for micro in range(K):
        last = micro == K - 1
        for i, (_, reshard_fwd) in enumerate(units):  # forward
            gather(i)
            if reshard_fwd:
                gathered[i] = False
        for i in reversed(range(len(units))):  # backward
            gather(i)
            if last or not p.keep_params_after_backward:
                gathered[i] = False
            if last or p.sync_each_batch:
                out["rs_calls"] += 1
                out["rs_elems"] += units[i][0]
    return out


@pytest.mark.parametrize("policy", policies_for(False))
@pytest.mark.parametrize("K", [1, 2, 3, 8])
def test_closed_forms_equal_the_simulated_window(policy, K):
    c = policy_costs(policy, LAYOUT, world_size=4, accumulation_steps=K, param_bytes=4, compute_bytes=2, reduce_bytes=4)
    sim = simulate(policy, LAYOUT, K)
    assert (c.all_gather_calls, c.all_gather_bytes) == (sim["ag_calls"], 2 * sim["ag_elems"])
    assert (c.reduce_scatter_calls, c.reduce_scatter_bytes) == (sim["rs_calls"], 4 * sim["rs_elems"])


@pytest.mark.parametrize("policy", policies_for(False))
def test_memory_between_micro_batches(policy):
    """Sharded gradients (1/W) only when syncing each micro-batch; gathered parameters only when kept."""
    P, W = LAYOUT.parameters, 8
    c = policy_costs(policy, LAYOUT, world_size=W, accumulation_steps=4, param_bytes=4, compute_bytes=2, reduce_bytes=4)
    assert c.parameter_shard_bytes * W == 4 * P and c.optimizer_state_bytes * W == 8 * P
    assert c.gradient_bytes == (4 * P / W if policy == "sync_each_batch" else 4 * P)
    assert c.gathered_parameter_bytes == (2 * P if POLICIES[policy].keep_params_after_backward else 0)
    one = policy_costs(policy, LAYOUT, world_size=W, accumulation_steps=1)
    assert one.gradient_bytes == one.gathered_parameter_bytes == 0  # no micro-batch follows another


@pytest.mark.parametrize("preset", ["tiny", "mini", "small", "comm_heavy"])
def test_gpt2_units_add_up_to_the_transformers_model(preset):
    from accum_kit.job.models import build_model, count_parameters

    layout = gpt2_units(preset, 384, 128)
    model = build_model(preset, 384, 128)
    assert layout.parameters == count_parameters(model)  # tied embedding/head once
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    assert set(layout.resharded) == {block} and len(layout.resharded) == len(model.transformer.h)


def test_gpt2_units_for_a_config():
    from transformers import GPT2Config, GPT2LMHeadModel

    layout = gpt2_units_for(3, 32, 100, 40)
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=100, n_positions=40))
    assert layout.parameters == sum(p.numel() for p in model.parameters())
    assert layout.other_parameters == model.transformer.wte.weight.numel() + model.transformer.wpe.weight.numel() + 64


# --------------------------------------------------------------------------- the plan


def _need(policy, **kw):
    return policy_costs(policy, gpt2_units("small", 384, 128), **kw).accumulation_bytes


@pytest.mark.parametrize("free_between", [("no_sync", "no_sync_no_reshard"), ("sync_each_batch", "no_sync"), None])
def test_recommends_the_fastest_policy_that_fits(free_between):
    """Free memory placed between two policies' needs: the fastest of those that fit is recommended."""
    kw = dict(world_size=8, accumulation_steps=8)
    free = None if free_between is None else (_need(free_between[0], **kw) + _need(free_between[1], **kw)) / 2 / 1e9
    plan = make_fsdp_plan(num_processes=8, num_machines=2, gradient_accumulation_steps=8, model_preset="small",
                          free_memory_GB=free)
    rows = {r.policy: r for r in plan.rows}
    fitting = [r for r in rows.values() if r.fits is not False]
    assert plan.recommended == min(fitting, key=lambda r: r.comm_seconds).policy
    if free_between is not None:
        assert rows[free_between[0]].fits and not rows[free_between[1]].fits
    assert rows["no_sync_no_reshard"].comm_seconds < rows["no_sync"].comm_seconds < rows["sync_each_batch"].comm_seconds
    assert rows["sync_each_batch"].saved_seconds_vs_sync_each_batch == 0
    assert plan.interconnect == "infiniband"  # 2 machines, no bandwidth given


def test_nothing_fits_says_so():
    plan = make_fsdp_plan(num_processes=2, gradient_accumulation_steps=4, model_preset="small", free_memory_GB=1e-6)
    assert plan.recommended is None and any("no policy fits" in n for n in plan.notes)


def test_gpu_memory_minus_shards_and_optimizer_state():
    plan = make_fsdp_plan(num_processes=4, gradient_accumulation_steps=4, model_preset="small", gpu_memory_GB=1)
    base = policy_costs("sync_each_batch", gpt2_units("small", 384, 128), world_size=4, accumulation_steps=4)
    assert plan.free_memory_bytes == pytest.approx(1e9 - base.parameter_shard_bytes - base.optimizer_state_bytes)


def plan_cli(capsys, *argv):
    code = cli.run("plan", ["--per_device_train_batch_size", "1", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prints_the_table_and_the_arithmetic(capsys):
    code, out, _ = plan_cli(capsys, "--fsdp", "--model_preset", "small", "--num_processes", 8, "--num_machines", 2,
                            "--gradient_accumulation_steps", 8, "--gpu_memory_GB", 80)
    assert code == 0
    assert "recommended (fastest that fits): --accumulation_policy no_sync_no_reshard" in out
    assert "gradients held: P b_r" in out and "all-gathers:" in out
    code, out, _ = plan_cli(capsys, "--fsdp", "--num_parameters", 8_000_000_000, "--num_layers", 32,
                            "--num_processes", 8, "--num_machines", 2, "--gradient_accumulation_steps", 8,
                            "--mixed_precision", "bf16", "--free_memory_GB", 8, "--json")
    plan = json.loads(out)["fsdp"]
    assert code == 0 and plan["recommended"] == "sync_each_batch"  # 32 GB of fp32 gradients do not fit in 8


@pytest.mark.parametrize("argv,flag", [
    (["--model_preset", "small"], "--model_preset"),  # without --fsdp
    (["--fsdp", "--num_parameters", "100", "--num_processes", "2"], "--num_layers"),
    (["--fsdp", "--model_preset", "small", "--num_parameters", "100", "--num_layers", "2"], "--num_parameters"),
    (["--fsdp", "--model_preset", "small", "--free_memory_GB", "0"], "--free_memory_GB"),
    (["--fsdp", "--model_preset", "small", "--num_processes", "2", "--compare_bench", "bench.json"], "--compare_bench"),
    (["--fsdp", "--model_preset", "small", "--num_processes", "2", "--interconnect", "measured"], "--interconnect"),
    (["--fsdp", "--num_processes", "2"], "--model_preset"),
])
def test_bad_input_exits_2_naming_the_flag(capsys, argv, flag):
    code, out, err = plan_cli(capsys, *argv)
    assert code == 2 and out == "" and err.startswith(f"error: {flag}:") and "Fix:" in err, err


def test_profile_reader_refuses_a_ddp_profile(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"comm": {"world_size": 2, "allreduce_calls": 10}}))
    with pytest.raises(UsageError) as err:
        load_profile(str(path), "sharded")
    assert err.value.flag == "--from_profile" and "not an FSDP2 profile" in str(err.value)


# --------------------------------------------------------------------------- predicted vs a bench


def _profile(tmp_path) -> str:
    """An FSDP2 profile with round numbers: 2 processes, K_p = 4 (40 micro-batches / 10 steps), compute 0.1 s
    per micro-batch, 10 syncs of 4e6 B each exposing 0.02 s -> reduce-scatter busbw 4e6 x 1/2 / 0.02 = 0.1 GB/s;
    all-gather busbw 0.2 GB/s; exposed communication 0.3 s per step; step 0.8 s -> o = 0.8 - 0.4 - 0.3 = 0.1 s."""
    comm = {"world_size": 2, "optimizer_steps": 10, "micro_batches": 40, "reduce_scatter_calls": 40,
            "reduce_scatter_bytes": 4e7, "syncs": 10, "backward_seconds_no_sync": 0.05, "compute_seconds": 0.1,
            "exposed_comm_seconds": 0.02, "all_gather_busbw_GBps": 0.2, "exposed_comm_seconds_per_step": 0.3,
            "optimizer_seconds": 0.05, "seconds_per_step": 0.8, "fsdp_units": []}
    path = tmp_path / "train_summary.json"
    path.write_text(json.dumps({"comm": comm, "model": "preset:tiny", "block_size": 64,
                                "accumulation_policy": "no_sync"}))
    return str(path)


def test_profile_numbers_become_the_models_inputs(tmp_path):
    p = load_profile(_profile(tmp_path), "sharded")
    assert (p.gradient_accumulation_steps, p.compute_seconds) == (4, 0.1)
    assert p.reduce_scatter_busbw_GBps == pytest.approx(0.1) and p.other_seconds == pytest.approx(0.1)


def test_bench_comparison_predicts_k_c_plus_comm_plus_o(tmp_path):
    layout = gpt2_units("tiny", 384, 64)
    bench = {"schema": "accum_kit.bench.fsdp/1", "machine": {"world_size": 2},
             "presets": {"tiny": {"units": {"resharded": list(layout.resharded), "kept": list(layout.kept)},
                                  "element_bytes": {"b_p": 4, "b_c": 4, "b_r": 4}, "noise_floor": 0.05}},
             "rows": [{"preset": "tiny", "K": 8, "policy": p, "step_s_median": 1.0, "speedup_vs_sync_each_batch": 1.0,
                       "speedup_ci_low": 0.9, "speedup_ci_high": 1.1} for p in policies_for(False)]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    plan = make_fsdp_plan(num_processes=2, gradient_accumulation_steps=8, from_profile=_profile(tmp_path))
    assert plan.interconnect == "measured" and plan.busbw_reduce_scatter_GBps == pytest.approx(0.1)
    from accum_kit.planning.fsdp_compare import compare_fsdp_bench

    cmp = compare_fsdp_bench(str(tmp_path / "bench.json"), plan)
    for row in cmp["rows"]:
        c = policy_costs(row["policy"], layout, world_size=2, accumulation_steps=8)
        comm = c.reduce_scatter_bytes / 2 / 0.1e9 + c.all_gather_bytes / 2 / 0.2e9
        assert row["predicted_s"] == pytest.approx(8 * 0.1 + comm + 0.1)
        assert row["predicted_over_measured"] == pytest.approx(row["predicted_s"])
    assert cmp["noise_floor"] == 0.05


# --------------------------------------------------------------------------- HSDP: the same table with a mesh


def simulate_hsdp(policy: str, layout: ShardedModel, K: int) -> dict:
    """:func:`simulate`, plus HSDP's rule: after a unit's reduce-scatter its shard is all-reduced across replicas,
    on every synchronised backward, except under reduce_scatter_each_batch, which reduce-scatters every
    micro-batch and all-reduces only on the window's last one."""
    p = POLICIES[policy]
    out = simulate("sync_each_batch" if p.hsdp_only else policy, layout, K)
    synced_backwards = K if (p.sync_each_batch or p.hsdp_only) else 1
    all_reduced = 1 if p.hsdp_only else synced_backwards
    units = len(layout.resharded) + len(layout.kept)
    out["rs_calls"], out["ar_calls"] = synced_backwards * units, all_reduced * units
    out["ar_elems"] = all_reduced * layout.parameters
    return out


@pytest.mark.parametrize("policy", policies_for(True))
@pytest.mark.parametrize("K", [1, 3, 8])
def test_hsdp_closed_forms_equal_the_simulated_window(policy, K):
    R, W = 2, 8
    S = W // R
    c = policy_costs(policy, LAYOUT, world_size=W, accumulation_steps=K, param_bytes=4, compute_bytes=2,
                     reduce_bytes=4, replicate_size=R)
    sim = simulate_hsdp(policy, LAYOUT, K)
    assert (c.all_gather_calls, c.all_gather_bytes) == (sim["ag_calls"], 2 * sim["ag_elems"])
    assert c.reduce_scatter_calls == sim["rs_calls"]
    assert (c.all_reduce_calls, c.all_reduce_bytes) == (sim["ar_calls"], 4 * sim["ar_elems"] / S)
    assert c.parameter_shard_bytes == 4 * LAYOUT.parameters / S  # sharded over S, replicated over R


def test_the_hsdp_policy_holds_the_sharded_gradient_and_needs_replicas():
    P, S = LAYOUT.parameters, 4
    new = policy_costs("reduce_scatter_each_batch", LAYOUT, world_size=8, accumulation_steps=4, replicate_size=2)
    no_sync = policy_costs("no_sync", LAYOUT, world_size=8, accumulation_steps=4, replicate_size=2)
    assert new.gradient_bytes == 4 * P / S and no_sync.gradient_bytes == 4 * P
    assert new.gradient_bytes / no_sync.gradient_bytes == pytest.approx(1 / S)
    with pytest.raises(UsageError) as err:
        policy_costs("reduce_scatter_each_batch", LAYOUT, world_size=8, accumulation_steps=4)
    assert err.value.flag == "--accumulation_policy"


def test_engines_on_two_machines_priced_from_first_principles():
    """DDP, FSDP2 over both machines and HSDP, K=8, fp32: communication recomputed here from the ring formulas
    (nccl-tests' busbw) and memory from what each process holds; the recommendation is the fastest that fits."""
    from accum_kit.planning.topology import compare_engines

    W, M, K, intra, inter = 8, 2, 8, 400.0, 20.0
    P, GB = LAYOUT.parameters, 1e9
    cmp = compare_engines(LAYOUT, world=W, machines=M, K=K, element_bytes=(4, 4, 4), intra_GBps=intra,
                          inter_GBps=inter, gpu_memory_GB=16 * P / GB - 1e-9)  # DDP no_sync (16 P bytes) misses
    rows = {(r["engine"], r["policy"]): r for r in cmp["rows"]}
    ddp = rows[("DDP", "no_sync")]
    assert ddp["comm"]["total"] == pytest.approx(2 * 4 * P * (W - 1) / W / (inter * GB))
    assert ddp["memory_bytes"] == 4 * P + 8 * P + 4 * P and ddp["fits"] is False
    # DDP all-reduces the whole gradient once per synchronised backward (in its own buckets, not FSDP2's
    # units): one all-reduce per no_sync window, as the what-if planner counts DDP
    assert (ddp["reduce_scatter_calls"], ddp["all_gather_calls"], ddp["all_reduce_calls"]) == (0, 0, 1)
    fsdp = rows[("FSDP2", "no_sync")]
    gathered = K * (2 * LAYOUT.layer_parameters + LAYOUT.other_parameters) * 4
    assert fsdp["comm"]["total"] == pytest.approx((4 * P + gathered) * (W - 1) / W / (inter * GB))
    S = W // M
    new = rows[("HSDP", "reduce_scatter_each_batch")]
    assert new["comm"]["reduce_scatter"] == pytest.approx(K * 4 * P * (S - 1) / S / (intra * GB))
    assert new["comm"]["all_reduce"] == pytest.approx(2 * 4 * P / S * (M - 1) / M / (inter * GB))
    assert new["memory_bytes"] == pytest.approx((4 + 8 + 4) * P / S)
    fitting = [r for r in cmp["rows"] if r["fits"]]
    fastest = min(fitting, key=lambda r: r["comm"]["total"])
    assert cmp["recommended"] == {"engine": fastest["engine"], "policy": fastest["policy"]}
    assert fastest["engine"] == "HSDP"


def test_plan_under_hsdp_lists_five_policies_and_a_single_machine_plan_does_not_move():
    hsdp = make_fsdp_plan(num_processes=8, gradient_accumulation_steps=8, num_machines=2, model_preset="small",
                          replicate_size=2, inter_node_busbw_GBps=25, busbw_GBps=400)
    assert [r.policy for r in hsdp.rows] == policies_for(True) and hsdp.engines is not None
    by = {r.policy: r for r in hsdp.rows}
    assert by["reduce_scatter_each_batch"].all_reduce_seconds == pytest.approx(by["no_sync"].all_reduce_seconds)
    assert by["sync_each_batch"].all_reduce_seconds == pytest.approx(8 * by["no_sync"].all_reduce_seconds)
    flat = make_fsdp_plan(num_processes=2, gradient_accumulation_steps=8, model_preset="small")
    assert [r.policy for r in flat.rows] == policies_for(False)
    assert {r["engine"] for r in flat.engines["rows"]} == {"DDP", "FSDP2", "DeepSpeed"}  # no HSDP on one machine
    assert all(r.all_reduce_seconds == 0 for r in flat.rows)


def test_zero_stages_are_priced_beside_the_fsdp2_policies_from_first_principles():
    """The engines table's DeepSpeed rows, W=8 on one machine, K=8, fp32, AdamW: ZeRO-1 all-reduces the whole
    gradient once per window and all-gathers the updated parameters; ZeRO-2 all-reduces it every micro-batch;
    memory = parameters (1/W under ZeRO-3) + AdamW state / W + gradients held (full under ZeRO-1, 1/W else) + the
    float32 master partition the optimizer updates, 4 P / W (a copy in every stage, even in float32: DeepSpeed
    0.19.8's ``stage_1_and_2.py`` clones it; read from ZeRO-3's optimizer on CPU too, tests/test_deepspeed.py)."""
    from accum_kit.planning.topology import compare_engines

    W, K, bw, P, GB = 8, 8, 100.0, LAYOUT.parameters, 1e9
    cmp = compare_engines(LAYOUT, world=W, machines=1, K=K, element_bytes=(4, 4, 4), intra_GBps=bw, inter_GBps=bw)
    rows = {r["policy"]: r for r in cmp["rows"] if r["engine"] == "DeepSpeed"}
    ring = (W - 1) / W / (bw * GB)
    assert rows["zero1"]["comm"]["all_reduce"] == pytest.approx(2 * (4 * P + 4) * ring)
    assert rows["zero1"]["comm"]["all_gather"] == pytest.approx(4 * P * ring)
    assert rows["zero2"]["comm"]["all_reduce"] == pytest.approx(2 * (K * 4 * P + 4) * ring)
    assert rows["zero3"]["comm"]["reduce_scatter"] == pytest.approx(K * 4 * P * ring)
    assert rows["zero1"]["memory_bytes"] == pytest.approx(4 * P + (8 + 4) * P / W + 4 * P)
    assert rows["zero2"]["memory_bytes"] == pytest.approx(4 * P + (8 + 4) * P / W + 4 * P / W)
    assert rows["zero3"]["memory_bytes"] == pytest.approx(4 * P / W + (8 + 4) * P / W + 4 * P / W)
    assert cmp["recommended"]["policy"] != "zero3"  # its all-gathers are not predicted: a floor, not a pick
