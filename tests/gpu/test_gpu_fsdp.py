"""FSDP2 on CUDA: what each accumulation policy holds (CUDA allocator vs accum_kit's prediction); bf16 updates.

From the ``fsdp`` launch (tests/gpu/gpu_worker.py; accelerate_configs/gpu_fsdp.yaml, one process: FSDP2
at world size 1, bf16 compute with fp32 gradient reduction, AdamW), one fresh model per policy, 2 windows
of K = 3. The measurement is torch's caching allocator (``torch.cuda.memory_allocated`` /
``max_memory_allocated``), relative to what was allocated before the model existed; the second window
is measured (the first one creates AdamW's state):

- at the window's start: the parameter shards and the optimizer state, against the prediction's
  ``parameter_shard_bytes + optimizer_state_bytes`` (P b_p / W + 8 P / W);
- after each non-boundary backward, what the window added: against the prediction's
  ``gradient_bytes + gathered_parameter_bytes`` (accum_kit's FSDP2 cost model ``policy_costs``, through
  ``predicted_memory``); and against accum_kit's own count of the tensors held (``HeldMemory``, which
  reads FSDP2's internals: a torch that renamed them would show here);
- the window's ``max_memory_allocated``: at least the prediction's ``total_bytes`` (activations come on top).

At world size 1 Accelerate never syncs inside a window (``use_distributed`` is False), so
``sync_each_batch`` holds what ``no_sync`` does, and its predicted P b_p / W equals P b_r: both are
checked as they are.

Activation checkpointing (``gradient_checkpointing``): the same launch trains a 4-block model in fp32 on
micro-batches of 4 x 256 tokens with and without it; the window's ``max_memory_allocated`` against accum_kit's
predicted peak (``predicted_peak``: parameters, gradients, AdamW state, FSDP2's buffers, a micro-batch's
activations and logits, docs/memory.md), and the memory checkpointing saves against the predicted saving.

The same launch then trains the default policy as gpu_fsdp.yaml sets FSDP2 up (bf16, parameters loaded
by rank 0 through Accelerate's ``cpu_ram_efficient_loading``, which the CPU config does not use) and
checks every update against the float64 big-batch gradient.
"""

from __future__ import annotations

import pytest
import torch

import gpu_common as common

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason=common.NO_CUDA),
              pytest.mark.gpu_worker("fsdp")]

REL, ABS = 0.02, 256 * 1024  # the batch, the loss scalars and 512-byte allocator blocks; P b = 7.4 MB here


def close(measured: float, predicted: float) -> bool:
    return abs(measured - predicted) <= REL * predicted + ABS


def check_policy(e: dict) -> dict:
    pred = e["predicted"]
    assert e["is_fsdp2"] and e["num_processes"] == 1 and e["mixed_precision"] == "bf16", e
    assert pred is not None, f"no prediction for {e['policy']}: {sorted(e['predicted_all'])}"
    resident = e["start_bytes"] - e["base_bytes"]
    held = max(e["held_bytes"])
    peaks = e["held_memory_peaks"]
    counted = max((v["gradient_bytes"] + v["gathered_parameter_bytes"] for v in peaks.values()), default=None)
    figures = common.note({
        "resident_measured": resident,
        "resident_predicted": pred["parameter_shard_bytes"] + pred["optimizer_state_bytes"],
        "held_measured": held, "held_per_backward": e["held_bytes"],
        "held_predicted": pred["gradient_bytes"] + pred["gathered_parameter_bytes"],
        "gradient_bytes_predicted": pred["gradient_bytes"], "gathered_predicted": pred["gathered_parameter_bytes"],
        "held_counted_by_accum_kit": counted, "window_peak_measured": e["peak_bytes"],
        "total_predicted": pred["total_bytes"], "max_memory_allocated": e["max_memory_allocated"],
        "policy_in_force": e["policy_in_force"], "parameters": e["parameters"], "s_per_step": e["s_per_step"]})
    assert len(e["held_bytes"]) == common.MEMORY_K - 1, figures
    assert close(resident, figures["resident_predicted"]), figures
    assert close(held, figures["held_predicted"]), figures
    assert counted is not None and close(held, counted), figures
    assert e["peak_bytes"] >= (1 - REL) * pred["total_bytes"], figures
    return figures


@pytest.mark.parametrize("policy", common.FSDP_POLICIES)
def test_fsdp2_memory_per_policy_matches_the_prediction(gpu_workers, policy):
    with common.recording(f"fsdp2_memory_{policy}"):
        check_policy(gpu_workers["fsdp"].task(f"fsdp_{policy}"))


def test_fsdp2_policies_differ_as_predicted(gpu_workers):
    """Keeping the parameters gathered costs P b_c more between micro-batches than resharding them."""
    w = gpu_workers["fsdp"]
    with common.recording("fsdp2_memory_policy_differences"):
        held = {p: max(w.task(f"fsdp_{p}")["held_bytes"]) for p in common.FSDP_POLICIES}
        pred = {p: w.task(f"fsdp_{p}")["predicted"]["gathered_parameter_bytes"] for p in common.FSDP_POLICIES}
        figures = common.note({"held": held, "gathered_predicted": pred})
        for kept in ("no_sync_no_reshard_after_backward", "no_sync_no_reshard"):
            assert pred[kept] > 0 and close(held[kept] - held["no_sync"], pred[kept]), figures


def test_fsdp2_bf16_update_equals_the_big_batch_within_bf16(gpu_workers):
    """FSDP2 as gpu_fsdp.yaml sets it up (bf16 compute with fp32 reduction, parameters loaded by rank 0
    through Accelerate's cpu_ram_efficient_loading, which CI's CPU config does not use): every update of the
    default policy within bf16's tolerance of the float64 big-batch gradient; the tied embedding stays tied."""
    w = gpu_workers["fsdp"]
    with common.recording("fsdp2_bf16_update"):
        e = w.task("fsdp_bf16")
        saved = torch.load(w.out / e["params"], weights_only=True)
        errors = common.update_errors(saved, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR)
        figures = common.note({"rel_error_per_step": errors, "tolerance": common.BF16_RTOL, "tied": e["tied"],
                               "s_per_step": e["s_per_step_after_first"]})
        assert e["is_fsdp2"] and e["mixed_precision"] == "bf16" and "cuda" in e["device"], e
        assert e["tied"] is True, figures
        assert all(common.LOW_PRECISION_FLOOR < x <= common.BF16_RTOL for x in errors), figures


def test_fsdp2_checkpointing_peak_and_saving_match_the_prediction(gpu_workers):
    """``max_memory_allocated`` over a window (since before the model existed) within CKPT_REL of the predicted
    peak, with and without checkpointing, and the measured saving within CKPT_REL of the predicted one."""
    w = gpu_workers["fsdp"]
    with common.recording("fsdp2_checkpointing_memory"):
        off, on = w.task("fsdp_checkpointing_off"), w.task("fsdp_checkpointing_on")
        assert off["predicted_parts"] is not None and on["predicted_parts"] is not None, (off, on)
        measured = {"off": off["peak_bytes"], "on": on["peak_bytes"]}
        predicted = {"off": off["predicted_parts"]["total"], "on": on["predicted_parts"]["total"]}
        saved = measured["off"] - measured["on"], predicted["off"] - predicted["on"]
        figures = common.note({
            "peak_measured": measured, "peak_predicted": predicted,
            "measured_over_predicted": {k: measured[k] / predicted[k] for k in measured},
            "saving_measured": saved[0], "saving_predicted": saved[1], "saving_ratio": saved[0] / saved[1],
            "parts_off": off["predicted_parts"], "parts_on": on["predicted_parts"], "parameters": on["parameters"],
            "s_per_step": {"off": off["s_per_step"], "on": on["s_per_step"]}, "tolerance": common.CKPT_REL})
        assert on["in_force"] and not off["in_force"], figures
        assert on["is_fsdp2"] and on["mixed_precision"] == "no", figures
        for k in ("off", "on"):
            assert abs(measured[k] / predicted[k] - 1) <= common.CKPT_REL, figures
        assert saved[1] > 0 and abs(saved[0] / saved[1] - 1) <= common.CKPT_REL, figures
