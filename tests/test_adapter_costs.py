"""Costs of a LoRA run counted by trainable parameters: the cost table, the activation count, `plan --lora_r`.

Oracles: autograd's saved tensors of a plain peft ``PeftModel`` (the same storage count as
tests/test_activation_memory.py), and sums done here by hand from the model's shape: a LoRA adapter
of rank r on a layer d_in -> d_out has ``r (d_in + d_out)`` parameters (Hu et al. 2021), the frozen
weights are held as parameters but get no gradient, optimizer state or reduction. In-process, a few
seconds. The measured side of FSDP2 (calls, bytes, held gradients of a LoRA run) is in tests/test_fsdp.py.
"""

from __future__ import annotations

import pytest

from accum_kit import cli
from accum_kit.engines.activation_memory import CALIBRATION, TransformerShape, activation_bytes, peak_parts
from accum_kit.engines.costs import ddp_costs, policy_costs, zero_costs
from accum_kit.engines.model_units import gpt2_units_for, with_lora
from accum_kit.planning.memory_plan import plan_by_memory

from test_activation_memory import V, saved_bytes_in_blocks, tiny_parameters

pytest.importorskip("peft")

D, L, A, F = 64, 2, 2, 256  # the tiny preset: width, layers, heads, MLP width


@pytest.mark.parametrize("targets,dropout", [(["c_attn"], 0.0), (["c_attn"], 0.1), (["c_attn", "c_proj", "c_fc"], 0.0)])
def test_lora_block_activations_match_autograds_saved_tensors(targets, dropout):
    import torch
    from peft import LoraConfig, get_peft_model

    from accum_kit.job.models import build_model

    b, s, r = 3, 32, 4
    model = get_peft_model(build_model("tiny", V, s, seed=0),
                           LoraConfig(r=r, lora_alpha=8, lora_dropout=dropout, target_modules=targets)).train()
    ids = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(0))
    measured = saved_bytes_in_blocks(model.base_model.model, ids)
    shape = TransformerShape.from_preset("tiny", V).with_lora(r, targets, dropout)
    assert shape.measured and measured == activation_bytes(shape, b, s).blocks
    # by hand: full fine-tuning's 30 h + a + 4 per token and layer; a frozen c_fc (no adapter) drops the second
    # LayerNorm's output (h), a frozen MLP c_proj the GELU output (f); + r per adapted layer (c_proj is two), + its
    # input with dropout; the first block keeps no input of its first LayerNorm (h + 2: the embeddings are frozen)
    adapted = {"c_attn": [D], "c_proj": [D, F], "c_fc": [D]}
    per_layer = 30 * D + A + 4 - (D if "c_fc" not in targets else 0) - (F if "c_proj" not in targets else 0)
    per_layer += sum(r + (w if dropout else 0) for t in targets for w in adapted[t])
    first = D + 2 + (D if dropout else 0)  # with dropout, the dropped copy replaces c_attn's input in the first block
    assert measured == b * s * (L * per_layer - first) * 4


def _lora_units(r, s=32, targets=None):
    return with_lora(gpt2_units_for(L, D, V, s), L, D, r, targets)


def test_cost_rows_count_gradients_state_and_reductions_of_the_adapters_only():
    r, s, W, K = 8, 32, 2, 4
    units = _lora_units(r, s)
    T = L * r * (D + 3 * D)  # lora_A r x d and lora_B 3d x r on each c_attn
    P = tiny_parameters(s) + T  # every weight, the adapters included
    block = 12 * D * D + 13 * D + T // L
    assert (units.parameters, units.trainable_parameters, units.trainable_units) == (P, T, L)
    # DDP (no_sync): one all-reduce of the adapters' gradient per window; parameters all held, frozen ones named
    c = ddp_costs("no_sync", world_size=W, accumulation_steps=K, gradient_bytes=4 * T, frozen_parameters=P - T)
    assert (c.all_reduce_calls, c.all_reduce_bytes, c.gradient_bytes, c.optimizer_state_bytes) == (1, 4 * T, 4 * T, 8 * T)
    assert (c.parameter_shard_bytes, c.frozen_parameter_bytes) == (4 * P, 4 * (P - T))
    c = ddp_costs("sync_each_batch", world_size=W, accumulation_steps=K, gradient_bytes=4 * T, frozen_parameters=P - T)
    assert (c.all_reduce_calls, c.all_reduce_bytes) == (K, K * 4 * T)
    # FSDP2 sync_each_batch: only the block units (holding adapters) reduce-scatter; every unit is gathered
    c = policy_costs("sync_each_batch", units, world_size=W, accumulation_steps=K)
    head, positions = V * D + 2 * D, s * D
    assert (c.reduce_scatter_calls, c.reduce_scatter_bytes) == (K * L, K * 4 * T)
    assert (c.all_gather_calls, c.all_gather_bytes) == (K * (2 * L + 2), K * (2 * L * block + head + positions) * 4)
    assert (c.gradient_bytes, c.optimizer_state_bytes, c.parameter_shard_bytes) == (4 * T / W, 8 * T / W, 4 * P / W)
    assert c.frozen_parameter_bytes == 4 * (P - T) / W
    c = policy_costs("no_sync_no_reshard", units, world_size=W, accumulation_steps=K)
    assert (c.reduce_scatter_calls, c.gradient_bytes, c.gathered_parameter_bytes) == (L, 4 * T, 4 * P)
    # HSDP 2 x 2: the adapters' shards all-reduced across the replicas, once per window under no_sync
    c = policy_costs("no_sync", units, world_size=4, accumulation_steps=K, replicate_size=2)
    assert (c.all_reduce_calls, c.all_reduce_bytes) == (L, 4 * T / 2)
    # ZeRO: optimizer state of the adapters (partitioned); frozen weights held whole (1, 2) or partitioned (3)
    for stage, shards in (("zero1", 4 * P), ("zero2", 4 * P), ("zero3", 4 * P / W)):
        z = zero_costs(stage, T, world_size=W, accumulation_steps=K, frozen_parameters=P - T)
        # AdamW's two moments and the float32 master partition (4 bytes), of the adapters only
        assert (z.parameter_shard_bytes, z.optimizer_state_bytes) == (shards, (8 + 4) * T / W), stage
        assert z.gradient_bytes == (4 * T if stage == "zero1" else 4 * T / W), stage
        assert policy_costs(stage, units, world_size=W, accumulation_steps=K) == z
    # full fine-tuning unchanged: the same model without adapters prices every parameter
    full = policy_costs("sync_each_batch", gpt2_units_for(L, D, V, s), world_size=W, accumulation_steps=K)
    assert (full.reduce_scatter_calls, full.reduce_scatter_bytes) == (K * (L + 2), K * 4 * tiny_parameters(s))


def test_peak_by_part_names_the_frozen_weights():
    T, P = 1000, 50_000
    c = ddp_costs("no_sync", world_size=2, accumulation_steps=2, gradient_bytes=4 * T, frozen_parameters=P - T)
    acts = activation_bytes(TransformerShape.from_preset("tiny", V), 1, 8)
    parts = peak_parts(c.to_dict(), acts, resident_before_training=1e6 + 4 * P)
    assert (parts["parameters"], parts["frozen_parameters"], parts["gradients"], parts["optimizer_state"]) == (
        4 * T, 4 * (P - T), 4 * T, 8 * T)
    assert parts["baseline"] == 1e6 and parts["total"] == pytest.approx(
        1e6 + 4 * P + 4 * T + 8 * T + acts.total)


def lora_hand_peak(P, T, b, s, *, baseline, buckets):
    """A LoRA DDP row's peak by hand (r on c_attn, no dropout, the fused loss): every weight held (4 P),
    the adapters' gradient, AdamW moments and DDP's bucket copy (4 + 8 + 4 per trainable element), the adapted
    blocks' activations (test above), the frozen output layer's fused loss: it keeps the hidden states' gradient (no
    weight gradient) and makes one chunk's logits (here the whole micro-batch); on top the larger of that chunk and
    the calibration's share of one layer (as tests/test_activation_memory.py's hand_peak)."""
    layer = 30 * D + A + 4 - D - F + (T // L) // (4 * D)  # + r per token: lora_A's output
    tok = b * s
    acts = tok * (L * layer - (D + 2) + 2 * D + 2) * 4 + 4 * tok * D
    return (baseline + 4 * P + 4 * T + 8 * T + (4 * T if buckets else 0) + acts
            + max(tok * V * 4, CALIBRATION * tok * layer * 4))


def test_plan_prices_a_lora_run_by_hand():
    r, s = 8, 32
    T = L * r * 4 * D
    P = tiny_parameters(s) + T
    plan = plan_by_memory("10GB", 8, model_preset="tiny", block_size=s, num_processes=2, baseline_memory="100MB",
                          busbw_GBps=1.0, lora_r=r)
    rows = {(r_.engine, r_.policy, r_.micro_batch, r_.checkpointing): r_ for r_ in plan.rows}
    for b in (1, 2, 4):
        row = rows[("DDP", "no_sync", b, False)]
        assert row.peak_bytes == pytest.approx(lora_hand_peak(P, T, b, s, baseline=100e6, buckets=True))
        assert row.parts["frozen_parameters"] == 4 * (P - T) and row.parts["parameters"] == 4 * T
    assert any("LoRA" in n and str(T) in n for n in plan.notes), plan.notes
    # no_sync against sync_each_batch under LoRA: both all-reduce the adapters only (T, not P): the same compute,
    # K - 1 fewer all-reduces of 4 T bytes
    ne, se = rows[("DDP", "no_sync", 1, False)], rows[("DDP", "sync_each_batch", 1, False)]
    assert ne.compute_seconds == se.compute_seconds and ne.step_seconds < se.step_seconds
    full = plan_by_memory("10GB", 8, model_preset="tiny", block_size=s, num_processes=2, baseline_memory="100MB",
                          busbw_GBps=1.0)
    full_rows = {(r_.engine, r_.policy, r_.micro_batch, r_.checkpointing): r_ for r_ in full.rows}
    saved_full = full_rows[("DDP", "sync_each_batch", 1, False)].step_seconds - full_rows[("DDP", "no_sync", 1,
                                                                                          False)].step_seconds
    assert 0 < se.step_seconds - ne.step_seconds < saved_full  # what no_sync saves shrinks with the gradient


@pytest.mark.parametrize("argv,flag", [(["--lora_dropout", "0.1"], "--lora_dropout"),
                                       (["--lora_r", "0"], "--lora_r"),
                                       (["--lora_r", "4", "--lora_target_modules", "lm_head"], "--lora_target_modules")])
def test_plan_lora_bad_input_exits_2_naming_the_flag(capsys, argv, flag):
    code = cli.run("plan", ["--memory_per_process", "10GB", "--target_effective_batch", "8", "--model_preset",
                     "tiny", *argv])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and f"{flag}:" in captured.err, captured.err


def test_plan_command_with_lora_r_prints_the_adapters(capsys):
    code = cli.run("plan", ["--memory_per_process", "10GB", "--target_effective_batch", "8", "--model_preset",
                     "tiny", "--block_size", "32", "--num_processes", "2", "--lora_r", "8"])
    out = capsys.readouterr().out
    assert code == 0 and f"LoRA: {L * 8 * 4 * D} trainable" in out and "recommended:" in out
