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

Both runs must have run in fp32: cuBLAS's TF32 switch off at every step (``tf32_matmul_per_step``). Accelerate
turns it on, process-wide and for good, when it builds a compiled fp32 run's state on CUDA
(``AcceleratorState.__init__``: a dynamo backend, mixed precision "no", a CUDA device); before the worker undid
it, both runs were 3.9e-5 to 5.4e-5 from the oracle on an H200 (20 to 36 times the tolerance), the eager one too,
because it ran after the compiled one in the same process. On CPU the same runs (padded, through Accelerate and
accum_kit, inductor included) are within 1.2e-7 of the oracle, 0.025 of the tolerance, and so are plain fp32
runs unpadded, one example at a time or in padded micro-batches (padding moves fp32 results by 2.6e-8 at most);
rounding every matmul's inputs to TF32 on CPU reproduces the GPU's figures (2.9e-5 to 4.1e-5, 23 to 33 times).

The tolerance rejects wrong arithmetic (:func:`test_the_tolerance_rejects_a_wrong_update`, computed here): the
mean-of-means trajectory misses it by more than 10^4 times, updates 1e-3 too large by about 50 times.
"""

from __future__ import annotations

import pytest
import torch

import gpu_common as common

SENSITIVITY = 10  # a wrong update must miss the tolerance by at least this factor

pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() or common.DRY_RUN), reason=common.NO_CUDA),
              pytest.mark.gpu_worker("compile")]


def trajectory_errors(saved: dict, atol: float) -> dict:
    """Per step: the largest |parameter - oracle|, and max |d| / (atol + RTOL |oracle|) (<= 1 passes)."""
    wins = common.windows(common.EXAMPLES, common.K, common.B)
    want = common.sgd_trajectory(common.COMPILE_MODEL, saved["init"], wins, common.LR)
    assert len(saved["after"]) == len(want), (len(saved["after"]), len(want))
    worst = [common.max_excess(got, exp, atol, common.RTOL) for got, exp in zip(saved["after"], want)]
    return {"max_abs_error_per_step": [w[0] for w in worst], "tolerance_used_per_step": [w[1] for w in worst]}


def check_exact(compiled: dict, eager: dict, compiled_params: dict, eager_params: dict, floor: dict) -> dict:
    assert compiled["compile_settings"]["backend"] == "inductor", compiled["compile_settings"]
    assert common.DEVICE in compiled["device"], compiled
    allowed = common.ATOL + common.FLOOR_FACTOR * floor["floor"]
    c, e = trajectory_errors(compiled_params, allowed), trajectory_errors(eager_params, common.ATOL)
    figures = common.note({"compiled": c, "eager": e, "floor": floor["floor"], "compiled_atol": allowed,
                           "rtol": common.RTOL, "compiled_s_per_step": compiled["s_per_step_after_first"],
                           "first_step_seconds": compiled["step_seconds"][0],
                           "tf32_switched_on_by_accelerate": compiled.get("tf32_switched_on_by_accelerate"),
                           "tf32_per_step": {"compiled": compiled["tf32_matmul_per_step"],
                                             "eager": eager["tf32_matmul_per_step"]}})
    for run in ("compiled", "eager"):  # the fp32 tolerance means nothing for a run whose matmuls were TF32
        assert not any(figures["tf32_per_step"][run]), (f"the {run} run had TF32 on", figures)
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
        check_exact(compiled, eager, torch.load(w.out / compiled["params"], weights_only=True),
                    torch.load(w.out / eager["params"], weights_only=True), floor)


def test_inductor_no_recompile_after_warmup(gpu_workers):
    with common.recording("inductor_recompiles"):
        check_recompiles(gpu_workers["compile"].task("compiled"))


def test_the_tolerance_rejects_a_wrong_update():
    """Negative controls of the trajectory check, from the runs' initial parameters (seeded as the worker's): the
    float64 trajectory of the mean-of-means normalisation, and of updates (1 + 1e-3) times the exact one (a TF32
    run's are about 4e-4 off), each fail the check the runs pass by more than SENSITIVITY times."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(common.SEED)
    init = {n: p.detach().double() for n, p in GPT2LMHeadModel(GPT2Config(**common.COMPILE_MODEL)).named_parameters()}
    wins = common.windows(common.EXAMPLES, common.K, common.B)
    with common.recording("inductor_exactness_sensitivity"):
        wrong = {"mean_of_means": common.sgd_trajectory(common.COMPILE_MODEL, init, wins, common.LR,
                                                        gradient=lambda m, w: common.mean_of_means_gradient(
                                                            m, w, common.K, common.B)),
                 "lr_times_1.001": common.sgd_trajectory(common.COMPILE_MODEL, init, wins, common.LR * (1 + 1e-3))}
        used = {k: trajectory_errors({"init": init, "after": v}, common.ATOL)["tolerance_used_per_step"]
                for k, v in wrong.items()}
        figures = common.note({"tolerance_used_per_step": used, "sensitivity": SENSITIVITY})
        for k, u in used.items():
            assert max(u) > SENSITIVITY, (k, figures)
