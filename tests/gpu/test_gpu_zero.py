"""DeepSpeed ZeRO-2 over NCCL (world size 1): every update against the float64 big-batch oracle.

From the ``zero`` launch (tests/gpu/gpu_worker.py; accelerate_configs/gpu_deepspeed.yaml, one process),
``accum_kit.train_loop`` through ``build_accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))``
with plain SGD on the examples of tests/gpu/gpu_common.py (K = 3: windows of 3, 3, 3 and a partial 1,
which the engine still divides by its K), twice:

- fp32: the fp32 master weights after every step (``deepspeed.utils.safe_get_full_fp32_param``) against the
  plain float64 SGD trajectory, within tests/test_exactness.py's fp32 tolerance;
- bf16 (the config's precision): each update, from the master weights before and after it, against the
  exact gradient at the master weights before it, normwise within sqrt(64) x 2^-8.

And the gradient bytes held between micro-batches (accum_kit's ``HeldMemory``, which counts the ZeRO optimizer's
partitions): at world size 1 the partition is every parameter's reduced gradient, in the module's dtype
(DeepSpeed casts the module to bf16 under bf16): P x 4 bytes in fp32, P x 2 in bf16, P counted on the plain
model; accum_kit's prediction must say the same (it said P x 4 under bf16 before it read the module's dtype).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import gpu_common as common

# deepspeed is looked up, not imported: the worker imports it (a broken install then fails with its traceback)
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason=common.NO_CUDA),
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason='needs deepspeed (pip install -e ".[deepspeed]")'),
              pytest.mark.gpu_worker("zero")]


def check_engine(e: dict, precision: str) -> None:
    assert e["model_class"] == "DeepSpeedEngine" and e["zero_stage"] == 2, e
    assert "DEEPSPEED" in e["distributed_type"] and "cuda" in e["device"], e
    assert e["engine_gradient_accumulation_steps"] == common.K, e
    assert e["module_dtype"] == ("torch.bfloat16" if precision == "bf16" else "torch.float32"), e
    assert e["optimizer_steps"] == len(common.windows(common.EXAMPLES, common.K, common.B)), e
    assert e["master_weights_from"] == ["safe_get_full_fp32_param"], e  # the fp32 masters, not bf16 copies


def check_fp32(e: dict, saved: dict) -> dict:
    check_engine(e, "fp32")
    wins = common.windows(common.EXAMPLES, common.K, common.B)
    want = common.sgd_trajectory(common.MODEL, saved["init"], wins, common.LR)
    worst = [common.max_excess(got, exp, common.ATOL, common.RTOL) for got, exp in zip(saved["after"], want)]
    rel = common.update_errors(saved, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR)
    figures = common.note({"max_abs_error_per_step": [w[0] for w in worst],
                           "tolerance_used_per_step": [w[1] for w in worst], "update_rel_error_per_step": rel,
                           "s_per_step": e["s_per_step_after_first"]})
    assert len(saved["after"]) == len(want) and max(w[1] for w in worst) <= 1.0, figures
    return figures


def check_bf16(e: dict, saved: dict) -> dict:
    check_engine(e, "bf16")
    errors = common.update_errors(saved, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR)
    figures = common.note({"rel_error_per_step": errors, "tolerance": common.BF16_RTOL,
                           "s_per_step": e["s_per_step_after_first"]})
    assert all(common.LOW_PRECISION_FLOOR < x <= common.BF16_RTOL for x in errors), figures
    return figures


def check_held(e: dict, element_bytes: int) -> dict:
    want = e["unique_parameters"] * element_bytes
    figures = common.note({"held_gradient_bytes": e["held_gradient_bytes"], "by_kind": e["held_by_kind"],
                           "predicted": (e["predicted"] or {}).get("gradient_bytes"), "P_times_element_bytes": want})
    assert e["held_gradient_bytes"] == want, figures
    assert figures["predicted"] == want, figures
    return figures


@pytest.mark.parametrize("precision,element_bytes", [("fp32", 4), ("bf16", 2)])
def test_zero2_held_gradient_bytes_are_the_prediction(gpu_workers, precision, element_bytes):
    with common.recording(f"zero2_held_{precision}"):
        check_held(gpu_workers["zero"].task(f"zero2_{precision}"), element_bytes)


def test_zero2_fp32_update_equals_the_big_batch(gpu_workers):
    w = gpu_workers["zero"]
    with common.recording("zero2_fp32"):
        e = w.task("zero2_fp32")
        check_fp32(e, torch.load(w.out / e["params"], weights_only=True))


def test_zero2_bf16_update_equals_the_big_batch_within_bf16(gpu_workers):
    w = gpu_workers["zero"]
    with common.recording("zero2_bf16"):
        e = w.task("zero2_bf16")
        check_bf16(e, torch.load(w.out / e["params"], weights_only=True))
