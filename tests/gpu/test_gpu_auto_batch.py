"""``--auto_find_batch_size`` against a real CUDA out-of-memory: the largest micro-batch that fits, and exact losses.

From the ``auto_batch`` launch (tests/gpu/auto_batch_runs.py): the train job in fp32 (`mini` preset, blocks of
1024 tokens, 3 optimizer steps of 32 sequences), one process, first uncapped at 32 x 1, 16 x 2 and 8 x 4 side by
side, then started at 32 x 1 with ``--auto_find_batch_size`` under a cap of the CUDA caching allocator
(``torch.cuda.set_per_process_memory_fraction``, set at interpreter start by tests/gpu/memory_cap/sitecustomize.py
in the first process and in each re-execution). The cap lies between what 8 x 4 reserved uncapped and what
16 x 2 allocated uncapped (their geometric mean), both read from torch's allocator at each process's exit:

- 16 sequences cannot fit (the cap bounds the bytes the allocator reserves, which hold those allocated) and 8 do,
  so the run must fail at 32 and at 16, with torch's own out-of-memory error, and settle on 8 x 4 (the same
  effective batch) after two re-executions, each of them capped; its peak within the cap;
- the settled run trains on the same windows as the uncapped 32 x 1 run: every logged loss within 1e-6 relative
  (the same tokens summed in another order), the evaluation loss after training within 1e-5.

Under ``GPU_TESTS_DRY_RUN=1`` the same runs go on the CPU (the `tiny` preset, 64-token blocks, 4 -> 2 -> 1), the
allocator's cap stood in for by a count of activation bytes (the sitecustomize's stand-in): the logic only.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import gpu_common as common

pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() or common.DRY_RUN), reason=common.NO_CUDA),
              pytest.mark.skipif(importlib.util.find_spec("datasets") is None,
                                 reason="the train job needs datasets (docs/gpu_tests.md: carrying its "
                                        "wheel to a machine without a registry)"),
              pytest.mark.gpu_worker("auto_batch")]

CHAIN = common.AUTO_CHAIN
#: the evaluation after training: AdamW divides each coordinate's update by its own gradient scale, so the
#: summation order's rounding in near-zero gradients reaches the parameters (tests/test_auto_batch.py's bound)
EVAL_RTOL = 1e-5


def pair(b: int) -> dict:
    return {"per_device_train_batch_size": b, "gradient_accumulation_steps": CHAIN[0] // b}


def exits(run: dict) -> list:
    return [e for e in run["memory_log"] if e.get("event") == "exit"]


def check_uncapped(info: dict) -> None:
    for b, run in info["uncapped"].items():
        assert run["returncode"] == 0 and run["summary"] is not None, (b, run)
        assert run["summary"]["mixed_precision"] == "no", run["summary"]
        assert len(exits(run)) == 1 and exits(run)[0]["max_memory_allocated"] > 0, run["memory_log"]


def test_settles_on_the_largest_micro_batch_that_fits(gpu_workers):
    with common.recording("auto_find_batch_size_settles") as extra:
        info = gpu_workers["auto_batch"].task("auto_batch")
        extra.update({k: info.get(k) for k in ("cap_bytes", "fits_reserved", "too_big_allocated", "seconds")})
        assert "error" not in info, info
        check_uncapped(info)
        capped = info["capped"]
        starts = [e for e in capped["memory_log"] if e.get("event") == "start"]
        block = (capped["summary"] or {}).get("auto_find_batch_size") or {}
        figures = common.note({
            **extra, "peaks_uncapped": {b: exits(r)[0] for b, r in info["uncapped"].items()},
            "capped_peak": exits(capped), "settled": block.get("settled"), "attempts": block.get("attempts"),
            "seconds_lost": block.get("seconds_lost"), "capped_seconds": capped["seconds"],
            "starts": starts, "failure_lines": capped["failure_lines"]})
        assert capped["returncode"] == 0, (capped["stderr_tail"], figures)
        assert info["fits_reserved"] <= info["cap_bytes"] < info["too_big_allocated"], figures
        # every interpreter of the run (the first and each re-execution) was capped, at the cap chosen
        assert [e["attempt"] for e in starts] == [str(i) for i in range(len(CHAIN))], figures
        assert all(e["cap_bytes"] == info["cap_bytes"] for e in starts), figures
        if not common.DRY_RUN:
            assert all(e["device"] == "cuda" and 0 < e["fraction"] < 1 for e in starts), figures
        assert block["started_at"] == pair(CHAIN[0]) and block["settled"] == pair(CHAIN[-1]), figures
        assert [(a["per_device_train_batch_size"], a["gradient_accumulation_steps"]) for a in block["attempts"]] == \
            [(b, CHAIN[0] // b) for b in CHAIN[:-1]], figures
        assert all(a["bytes"] and a["bytes"] > 0 for a in block["attempts"]), figures  # torch said how much
        assert sum("CUDA out of memory" in x or "failed to allocate" in x for x in capped["failure_lines"]) >= 2, \
            figures
        assert exits(capped)[-1]["max_memory_reserved"] <= info["cap_bytes"], figures
        s = capped["summary"]
        assert (s["per_device_train_batch_size"], s["gradient_accumulation_steps"]) == tuple(pair(CHAIN[-1]).values())
        assert s["effective_batch_size_per_step"] == [CHAIN[0]] * common.AUTO_STEPS, s


def test_the_settled_run_has_the_uncapped_runs_losses(gpu_workers):
    with common.recording("auto_find_batch_size_losses"):
        info = gpu_workers["auto_batch"].task("auto_batch")
        assert "error" not in info and info.get("capped", {}).get("summary"), info
        got = info["capped"]["summary"]
        want = info["uncapped"][str(CHAIN[0])]["summary"]
        rel = [abs(a - b) / abs(b) for a, b in zip(got["train_loss"], want["train_loss"])]
        others = {b: max(abs(a - c) / abs(c) for a, c in zip(r["summary"]["train_loss"], want["train_loss"]))
                  for b, r in info["uncapped"].items()}
        figures = common.note({"losses_capped": got["train_loss"], "losses_uncapped": want["train_loss"],
                               "rel_diff_per_step": rel, "uncapped_chain_rel_diff": others,
                               "eval_loss_after": [got["eval_loss_after"], want["eval_loss_after"]],
                               "tolerance": common.AUTO_LOSS_RTOL})
        assert len(got["train_loss"]) == len(want["train_loss"]) == common.AUTO_STEPS, figures
        assert max(rel) <= common.AUTO_LOSS_RTOL, figures
        assert math.isclose(got["eval_loss_after"], want["eval_loss_after"], rel_tol=EVAL_RTOL), figures
