"""Host reads on CUDA: accum_kit makes no synchronising CUDA call inside a window, or at its end.

The ``ddp`` launch (tests/gpu/gpu_worker.py, ``sync_debug``) runs ``accum_kit.train_loop`` (K=3, fp32, tokens)
under ``torch.cuda.set_sync_debug_mode("warn")``: torch itself flags every call that waits for the device
(``item``, a blocking device-to-host copy, ``cudaStreamSynchronize``), and the worker credits each one to the
innermost Python frame outside torch. The CPU tests count the same reads by wrapping the tensor methods
(tests/host_reads.py); this is torch's own count, which also sees syncs made inside C++ operators. The model's
(transformers' attention-mask check), the batches' host-to-device copies (Accelerate's dataloader) and the
test's own callback (parameters copied to the host after each step) are recorded, not asserted.
"""

from __future__ import annotations

import pytest
import torch

import gpu_common as common

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason=common.NO_CUDA), pytest.mark.gpu_worker("ddp")]


def test_accum_kit_makes_no_synchronising_cuda_call_in_a_window(gpu_workers):
    w = gpu_workers["ddp"]
    with common.recording("sync_debug"):
        entry = w.task("sync_debug")
        micro = entry["micro"]
        mine = [{o: n for o, n in m["syncs"].items() if "accum_kit/" in o} for m in micro]
        others = {}
        for m in micro:
            for o, n in m["syncs"].items():
                others[o] = others.get(o, 0) + n
        figures = common.note({"micro_batches": len(micro), "windows": sum(m["boundary"] for m in micro),
                               "accum_kit_syncs": mine, "all_syncs_by_owner": others, "outside": entry["outside"]})
        assert len(micro) == entry["micro_batches"] and sum(m["boundary"] for m in micro) == entry["optimizer_steps"]
        assert others, ("no synchronising call seen at all: the debug mode did not report (the test's own "
                        "parameter copies after each step synchronise)", figures)
        assert not any(mine), figures
