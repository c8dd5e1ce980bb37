"""torch.compile with inductor on CUDA: exact against its measured floor, and no recompile after warm-up.

From the ``compile`` launch (tests/gpu/gpu_worker.py; gpu_ddp.yaml, one process, so Accelerate compiles
``torch.compile(DDP(model))``), fp32, a 1-layer GPT-2, every micro-batch padded to one shape
(``dynamic=False``: one static compile, as tests/test_compile.py), K = 3 over 20 examples (windows of 3,
3, 3 and a partial 1):

- the compiled run (``build_accelerator(torch_compile=True, torch_compile_backend="inductor")``), the
  same run eager, and the floor: one SGD step on one micro-batch from the initial parameters, through the
  run's compiled model (its code reused: nothing compiled again) against a fresh eager copy, plain torch,
  largest parameter difference. Expected parameters after every step: the plain
  float64 big-batch SGD trajectory (tests/gpu/gpu_common.py). The eager run must be within the fp32
  tolerance of tests/test_exactness.py (ATOL + RTOL |p|), the compiled one with ATOL raised by 10 x floor
  (tests/test_compile.py's rule).
- recompiles from torch's own dynamo counters: no frame converted and no graph made after the first
  optimizer step; accum_kit's CompileWatch must agree (0 recompiles after warm-up).
"""

from __future__ import annotations

import pytest
import torch

import gpu_common as common

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason=common.NO_CUDA),
              pytest.mark.gpu_worker("compile")]


def trajectory_errors(saved: dict, atol: float) -> dict:
    """Per step: the largest |parameter - oracle|, and max |d| / (atol + RTOL |oracle|) (<= 1 passes)."""
    wins = common.windows(common.EXAMPLES, common.K, common.B)
    want = common.sgd_trajectory(common.COMPILE_MODEL, saved["init"], wins, common.LR)
    assert len(saved["after"]) == len(want), (len(saved["after"]), len(want))
    worst = [common.max_excess(got, exp, atol, common.RTOL) for got, exp in zip(saved["after"], want)]
    return {"max_abs_error_per_step": [w[0] for w in worst], "tolerance_used_per_step": [w[1] for w in worst]}


def check_exact(compiled: dict, compiled_params: dict, eager_params: dict, floor: dict) -> dict:
    assert compiled["compile_settings"]["backend"] == "inductor", compiled["compile_settings"]
    assert "cuda" in compiled["device"], compiled
    allowed = common.ATOL + common.FLOOR_FACTOR * floor["floor"]
    c, e = trajectory_errors(compiled_params, allowed), trajectory_errors(eager_params, common.ATOL)
    figures = common.note({"compiled": c, "eager": e, "floor": floor["floor"], "compiled_atol": allowed,
                           "rtol": common.RTOL, "compiled_s_per_step": compiled["s_per_step_after_first"],
                           "first_step_seconds": compiled["step_seconds"][0]})
    assert max(e["tolerance_used_per_step"]) <= 1.0, figures  # the eager CUDA run: fp32-exact
    assert max(c["tolerance_used_per_step"]) <= 1.0, figures  # within ATOL + 10 floors (+ RTOL |p|)
    return figures


def check_recompiles(compiled: dict) -> dict:
    warm, end, before = compiled["dynamo_after_warmup"], compiled["dynamo_end"], compiled["dynamo_before"]
    watch = compiled["compile_watch"]
    figures = common.note({
        "compile_seconds": watch["compile_seconds"], "compiles": watch["compiles"], "graphs": watch["graphs"],
        "recompiles": watch["recompiles"], "recompiles_after_warmup": watch["recompiles_after_warmup"],
        "recompile_reasons": watch["recompile_reasons"], "dynamo_frames_at_warmup_end": warm["frames"],
        "dynamo_frames_at_end": end["frames"], "unique_graphs": end["stats"].get("unique_graphs"),
        "optimizer_steps": compiled["optimizer_steps"]})
    graphs = end["stats"].get("unique_graphs", 0)
    assert graphs > before["stats"].get("unique_graphs", 0), ("nothing was compiled", figures)
    assert compiled["optimizer_steps"] == len(common.windows(common.EXAMPLES, common.K, common.B)) > 1, figures
    assert end["frames"].get("total", 0) == warm["frames"].get("total", 0), figures  # no frame converted after step 1
    assert end["stats"].get("unique_graphs", 0) == warm["stats"].get("unique_graphs", 0), figures
    assert watch["recompiles_after_warmup"] == 0 and watch["compiles"] >= 1, figures
    return figures


def test_inductor_compiled_update_is_exact_within_its_floor(gpu_workers):
    w = gpu_workers["compile"]
    with common.recording("inductor_exactness") as extra:
        compiled, eager = w.task("compiled"), w.task("eager")
        floor = compiled["floor"]
        assert "error" not in floor, floor["error"]
        extra["floor_frames_converted"] = floor.get("floor_frames_converted")
        check_exact(compiled, torch.load(w.out / compiled["params"], weights_only=True),
                    torch.load(w.out / eager["params"], weights_only=True), floor)


def test_inductor_no_recompile_after_warmup(gpu_workers):
    with common.recording("inductor_recompiles"):
        check_recompiles(gpu_workers["compile"].task("compiled"))
