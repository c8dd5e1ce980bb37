"""bf16 and fp16 on CUDA: each update against the float64 big-batch oracle; verify in bf16; the GradScaler.

One launch (``ddp`` in tests/gpu/gpu_worker.py: accelerate_configs/gpu_ddp.yaml, one process, NCCL)
runs ``accum_kit.train_loop`` through ``accum_kit.build_accelerator(mixed_precision=...)`` and saves
the parameters after every step. The oracle is plain PyTorch here (tests/gpu/gpu_common.py): the
exact token-mean gradient of each window in float64 on the CPU, at the run's own parameters before
the step (so that a bf16 trajectory's drift does not count as error); the update the run applied is
``(before - after) / lr`` (plain SGD). Tolerance, normwise per update: sqrt(m) u with m = 64
(accum_kit/verify/compare.py), bf16 3.1e-2, fp16 3.9e-3.

fp16: Accelerate builds its GradScaler only on CUDA (initial scale 2^16). With the loss divisor c
(docs/design.md) no step may be skipped after the first two; with c forced to 1 (the summed losses
of the arithmetic before c) the same data must make the scaler skip, else the first check proves nothing.
"""

from __future__ import annotations

import json

import pytest
import torch

import gpu_common as common

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason=common.NO_CUDA), pytest.mark.gpu_worker("ddp")]

FP16_SKIPS_ALLOWED_AT_START = 2  # steps the scaler may skip while it settles; none after them


def check_bf16(tokens: dict, tokens_params: dict, mean_params: dict) -> dict:
    assert "cuda" in tokens["device"] and tokens["mixed_precision"] == "bf16" and tokens["native_amp"], tokens
    errors = common.update_errors(tokens_params, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR)
    mean_errors = common.update_errors(mean_params, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR)
    # the oracle can fail: the per-micro-batch means of the "mean" run miss it (they match the wrong formula)
    mom = common.update_errors(mean_params, common.MODEL, common.EXAMPLES, common.K, common.B, common.LR,
                               oracle=common.mean_of_means_gradient)
    figures = common.note({"tokens_rel_error_per_step": errors, "mean_rel_error_per_step": mean_errors,
                           "mean_vs_mean_of_means_formula": mom, "tolerance": common.BF16_RTOL,
                           "s_per_step": tokens["s_per_step_after_first"], "steps": tokens["optimizer_steps"]})
    assert all(common.LOW_PRECISION_FLOOR < e <= common.BF16_RTOL for e in errors), figures
    assert max(mean_errors) > common.BF16_RTOL, figures
    assert max(mom) <= common.BF16_RTOL, figures
    return figures


def check_verify_report(rep: dict) -> dict:
    """verify's own report, and its oracle's gradient norm recomputed here in float64 (plain PyTorch)."""
    import accum_kit.job.models as models
    import torch.nn.functional as F

    rows = rep["rows"]
    tok, mom = rows["tokens"], rows["mean-of-means"]
    m = rep["model"]
    model = models.build_model("tiny", m["vocab_size"], m["n_positions"], seed=m["init_seed"]).double().eval()
    norms = []
    for w, tw in zip(rep["windows"], tok["windows"]):
        seqs = w["input_ids"]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        labels = ids.masked_fill(mask == 0, common.IGNORE)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                        ignore_index=common.IGNORE).backward()
        norm = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None) ** 0.5
        norms.append({"oracle_here": norm, "verify_oracle": w["oracle_grad_norm"], "tokens_row": tw["grad_norm"]})
    figures = common.note({"passed": rep["passed"], "device": rep.get("device"), "rtol": rep["rtol"],
                           "tokens_rel_error": [w["rel_error"] for w in tok["windows"]],
                           "mean_of_means_rel_error": [w["rel_error"] for w in mom["windows"]], "norms": norms,
                           "seconds": rep.get("seconds")})
    assert rep["mixed_precision"] == "bf16" and rep["normwise"] is True and rep["autocast"] is True, figures
    assert rep["rtol"] == pytest.approx(common.BF16_RTOL), figures
    assert rep["passed"] is True and tok["passed"] is True and mom["passed"] is False, figures
    assert all(common.LOW_PRECISION_FLOOR < e <= common.BF16_RTOL for e in figures["tokens_rel_error"]), figures
    assert all(e > common.BF16_RTOL for e in figures["mean_of_means_rel_error"]), figures
    for n in norms:  # verify's fp64 oracle (on the GPU) is the exact gradient; its tokens row is within bf16's
        assert n["verify_oracle"] == pytest.approx(n["oracle_here"], rel=1e-8), figures
        assert n["tokens_row"] == pytest.approx(n["oracle_here"], rel=common.BF16_RTOL), figures
    return figures


def check_fp16(fp16: dict, params: dict, control: dict) -> dict:
    assert "cuda" in fp16["device"] and fp16["mixed_precision"] == "fp16" and fp16["native_amp"], fp16
    assert fp16["scaler"] is not None, "Accelerate built no GradScaler on CUDA"
    skipped = fp16["skipped"]
    errors = common.update_errors(params, common.FP16_MODEL, common.FP16_EXAMPLES, common.FP16_K, common.FP16_B,
                                  common.FP16_LR, skipped=skipped)
    figures = common.note({"rel_error_per_step": errors, "tolerance": common.FP16_RTOL, "skipped": skipped,
                           "scales": fp16["scales"], "init_scale": fp16["init_scale"],
                           "without_divisor_skipped": control["skipped"], "without_divisor_scales": control["scales"],
                           "s_per_step": fp16["s_per_step_after_first"]})
    steps = len(common.windows(common.FP16_EXAMPLES, common.FP16_K, common.FP16_B))
    assert len(skipped) == fp16["optimizer_steps"] == steps, figures
    assert not any(skipped[FP16_SKIPS_ALLOWED_AT_START:]), figures
    assert sum(control["skipped"]) >= 1, ("the summed-loss arithmetic did not overflow, so the divisor's "
                                          "no-skip result proves nothing", figures)
    measured = [e for e in errors if e is not None]
    assert measured and all(common.LOW_PRECISION_FLOOR < e <= common.FP16_RTOL for e in measured), figures
    return figures


def test_bf16_update_equals_the_fp64_big_batch_within_bf16_tolerance(gpu_workers):
    w = gpu_workers["ddp"]
    with common.recording("bf16_train_loop"):
        tokens, mean = w.task("bf16_tokens"), w.task("bf16_mean")
        check_bf16(tokens, torch.load(w.out / tokens["params"], weights_only=True),
                   torch.load(w.out / mean["params"], weights_only=True))


def test_verify_bf16_on_cuda_passes_and_its_oracle_is_the_exact_gradient(gpu_workers):
    w = gpu_workers["ddp"]
    with common.recording("verify_bf16"):
        entry = w.task("verify_bf16")
        check_verify_report(json.loads((w.out / entry["report"]).read_text()))


def test_fp16_gradscaler_skips_nothing_and_each_update_is_exact_within_fp16(gpu_workers):
    w = gpu_workers["ddp"]
    with common.recording("fp16_gradscaler"):
        fp16, control = w.task("fp16"), w.task("fp16_without_divisor")
        check_fp16(fp16, torch.load(w.out / fp16["params"], weights_only=True), control)
