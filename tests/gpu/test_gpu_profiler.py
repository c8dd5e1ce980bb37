"""The communication profiler on CUDA: its phase times cover the GPU's work, its CUDA-event timings are right.

From the ``ddp`` launch (tests/gpu/gpu_worker.py; gpu_ddp.yaml, one process, NCCL: the model is DDP at
world size 1, so every micro-batch all-reduces):

- a train_loop with ``CommProfiler`` (fp32, 8 steps) whose loss has a GPU spin of known length
  (``torch.cuda._sleep``, timed with CUDA events of our own) in its backward: the profiler synchronises on
  CUDA, so each micro-batch's backward must last at least the spin; the phases of a step fit in its wall
  time, the steps in the loop's, and each micro-batch's forward + backward matches the span of CUDA
  events we record at the same hooks; DDP's buckets carry the model's gradient bytes every micro-batch.
- the FSDP2 collective recorder's CUDA path (CUDA events on the collective's stream, read later): one
  GPU makes FSDP2 call no collective, so its wrappers are called directly around the same spin, on a side
  stream as FSDP2 does. Each recorded duration must match the span of CUDA events of our own around the
  same call (and contain the spin), and the profiler's summary must count the calls without anyone
  reading the records first.
- the DDP bucket recorder behind a spin (informational, xfail): NCCL's future completes when the
  all-reduce is queued, so the recorded seconds may be the queuing time only.
"""

from __future__ import annotations

import statistics

import pytest
import torch

import gpu_common as common

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason=common.NO_CUDA),
              pytest.mark.gpu_worker("ddp")]

SLACK_S = 3e-3  # per micro-batch: host work between a hook's synchronise and our own event, GPU time slices


def check_phases(p: dict) -> dict:
    micro, steps, buckets, spans = p["micro"], p["steps"], p["buckets"], p["event_spans"]
    sleep = p["sleep_seconds"]
    n_steps = 2 * len(common.windows(common.EXAMPLES, common.K, common.B))
    figures = common.note({
        "sleep_seconds": sleep, "s_per_step": p["s_per_step_after_first"], "loop_wall": p["loop_wall_seconds"],
        "sum_step_seconds": sum(s["step_seconds"] for s in steps),
        "backward_median": statistics.median(m["backward"] for m in micro),
        "forward_median": statistics.median(m["forward"] for m in micro),
        "allreduce_seconds_median": statistics.median(c["seconds"] for c in buckets) if buckets else None,
        "buckets_per_micro_batch": len(buckets) / max(len(micro), 1)})
    assert p["synchronize"] is True, p
    # one GPU: Accelerate 1.15 wraps no DDP around the model (measured on an H200: a plain GPT2LMHeadModel, 0
    # buckets); with several, DDP and its buckets
    assert p["is_ddp"] is (p["num_processes"] > 1), p
    n_micro = 2 * len(common.EXAMPLES) // common.B
    assert len(steps) == n_steps and len(micro) == p["micro_batches"] == len(spans) == n_micro, figures
    for m, span in zip(micro, spans):
        assert m["forward"] > 0 and m["backward"] >= 0.7 * sleep, (m, figures)  # 0.7: the SM clock may rise
        both = m["forward"] + m["backward"]
        assert abs(both - span["seconds"]) <= 0.1 * span["seconds"] + SLACK_S, (m, span, figures)
    for s in steps:
        inside = sum(m["forward"] + m["backward"] for m in micro if m["step"] == s["step"])
        assert s["optimizer"] > 0 and inside + s["optimizer"] <= s["step_seconds"] + 1e-4, (s, inside, figures)
    assert figures["sum_step_seconds"] <= p["loop_wall_seconds"] + 1e-3, figures
    if not p["is_ddp"]:  # nothing is all-reduced, and the profiler recorded nothing
        assert not buckets, figures
        return figures
    # DDP all-reduces the whole gradient on every synchronising micro-batch, in buckets whose sizes add up to the
    # model's gradient bytes
    per_sync = {}
    for c in buckets:
        per_sync.setdefault(c["sync"], []).append(c)
    assert len(per_sync) == len(micro), figures
    assert all(sum(c["bytes"] for c in group) == p["grad_bytes"] for group in per_sync.values()), (
        p["grad_bytes"], figures)
    assert all(c["seconds"] > 0 for c in buckets), figures
    assert sum(c["seconds"] for c in buckets) <= figures["sum_step_seconds"], figures
    return figures


def check_collective_events(e: dict) -> dict:
    """Each recorded duration against our own CUDA events around the same call on the same stream (the GPU
    is shared with the other launches, so only a span measured around the same work is comparable)."""
    sleep, outer = e["sleep_seconds"], e["outer_event_seconds"]
    figures = common.note({"sleep_seconds": sleep, "outer_event_seconds": outer,
                           "recorded": [r["seconds"] for r in e["records"]], "seen_by_summary": e["seen_by_summary"]})
    assert [r["kind"] for r in e["records"]] == ["all_gather", "reduce_scatter"] * e["calls"], figures
    for r, span in zip(e["records"], outer):
        assert r["seconds"] >= 0.5 * sleep, (r, figures)  # the spin ran inside the timed interval
        assert abs(r["seconds"] - span) <= 0.05 * span + 2e-4, (r, span, figures)
        assert r["bytes"] == 1024 * 4, r
    assert e["seen_by_summary"] == {"all_gather": e["calls"], "reduce_scatter": e["calls"]}, (
        "the profiler's summary missed collectives timed with CUDA events (recorded, never folded into the "
        "aggregates the summary reads)", figures)
    return figures


def test_profiler_phase_times_cover_the_gpu_work_and_fit_in_the_step(gpu_workers):
    with common.recording("profiler_phases"):
        check_phases(gpu_workers["ddp"].task("profiler"))


def test_collective_recorder_cuda_events_time_the_collective_and_reach_the_summary(gpu_workers):
    with common.recording("profiler_collective_events"):
        check_collective_events(gpu_workers["ddp"].task("collective_events"))


@pytest.mark.xfail(reason="BucketRecorder times DDP's comm-hook future, which NCCL completes when the all-reduce is "
                          "queued, not when it ends (accum_kit/profiler/buckets.py); informational, and with one GPU "
                          "there is no DDP (0 buckets): it needs 2 GPUs", strict=False)
def test_ddp_bucket_seconds_cover_gpu_work_queued_before_the_allreduce(gpu_workers):
    with common.recording("profiler_allreduce_behind_spin"):
        d = gpu_workers["ddp"].task("delayed_allreduce")
        figures = common.note({"sleep_seconds": d["sleep_seconds"], "buckets": d["buckets"],
                               "bucket_seconds_median": statistics.median(d["bucket_seconds"]) if d["bucket_seconds"]
                               else None})
        assert d["buckets"] > 0 and figures["bucket_seconds_median"] >= 0.5 * d["sleep_seconds"], figures
