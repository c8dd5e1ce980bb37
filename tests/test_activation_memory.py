"""The activation memory model against torch's own accounting, and `accum-kit plan --memory_per_process`.

Oracle for the activations: autograd's saved tensors of a plain single-process forward
(``torch.autograd.graph.saved_tensors_hooks``), their storages summed once each, parameters left out,
counted only while a transformer block runs (forward hooks on the blocks). The plan's rows are
checked against the sums done by hand from the model's shape.
"""

from __future__ import annotations

import pytest

from accum_kit import cli
from accum_kit.engines.activation_memory import CALIBRATION, TransformerShape, activation_bytes
from accum_kit.errors import UsageError
from accum_kit.planning.memory_plan import parse_size, plan_by_memory

V = 384  # the train job's byte tokenizer


def saved_bytes_in_blocks(model, ids) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while a block's forward runs."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, depth = {}, [0]
    hooks = []
    for block in model.transformer.h:
        hooks.append(block.register_forward_pre_hook(lambda *a: depth.__setitem__(0, depth[0] + 1)))
        hooks.append(block.register_forward_hook(lambda *a: depth.__setitem__(0, depth[0] - 1)))

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and depth[0] > 0:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return sum(seen.values())


@pytest.mark.parametrize("preset,b,s", [("tiny", 3, 32), ("mini", 2, 40)])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_block_activations_match_autograds_saved_tensors(preset, b, s, checkpointing):
    import torch

    from accum_kit.job.models import build_model

    model = build_model(preset, V, s, seed=0).train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(0))
    measured = saved_bytes_in_blocks(model, ids)
    predicted = activation_bytes(TransformerShape.from_config(model.config.to_dict()), b, s,
                                 checkpointing=checkpointing)
    assert measured == predicted.blocks
    cfg = model.config
    # by hand: checkpointing keeps each block's input (b s h fp32 values); without, 30 h + a + 4 per token and layer
    per_layer = cfg.n_embd if checkpointing else 30 * cfg.n_embd + cfg.n_head + 4
    assert measured == b * s * cfg.n_layer * per_layer * 4


def test_korthikanti_count_for_other_families():
    # Korthikanti et al. 2022: s b h (34 + 5 a s / h) bytes per layer in 16 bit; here in elements of 2 bytes
    shape = TransformerShape(layers=2, hidden=64, heads=4, ffn=256, vocab=100, family="llama", element_bytes=2)
    got = activation_bytes(shape, 2, 16)
    assert got.blocks == 2 * (16 * 2 * 64 * (34 + 5 * 4 * 16 / 64))
    assert not got.measured


def hand_peak(P, L, h, a, b, s, *, ckpt, baseline, buckets=False, logits=False):
    """The DDP row's peak by hand: parameters, gradients, AdamW's two moments, with several processes DDP's
    buckets (a copy of the gradient), activations, and the loss: by default computed in the output layer (it keeps
    its gradients of the b s hidden states and of the V x h weight, and makes the logits of one chunk in its
    forward, here the whole micro-batch: V = 384 allows 43690 tokens per chunk); with ``logits`` it keeps the
    float32 log-softmax and makes 2 more copies at its backward. On top, the larger of the loss's transient and
    the stated calibration's share of one layer (the backward's transient gradients): they never coexist."""
    layer = 30 * h + a + 4
    T = b * s
    per_token = (L * h + layer) if ckpt else L * layer
    per_token += 2 * h + 2
    kept, made = (T * V * 4, 2 * T * V * 4) if logits else (4 * (T * h + V * h), T * V * 4)
    return (baseline + 4 * P + 4 * P + 8 * P + (4 * P if buckets else 0) + T * per_token * 4 + kept
            + max(made, CALIBRATION * T * layer * 4))


def test_the_plan_prices_the_full_logits_with_fused_loss_off():
    s, P = 32, tiny_parameters(32)
    for flag, logits in (("off", True), ("auto", False)):
        plan = plan_by_memory("10GB", 4, model_preset="tiny", block_size=s, fused_linear_cross_entropy=flag)
        row = next(r for r in plan.rows if r.micro_batch == 4 and not r.checkpointing)
        assert row.peak_bytes == pytest.approx(hand_peak(P, 2, 64, 2, 4, s, ckpt=False, baseline=0, logits=logits))


def tiny_parameters(s):
    d, L = 64, 2
    return L * (12 * d * d + 13 * d) + V * d + 2 * d + s * d  # blocks, tied embedding/head, ln_f, positions


def test_plan_rows_and_recommendation_by_hand():
    s = 32
    P = tiny_parameters(s)
    plan = plan_by_memory("10GB", 8, model_preset="tiny", block_size=s, num_processes=2, baseline_memory="100MB",
                          busbw_GBps=1.0)
    rows = {(r.engine, r.policy, r.micro_batch, r.checkpointing): r for r in plan.rows}
    assert {(e, b) for e, _, b, _ in rows} == {(e, b) for e in ("DDP", "FSDP2", "DeepSpeed") for b in (1, 2, 4)}
    for b in (1, 2, 4):
        for ckpt in (False, True):
            row = rows[("DDP", "no_sync", b, ckpt)]
            assert row.accumulation_steps == 4 // b
            assert row.peak_bytes == pytest.approx(hand_peak(P, 2, 64, 2, b, s, ckpt=ckpt, baseline=100e6,
                                                             buckets=True))
            # FSDP2 sync_each_batch over 2: parameters, gradients and AdamW state sharded, no buckets; the
            # largest unit (a block, 12 d^2 + 13 d) all-gathered twice and its gradient reduce-scattered in flight
            fsdp = rows[("FSDP2", "sync_each_batch", b, ckpt)]
            in_flight = 3 * (12 * 64 * 64 + 13 * 64) * 4
            assert fsdp.peak_bytes == pytest.approx(row.peak_bytes - 4 * P - (4 + 4 + 8) * P / 2 + in_flight)
    # DDP: no_sync all-reduces once per window, sync_each_batch K times; same compute
    assert rows[("DDP", "no_sync", 1, False)].step_seconds < rows[("DDP", "sync_each_batch", 1, False)].step_seconds
    # checkpointing runs the blocks' forward again: slower at the same micro-batch
    assert rows[("DDP", "no_sync", 2, True)].step_seconds > rows[("DDP", "no_sync", 2, False)].step_seconds
    # the fastest that fits, among rows whose step time is not a lower bound (ZeRO-3's all-gathers unpredicted)
    exact = [r for r in plan.rows if r.fits and not r.step_is_floor]
    assert plan.recommended.fits and plan.recommended.step_seconds == min(r.step_seconds for r in exact)
    assert {r.engine for r in plan.rows if r.step_is_floor} == {"DeepSpeed"}


def test_plan_picks_checkpointing_when_only_that_fits():
    s = 256
    P = tiny_parameters(s)
    full = hand_peak(P, 2, 64, 2, 8, s, ckpt=False, baseline=0)
    ckpt = hand_peak(P, 2, 64, 2, 8, s, ckpt=True, baseline=0)
    # one process, target 8: b = 8 (K = 1) only fits with checkpointing; smaller b fit without it
    plan = plan_by_memory(int((full + ckpt) / 2), 8, model_preset="tiny", block_size=s)
    by = {(r.micro_batch, r.checkpointing): r.fits for r in plan.rows}
    assert by[(8, False)] is False and by[(8, True)] is True
    assert plan.recommended.fits


def test_plan_none_fits_names_the_flag_and_the_smallest_need():
    s = 64
    P = tiny_parameters(s)
    smallest = hand_peak(P, 2, 64, 2, 1, s, ckpt=True, baseline=0)  # b = 1 with checkpointing, one process
    with pytest.raises(UsageError) as err:
        plan_by_memory(int(smallest) - 1, 4, model_preset="tiny", block_size=s)
    assert err.value.flag == "--memory_per_process"
    assert f"{smallest / 1e9:.3g} GB" in err.value.problem


def test_sizes():
    assert parse_size("--m", "8GB") == 8 * 10 ** 9
    assert parse_size("--m", "8GiB") == 8 * 2 ** 30
    assert parse_size("--m", "1.5g") == 1_500_000_000
    assert parse_size("--m", "512") == 512


@pytest.mark.parametrize("argv,flag", [
    (["--memory_per_process", "0", "--target_effective_batch", "8", "--model_preset", "tiny"], "--memory_per_process"),
    (["--memory_per_process", "8 gigs", "--target_effective_batch", "8", "--model_preset", "tiny"],
     "--memory_per_process"),
    (["--memory_per_process", "8GB", "--target_effective_batch", "9", "--num_processes", "2", "--model_preset",
      "tiny"], "--target_effective_batch"),
    (["--memory_per_process", "8GB", "--target_effective_batch", "8"], "--model_preset"),
    (["--per_device_train_batch_size", "1", "--target_effective_batch", "8"], "--target_effective_batch"),
    (["--memory_per_process", "1KB", "--target_effective_batch", "8", "--model_preset", "tiny"],
     "--memory_per_process"),
])
def test_plan_bad_input_exits_2_with_nothing_printed(capsys, argv, flag):
    assert cli.run("plan", argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"{flag}:" in err


def test_plan_command_prints_the_recommendation(capsys):
    assert cli.run("plan", ["--memory_per_process", "1GB", "--target_effective_batch", "8", "--model_preset", "tiny",
                            "--block_size", "64", "--num_processes", "2"]) == 0
    assert "recommended:" in capsys.readouterr().out
