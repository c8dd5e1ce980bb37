"""The communication profiler (accum_kit.profiler) against independent oracles.

One 2-process gloo run (tests/profiler_worker.py through ``accelerate launch``
with accelerate_configs/cpu_ddp.yaml: a script run of conftest.py's shared ``ddp_pool``) runs every scenario and, last, the train
job with ``--trace_dir`` and ``--profile_ab_steps``; the single-process case
runs in this process while that launch is busy. Expected values come from:

- DDP itself: ``model._get_ddp_logging_data()`` (its bucket layout, before and
  after the rebuild DDP does after the first synchronised backward);
- the model: gradient bytes = sum of ``numel x element_size`` over the
  parameters that require grad, computed by the worker from the model;
- arithmetic on the loop's schedule: boundaries are every K-th micro-batch and
  the last one, and the A/B schedule of :class:`ABSwitch` (one warm-up window,
  then home / other alternating);
- a plain ``no_sync`` run on the same data (the A/B switch and the fp16
  compression hook must not change, resp. only slightly change, the update);
- the definitions of nccl-tests for algbw / busbw.

Cost: one run on the shared pool (no launch of its own; the train job is inside it).
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

import job_helpers as jh

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "profiler_worker.py"

WORLD = 2
SEED, LR, PAD_ID, B = 0, 0.5, 0, 2
N_EXAMPLES = 48  # 12 micro-batches per process at B=2, W=2
PER_PROCESS = N_EXAMPLES // (B * WORLD)
BUCKET_CAP_MB = 0.01  # ~10 KB buckets: several gradient buckets for the 32 KB model below
AB_STEPS = 2  # A/B windows each way (ABSwitch warm-up: 1 window)
MODEL_CONFIG = dict(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)

SUMMARY_KEYS = ("allreduce_calls", "allreduce_bytes", "allreduce_seconds", "algbw_GBps", "busbw_GBps",
                "skipped_syncs", "exposed_comm_seconds", "estimated_seconds_saved")
AB_KEYS = ("seconds_per_step_sync_each_batch", "seconds_per_step_no_sync", "measured_seconds_saved_per_step", "speedup")

# Train job bundled into the launch (run last by the worker).
# Windows: 1 warm-up, 2 x JOB_AB A/B, 2 x JOB_OVERHEAD profiler on/off, then the trace warms up 1 and records 2.
JOB_K, JOB_AB, JOB_OVERHEAD = 2, 2, 1
JOB_STEPS = 1 + 2 * JOB_AB + 2 * JOB_OVERHEAD + 3


def _sc(name, K, **kw):
    return {"name": name, "kind": "train", "K": K, "B": B, "sync_each_batch": False, "hook": None,
            "ab_steps": 0, "warmup_sync": False, **kw}


SCENARIOS = [
    _sc("nosync_k5", 5),  # 12 micro-batches: windows of 5, 5, 2 (a partial last window)
    _sc("nosync_k2", 2, warmup_sync=True),
    _sc("each_k2", 2, sync_each_batch=True, warmup_sync=True),
    _sc("fp16_k2", 2, hook="fp16", warmup_sync=True),
    _sc("ab_k2", 2, ab_steps=AB_STEPS),
    {"name": "double_hook", "kind": "double_hook", "K": 2, "B": B},
]
SCENARIOS_BY_NAME = {sc["name"]: sc for sc in SCENARIOS}


def make_examples(n=N_EXAMPLES, seed=7):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(3, 6) if i % 2 == 0 else rng.randint(14, 24)
        ids = [rng.randint(2, MODEL_CONFIG["vocab_size"] - 1) for _ in range(length)]
        out.append({"input_ids": ids, "labels": ids})
    return out


def expected_boundaries(n_micro: int, K: int) -> list[bool]:
    """Per local micro-batch: ends a window (every K-th, and the last one of the epoch)."""
    return [(j + 1) % K == 0 or j == n_micro - 1 for j in range(n_micro)]


# --------------------------------------------------------------------------- the launch


@pytest.fixture(scope="module")
def launch(tmp_path_factory, ddp_pool):
    """Queue the 2-process run on conftest.py's shared ``ddp_pool`` (not waiting)."""
    root = tmp_path_factory.mktemp("profiler")
    corpus = jh.write_corpus(root / "corpus.txt", files=("textwrap.py",))
    job_out, trace_dir = root / "job_out", root / "trace"
    argv = ["train", "--model_preset", "tiny", "--train_file", str(corpus), "--block_size", "64",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", str(JOB_K),
            "--max_train_steps", str(JOB_STEPS), "--profile_ab_steps", str(JOB_AB), "--trace_dir", str(trace_dir),
            "--profile_overhead_steps", str(JOB_OVERHEAD),
            "--output_dir", str(job_out), "--max_train_samples", "64", "--max_eval_samples", "8",
            "--num_warmup_steps", "0", "--logging_steps", "10", "--with_tracking", "--report_to", "tensorboard",
            # static graph: the run's first micro-batch syncs to prime DDP; the figures must leave it out
            "--ddp_static_graph", "true"]
    spec = {"model_config": MODEL_CONFIG, "seed": SEED, "lr": LR, "pad_id": PAD_ID, "bucket_cap_mb": BUCKET_CAP_MB,
            "examples": make_examples(), "scenarios": SCENARIOS, "train_job": {"argv": argv}}
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps(spec))
    out = root / "out"
    assert ddp_pool.num_processes == WORLD  # a script run of conftest.py's shared 2-process DDP launch
    started = ddp_pool.submit("profiler_worker", [spec_path, out], datasets_cache=root / "hf_datasets_cache",
                              script=WORKER)
    return {"started": started, "root": root, "out": out, "job_out": job_out, "trace_dir": trace_dir}


@pytest.fixture(scope="module")
def runs(launch):
    """Wait for the launch; load every scenario's per-rank records."""
    res = launch["started"].result()
    assert res.returncode == 0, res.describe()
    out = launch["out"]
    loaded = {}
    for sc in SCENARIOS:
        d = out / sc["name"]
        loaded[sc["name"]] = {
            "ranks": [json.loads((d / f"rank{r}.json").read_text()) for r in range(WORLD)],
            "final": torch.load(d / "final.pt", weights_only=True) if (d / "final.pt").exists() else None,
        }
    loaded["_launch"] = launch
    return loaded


def ranks(runs, name):
    return runs[name]["ranks"]


def calls_by_sync(calls) -> list[list[dict]]:
    """The bucket records grouped by synchronised backward, in order."""
    groups = {}
    for c in calls:
        groups.setdefault(c["sync"], []).append(c)
    return [sorted(groups[k], key=lambda c: c["bucket"]) for k in sorted(groups)]


def ddp_layouts(info) -> tuple[list[int], list[int]]:
    """(initial, rebuilt) bucket sizes in bytes, as DDP's own logging data reports them."""
    log = info["ddp_logging"]
    initial = [int(x) for x in str(log["bucket_sizes"]).split(",")]
    rebuilt = [int(x) for x in str(log.get("rebuilt_bucket_sizes", log["bucket_sizes"])).split(",")]
    return initial, rebuilt


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# --------------------------------------------------------------------------- (6) one process, no DDP


def test_single_process_reports_zero_communication(launch, monkeypatch):
    """In this process (while the launch runs): no DDP, so no hook, no calls, nothing saved."""
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel

    import accum_kit
    from accum_kit.profiler import CommProfiler, format_table
    from job_helpers import pad_collate

    for name in jh.LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    jh.reset_accelerate_state()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        acc = accum_kit.build_accelerator(3, cpu=True)
        assert acc.num_processes == 1
        torch.manual_seed(SEED)
        model = GPT2LMHeadModel(GPT2Config(**MODEL_CONFIG))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        loader = DataLoader(make_examples(12), batch_size=B, collate_fn=pad_collate(PAD_ID))  # 6 micro-batches
        model, opt, loader = acc.prepare(model, opt, loader)
        assert not isinstance(model, torch.nn.parallel.DistributedDataParallel)
        prof = CommProfiler(acc, model)
        result = accum_kit.train_loop(acc, model, opt, loader, profiler=prof, progress=False)
        s = prof.summary()
    finally:
        torch.set_num_threads(threads)
        jh.reset_accelerate_state()
    assert result.optimizer_steps == 2 and all(math.isfinite(x) for x in result.train_loss)
    assert set(SUMMARY_KEYS) <= s.keys(), sorted(set(SUMMARY_KEYS) - s.keys())
    assert s["world_size"] == 1
    assert s["allreduce_calls"] == 0 and s["allreduce_bytes"] == 0 and s["allreduce_seconds"] == 0
    assert s["estimated_seconds_saved"] == 0 and s["skipped_syncs"] == 0 and s["exposed_comm_seconds"] == 0
    assert s["algbw_GBps"] == 0 and s["busbw_GBps"] == 0
    assert prof.calls == [] and len(prof.micro_batches) == 6  # phase timing still works
    assert len(s["per_process"]) == 1
    assert "all-reduce calls" in format_table(s)


def test_tag_labels_records_and_filters_summaries():
    """A free-form run label goes to ``tag`` (``mode`` takes only the two modes); summaries filter by it."""
    from types import SimpleNamespace

    from accum_kit.core.callbacks import LoopState
    from accum_kit.errors import UsageError
    from accum_kit.profiler import CommProfiler

    acc = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"), use_distributed=False,
                          gradient_state=SimpleNamespace(plugin_kwargs={}))
    prof = CommProfiler(acc, torch.nn.Linear(2, 2))  # not DDP: phase records only
    assert prof.mode == "no_sync" and prof.tag is None
    with pytest.raises(UsageError, match="mode"):
        prof.mode = "warmup/run"
    state = LoopState()

    def window(k):  # the hook calls train_loop makes for one window of k micro-batches
        for i in range(k):
            state.boundary = state.sync = i == k - 1
            prof.on_micro_batch_begin(state)
            prof.on_forward_end(state)
            prof.on_backward_end(state)
            state.micro_step += 1
        prof.on_step_begin(state)
        state.step += 1
        prof.on_step_end(state)

    prof.on_train_begin(state)
    prof.tag = "a"
    window(2)
    window(2)
    prof.tag = "b"
    window(3)
    prof.mode = "sync_each_batch"
    window(1)
    prof.on_train_end(state)
    assert [m.tag for m in prof.micro_batches] == ["a"] * 4 + ["b"] * 4
    assert [(s.step, s.tag, s.mode) for s in prof.step_records] == [
        (0, "a", "no_sync"), (1, "a", "no_sync"), (2, "b", "no_sync"), (3, "b", "sync_each_batch")]
    assert [s.step for s in prof.records(tag="b", mode="no_sync").steps] == [2]
    assert len(prof.records().micro_batches) == 8
    prof.mode = "no_sync"
    a, b, both = prof.local_summary(tag="a"), prof.local_summary(tag="b"), prof.local_summary()
    assert (a["micro_batches"], a["optimizer_steps"]) == (4, 2)
    assert (b["micro_batches"], b["optimizer_steps"]) == (3, 1)  # its sync_each_batch window is another mode
    assert (both["micro_batches"], both["optimizer_steps"]) == (7, 3)
    assert prof.summary(tag="a")["per_process"] == [a]


# --------------------------------------------------------------------------- (1) calls per window = DDP's buckets


@pytest.mark.parametrize("name", ["nosync_k5", "nosync_k2", "each_k2", "fp16_k2", "ab_k2"])
def test_calls_per_sync_equal_ddp_bucket_count(runs, name):
    for info in ranks(runs, name):
        assert info["is_ddp"] and info["num_processes"] == WORLD and "MULTI_CPU" in info["distributed_type"]
        initial, rebuilt = ddp_layouts(info)
        assert len(rebuilt) >= 2, f"bucket_cap_mb={BUCKET_CAP_MB} should give several buckets, DDP reports {rebuilt}"
        groups = calls_by_sync(info["calls"])
        assert groups, "no all-reduce recorded"
        for i, g in enumerate(groups):
            # DDP rebuilds its buckets after the first synchronised backward (warmup_sync did it already).
            layout = initial if (i == 0 and not SCENARIOS_BY_NAME[name]["warmup_sync"]) else rebuilt
            got = [(c["bucket"], c["bytes"]) for c in g]
            assert got == list(enumerate(layout)), f"rank {info['rank']} sync {i}: recorded {got}, DDP buckets {layout}"
        if "num_buckets_reduced" in info["ddp_logging"]:
            assert info["ddp_logging"]["num_buckets_reduced"] == len(rebuilt)


def test_nosync_k5_calls_per_window(runs):
    """One sync per window; its calls are the pre-rebuild layout in window 0, the rebuilt one after."""
    for info in ranks(runs, "nosync_k5"):
        initial, rebuilt = ddp_layouts(info)
        n_windows = math.ceil(PER_PROCESS / 5)
        per_window = [sum(1 for c in info["calls"] if c["step"] == w) for w in range(n_windows)]
        assert per_window == [len(initial)] + [len(rebuilt)] * (n_windows - 1)
        assert info["summary"]["allreduce_calls"] == len(initial) + len(rebuilt) * (n_windows - 1)


# --------------------------------------------------------------------------- (2) bytes per sync = gradient bytes


@pytest.mark.parametrize("name", ["nosync_k5", "nosync_k2", "each_k2", "fp16_k2", "ab_k2"])
def test_bytes_per_sync_equal_gradient_bytes(runs, name):
    for info in ranks(runs, name):
        grad_bytes = info["grad_bytes"]
        assert grad_bytes == 8128 * 4  # float32 parameters of the model above (tied lm_head counted once)
        assert info["ddp_logging"]["total_parameter_size_bytes"] == grad_bytes
        for i, g in enumerate(calls_by_sync(info["calls"])):
            assert sum(c["bytes"] for c in g) == grad_bytes, f"rank {info['rank']} sync {i}"
        s = info["summary"]["per_process"][info["rank"]]
        assert s["allreduce_bytes"] == s["syncs"] * grad_bytes


def test_gradient_bytes_oracle_counts_parameters():
    """The worker's oracle for the model above, recomputed here: numel of the unique parameters x 4 bytes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(**MODEL_CONFIG))
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert n == 8128 and all(p.dtype == torch.float32 for p in model.parameters())


# --------------------------------------------------------------------------- (3) calls only on boundary micro-batches


def test_no_calls_on_no_sync_micro_batches(runs):
    K = 5
    boundary = expected_boundaries(PER_PROCESS, K)  # [4, 9, 11]
    for info in ranks(runs, "nosync_k5"):
        assert info["micro_batches"] == PER_PROCESS and info["optimizer_steps"] == math.ceil(PER_PROCESS / K)
        assert [m["boundary"] for m in info["loop_flags"]] == boundary
        assert [m["sync"] for m in info["loop_flags"]] == boundary
        calls_per_micro = [sum(1 for c in info["calls"] if c["micro_batch"] == j) for j in range(PER_PROCESS)]
        assert [n > 0 for n in calls_per_micro] == boundary, f"rank {info['rank']}: calls per micro-batch {calls_per_micro}"
        assert all(c["step"] == c["micro_batch"] // K for c in info["calls"]), "call tagged with the wrong optimizer step"
        assert all(c["mode"] == "no_sync" and c["seconds"] >= 0 for c in info["calls"])
        assert [m["sync"] for m in info["prof_micro_batches"]] == boundary
        assert [m["micro_batch"] for m in info["prof_micro_batches"]] == list(range(PER_PROCESS))


# --------------------------------------------------------------------------- (4) sync_each_batch doubles at K=2


def test_sync_each_batch_doubles_counts_and_bytes(runs):
    for rank in range(WORLD):
        base = ranks(runs, "nosync_k2")[rank]
        each = ranks(runs, "each_k2")[rank]
        sb, se = base["summary"]["per_process"][rank], each["summary"]["per_process"][rank]
        assert sb["optimizer_steps"] == se["optimizer_steps"] == PER_PROCESS // 2
        assert sb["allreduce_calls"] > 0
        assert se["allreduce_calls"] == 2 * sb["allreduce_calls"]
        assert se["allreduce_bytes"] == 2 * sb["allreduce_bytes"]
        assert se["syncs"] == 2 * sb["syncs"] == PER_PROCESS
        assert se["allreduce_calls_per_step"] == 2 * sb["allreduce_calls_per_step"]
        assert se["mode"] == "sync_each_batch" and sb["mode"] == "no_sync"
        assert se["skipped_syncs"] == 0 and sb["skipped_syncs"] == PER_PROCESS // 2
        # Every micro-batch all-reduces with sync_each_batch; only the odd ones (boundaries) without.
        for info, expect in ((each, [True] * PER_PROCESS), (base, expected_boundaries(PER_PROCESS, 2))):
            calls_per_micro = [sum(1 for c in info["calls"] if c["micro_batch"] == j) for j in range(PER_PROCESS)]
            assert [n > 0 for n in calls_per_micro] == expect
    # Same data, same update: syncing each micro-batch only moves the all-reduce.
    assert max_abs_diff(runs["each_k2"]["final"], runs["nosync_k2"]["final"]) < 1e-6


# --------------------------------------------------------------------------- (5) compression hook


def test_fp16_compression_hook_is_wrapped(runs):
    plain, fp16 = runs["nosync_k2"]["final"], runs["fp16_k2"]["final"]
    assert all(torch.isfinite(v).all() for v in fp16.values())
    diff = max_abs_diff(fp16, plain)
    assert diff < 1e-3, f"fp16-compressed training drifted {diff:.2e} from the plain run"
    # Rounding the averaged gradients to fp16 changes the update: the wrapped hook really ran.
    assert diff > 1e-7, "fp16_compress_hook left the update bit-identical: was it used?"
    for rank in range(WORLD):
        info, base = ranks(runs, "fp16_k2")[rank], ranks(runs, "nosync_k2")[rank]
        assert len(info["calls"]) == len(base["calls"]) > 0
        # (records are appended as all-reduces complete, so compare them unordered)
        key = lambda calls: sorted((c["step"], c["micro_batch"], c["bucket"], c["bytes"]) for c in calls)  # noqa: E731
        assert key(info["calls"]) == key(base["calls"])
        assert all(c["seconds"] >= 0 for c in info["calls"])


def test_second_hook_is_refused_with_advice(runs):
    for info in ranks(runs, "double_hook"):
        assert info["is_ddp"]
        assert info["error_type"] == "RuntimeError", info
        assert "hook=" in info["error"] and "already has a comm hook" in info["error"]


# --------------------------------------------------------------------------- (7) A/B switch


def ab_expected_modes(n_steps: int, ab_steps: int, warmup: int = 1, home: str = "no_sync") -> list[str]:
    other = "sync_each_batch" if home == "no_sync" else "no_sync"
    modes = [home] * n_steps
    for i in range(2 * ab_steps):
        modes[warmup + i] = home if i % 2 == 0 else other
    return modes


def test_ab_switch_alternates_and_keeps_the_math(runs):
    K, n_steps = 2, PER_PROCESS // 2
    modes = ab_expected_modes(n_steps, AB_STEPS)  # no_sync, no_sync, sync_each, no_sync, sync_each, no_sync
    assert modes.count("sync_each_batch") == AB_STEPS
    for info in ranks(runs, "ab_k2"):
        assert info["optimizer_steps"] == n_steps
        assert {k: len(v) for k, v in info["ab_times"].items()} == {"no_sync": AB_STEPS, "sync_each_batch": AB_STEPS}
        assert all(t > 0 for v in info["ab_times"].values() for t in v)
        ab = info["ab_summary"]
        assert ab["ab_steps_each"] == AB_STEPS
        assert ab["measured_seconds_saved_per_step"] == pytest.approx(
            ab["seconds_per_step_sync_each_batch"] - ab["seconds_per_step_no_sync"], rel=1e-12)
        assert ab["speedup"] == pytest.approx(ab["seconds_per_step_sync_each_batch"] / ab["seconds_per_step_no_sync"])
        # The loop's own flags: every micro-batch syncs in the other mode's windows.
        want_sync = [modes[j // K] == "sync_each_batch" or (j + 1) % K == 0 for j in range(PER_PROCESS)]
        assert [m["sync"] for m in info["loop_flags"]] == want_sync
        # The comm records: tagged with the window's mode, on exactly those micro-batches.
        calls_per_micro = [sum(1 for c in info["calls"] if c["micro_batch"] == j) for j in range(PER_PROCESS)]
        assert [n > 0 for n in calls_per_micro] == want_sync, calls_per_micro
        assert all(c["mode"] == modes[c["step"]] for c in info["calls"])
        assert [r["mode"] for r in info["step_records"]] == modes
        assert [m["mode"] for m in info["prof_micro_batches"]] == [modes[j // K] for j in range(PER_PROCESS)]
        # After the A/B windows the run is back in its own mode, and the summary covers only that mode.
        assert info["sync_each_batch_after"] is False
        s = info["summary"]["per_process"][info["rank"]]
        assert s["mode"] == "no_sync" and s["optimizer_steps"] == modes.count("no_sync")
        assert s["allreduce_calls"] == sum(1 for c in info["calls"] if c["mode"] == "no_sync")
        assert s["skipped_syncs"] == modes.count("no_sync") * (K - 1)
    final, plain = runs["ab_k2"]["final"], runs["nosync_k2"]["final"]
    diff = max_abs_diff(final, plain)
    assert diff < 1e-6, f"A/B switching changed the parameters by {diff:.2e}"
    # ... and that tolerance tells training apart from a different schedule (K=5 on the same data).
    assert max_abs_diff(runs["nosync_k5"]["final"], plain) > 1e-3


# --------------------------------------------------------------------------- (8) summary keys and arithmetic


def test_summary_keys_and_arithmetic(runs):
    K = 5
    n_windows = math.ceil(PER_PROCESS / K)
    for info in ranks(runs, "nosync_k5"):
        top = info["summary"]
        assert set(SUMMARY_KEYS) <= top.keys(), sorted(set(SUMMARY_KEYS) - top.keys())
        assert len(top["per_process"]) == WORLD and top["world_size"] == WORLD
        assert top["per_process"][0] == {k: v for k, v in top.items() if k not in ("per_process", "spread")}
        s = top["per_process"][info["rank"]]  # this rank's own figures
        calls = info["calls"]
        assert s["allreduce_calls"] == len(calls)
        assert s["allreduce_bytes"] == sum(c["bytes"] for c in calls) == n_windows * info["grad_bytes"]
        assert s["allreduce_seconds"] == pytest.approx(sum(c["seconds"] for c in calls), rel=1e-12)
        assert s["syncs"] == n_windows
        assert s["skipped_syncs"] == PER_PROCESS - n_windows  # micro-batches per process minus windows
        # algbw: bytes over the time with at least one bucket in flight (union of the call intervals),
        # measured here on a fine time grid: an independent way to get the union's length.
        def busy(group, ticks=200_000):
            lo = min(c["start"] for c in group)
            hi = max(c["start"] + c["seconds"] for c in group)
            dt = (hi - lo) / ticks
            return sum(dt for i in range(ticks)
                       if any(c["start"] <= lo + (i + 0.5) * dt < c["start"] + c["seconds"] for c in group))
        busy_total = sum(busy(g) for g in calls_by_sync(calls))
        assert s["algbw_GBps"] == pytest.approx(s["allreduce_bytes"] / busy_total / 1e9, rel=1e-3)
        assert 0 < s["algbw_GBps"] < 1000
        assert s["busbw_GBps"] == pytest.approx(s["algbw_GBps"] * 2 * (WORLD - 1) / WORLD, rel=1e-12)
        assert s["exposed_comm_seconds"] is not None and s["exposed_comm_seconds"] >= 0
        assert s["estimated_seconds_saved"] == pytest.approx(s["skipped_syncs"] * s["exposed_comm_seconds"], rel=1e-12)
        assert s["estimated_seconds_saved_upper"] >= 0
        for key in ("allreduce_calls", "allreduce_bytes", "algbw_GBps"):
            sp = top["spread"][key]
            vals = [p[key] for p in top["per_process"]]
            assert (sp["min"], sp["max"]) == (min(vals), max(vals))


@pytest.mark.parametrize("name", ["nosync_k5", "each_k2", "ab_k2"])
def test_summary_from_running_aggregates_equals_the_one_from_every_record(runs, name):
    """The profiler's whole-run summary comes from bounded running aggregates; on this short run (every raw
    record kept) it equals the summary computed from all the records, key by key (float rounding aside)."""
    for info in ranks(runs, name):
        jh.assert_same_summary(info["summary"]["per_process"][info["rank"]], info["summary_from_records"])


def test_format_table_shows_every_summary_row(runs):
    from accum_kit.profiler import format_table

    s = ranks(runs, "nosync_k5")[0]["summary"]
    table = format_table(s)
    assert f"{s['allreduce_calls']}" in table and "busbw" in table and "skipped syncs" in table
    assert "(2 processes)" in table.splitlines()[0]


# --------------------------------------------------------------------------- (9) train job: trace and comm block


def test_train_job_writes_trace(runs):
    launch = runs["_launch"]
    for r in range(WORLD):
        assert (launch["out"] / f"train_job_rank{r}.rc").read_text() == "0"
        path = launch["trace_dir"] / f"trace_rank{r}.json"
        assert path.is_file(), sorted(p.name for p in launch["trace_dir"].iterdir())
        trace = json.loads(path.read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        ranges = {n for n in names if isinstance(n, str) and n.startswith("micro_batch_")}
        assert all(re.fullmatch(r"micro_batch_\d+/(sync|no_sync)", n) for n in ranges), ranges
        assert any(n.endswith("/sync") for n in ranges) and any(n.endswith("/no_sync") for n in ranges), ranges
        # Each range's tag matches the run's schedule: micro-batch i syncs when it ends a window of K or
        # when its window is one of the A/B switch's sync_each_batch windows.
        modes = ab_expected_modes(JOB_STEPS, JOB_AB)
        tagged = {int(re.search(r"\d+", n).group()): n.endswith("/sync") for n in ranges}
        want = {i: (i + 1) % JOB_K == 0 or modes[i // JOB_K] == "sync_each_batch" for i in tagged}
        assert tagged == want, sorted(ranges)
        # trace_steps (default 2) whole optimizer steps, consecutive micro-batches.
        assert sorted(tagged) == list(range(min(tagged), min(tagged) + 2 * JOB_K)), sorted(ranges)
        assert not list(launch["trace_dir"].glob("*.tmp"))


def test_train_job_summary_has_comm_block(runs):
    launch = runs["_launch"]
    summary = json.loads((launch["job_out"] / "train_summary.json").read_text())
    assert summary["world_size"] == WORLD and summary["optimizer_steps"] == JOB_STEPS
    comm = summary["comm"]
    missing = set(SUMMARY_KEYS + AB_KEYS) - comm.keys()
    assert not missing, sorted(missing)
    assert comm["world_size"] == WORLD and comm["mode"] == "no_sync"
    assert comm["ab_steps_each"] == JOB_AB
    # The A/B switch's sync_each_batch windows are reported apart; the profiler-off windows are not recorded.
    home_steps = JOB_STEPS - JOB_AB - JOB_OVERHEAD
    assert comm["overhead_steps_each"] == JOB_OVERHEAD
    assert comm["profiler_overhead_ratio"] == pytest.approx(
        comm["seconds_per_step_profiler_on"] / comm["seconds_per_step_profiler_off"])
    assert comm["optimizer_steps"] == home_steps
    assert comm["skipped_syncs"] == home_steps * (JOB_K - 1) - 1  # the static graph's priming micro-batch synced
    assert comm["allreduce_calls"] >= home_steps and comm["allreduce_bytes"] > 0
    assert comm["busbw_GBps"] == pytest.approx(comm["algbw_GBps"] * 2 * (WORLD - 1) / WORLD, rel=1e-12)
    assert comm["seconds_per_step_sync_each_batch"] > 0 and comm["seconds_per_step_no_sync"] > 0
    assert comm["measured_seconds_saved_per_step"] == pytest.approx(
        comm["seconds_per_step_sync_each_batch"] - comm["seconds_per_step_no_sync"], rel=1e-12)
    assert comm["speedup"] == pytest.approx(comm["seconds_per_step_sync_each_batch"] / comm["seconds_per_step_no_sync"])
    assert Path(comm["trace_file"]).name == "trace_rank0.json"
    assert len(comm["per_process"]) == WORLD
    # --ddp_static_graph: the priming sync of the first micro-batch is no sync of either mode
    assert comm["syncs"] == home_steps
    by_policy = summary["memory"]["by_policy"]
    assert by_policy["sync_each_batch"]["measurements"] == JOB_AB * (JOB_K - 1), by_policy  # A/B windows only
    assert by_policy["no_sync"]["measurements"] == (JOB_STEPS - JOB_AB) * (JOB_K - 1) - 1, by_policy  # not the first


def test_train_job_logs_comm_per_step_to_tensorboard(runs):
    from job_helpers import tensorboard_scalars

    launch = runs["_launch"]
    summary = json.loads((launch["job_out"] / "train_summary.json").read_text())
    comm, tb = summary["comm"], tensorboard_scalars(launch["job_out"] / "accum_kit")
    per_sync = comm["allreduce_bytes"] / comm["syncs"]  # every gradient byte once per synchronised backward
    modes = ab_expected_modes(JOB_STEPS, JOB_AB)
    ab_end = 1 + 2 * JOB_AB
    off = {ab_end + 2 * j + 1 for j in range(JOB_OVERHEAD)}  # OverheadSwitch's profiler-off windows
    for i in range(JOB_STEPS):
        step = i + 1
        syncs = 0 if i in off else (JOB_K if modes[i] == "sync_each_batch" else 1)
        assert tb["comm/allreduce_bytes"][step] == pytest.approx(syncs * per_sync), (step, modes[i])
        assert (tb["comm/allreduce_calls"][step] > 0) == (syncs > 0)
        assert tb["comm/exposed_seconds"][step] >= 0
    assert tb["comm/ab_speedup"] == pytest.approx({JOB_STEPS: comm["speedup"]}, rel=1e-6)
