"""Tests of the what-if planner (``accum-kit plan --from_profile``) against hand arithmetic.

The profile is a synthetic ``comm`` block with the keys a real
``train --profile_comm`` writes (checked against the profiler's own
``local_summary`` below) and round numbers, so every expected value is worked
out by hand in the comments. No launch, no torch needed by the planner.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from accum_kit import cli
from accum_kit.errors import UsageError
from accum_kit.planning import make_plan
from accum_kit.planning.whatif import (
    COMM_KEYS,
    INTERCONNECTS,
    load_profile,
    make_whatif,
    predict,
    ring_allreduce_seconds,
    solve_k_for_comm_share,
)

# Profiled run: 2 processes, K_p = 4 (40 micro-batches / 10 steps), 10 syncs of 4e6 B,
# forward 0.01 s + no-sync backward 0.02 s -> c = 0.03 s; all-reduce 0.02 s per sync;
# algbw = 4e6 B / 0.02 s = 0.2 GB/s, busbw = algbw x 2 (2-1)/2 = 0.2 GB/s;
# exposed 0.015 s -> overlap 1 - 0.015 / 0.02 = 0.25;
# step 0.145 s = 4 x 0.03 + 0.015 + o -> o = 0.01 s (optimizer 0.005 s + 0.005 s other).
COMM = {
    "world_size": 2, "mode": "no_sync", "optimizer_steps": 10, "micro_batches": 40, "allreduce_calls": 20,
    "allreduce_bytes": 40_000_000, "allreduce_seconds": 0.25, "syncs": 10, "allreduce_calls_per_step": 2.0,
    "allreduce_bytes_per_step": 4e6, "allreduce_calls_per_sync": 2, "seconds_per_sync": 0.02,
    "algbw_GBps": 0.2, "busbw_GBps": 0.2, "skipped_syncs": 30, "exposed_comm_seconds": 0.015,
    "overlap_fraction": 0.25, "forward_seconds": 0.01, "backward_seconds_sync": 0.035,
    "backward_seconds_no_sync": 0.02, "optimizer_seconds": 0.005, "seconds_per_step": 0.145,
}


def write_summary(tmp_path, comm=COMM, name="train_summary.json", **top):
    summary = {"world_size": comm["world_size"] if comm else 1, "gradient_accumulation_steps": 4,
               "per_device_train_batch_size": 1, "model": "preset:small", **top}
    if comm is not None:
        summary["comm"] = comm
    path = tmp_path / name
    path.write_text(json.dumps(summary))
    return str(path)


@pytest.fixture
def profile(tmp_path):
    return write_summary(tmp_path)


def plan(capsys, *argv):
    code = cli.run("plan", ["--per_device_train_batch_size", "1", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_profile_figures_by_hand(profile):
    p = load_profile(profile)
    assert (p.world_size, p.gradient_accumulation_steps) == (2, 4)
    assert p.compute_seconds == pytest.approx(0.03)
    assert p.bytes_per_sync == pytest.approx(4e6)
    assert p.other_seconds == pytest.approx(0.01)
    assert p.overlap_fraction == 0.25


def test_formulas_by_hand(profile):
    # Measured busbw at the profile's n = 2: t_ar = 2 x 1/2 x 4e6 / 0.2e9 = 0.02 s (the measured time),
    # e = 0.02 x 0.75 = 0.015 s. K = 8: no_sync 8 x 0.03 + 0.015 + 0.01 = 0.265 s,
    # sync_each_batch 8 x 0.045 + 0.01 = 0.37 s, speedup 0.37 / 0.265, share 0.015 / 0.265.
    r = make_whatif(profile)
    assert r.num_processes == 2 and r.interconnect == "measured"
    assert r.allreduce_seconds == pytest.approx(0.02)
    assert r.exposed_comm_seconds == pytest.approx(0.015)
    row = next(w for w in r.rows if w.K == 8)
    assert row.no_sync_step_seconds == pytest.approx(0.265)
    assert row.sync_each_batch_step_seconds == pytest.approx(0.37)
    assert row.speedup == pytest.approx(0.37 / 0.265)
    assert row.comm_share_no_sync == pytest.approx(0.015 / 0.265)
    assert row.comm_share_sync_each_batch == pytest.approx(8 * 0.015 / 0.37)
    assert [w.K for w in r.rows] == [1, 2, 4, 8, 16, 32]
    # 8 processes at 1 GB/s: t_ar = 2 x 7/8 x 4e6 / 1e9 = 0.007 s, e = 0.00525 s;
    # K = 4: no_sync 0.12 + 0.00525 + 0.01 = 0.13525 s, sync_each_batch 4 x 0.03525 + 0.01 = 0.151 s.
    r = make_whatif(profile, num_processes=8, num_machines=2, busbw_GBps=1.0, accumulation_steps=[4])
    assert r.allreduce_seconds == pytest.approx(0.007)
    (row,) = r.rows
    assert row.no_sync_step_seconds == pytest.approx(0.13525)
    assert row.sync_each_batch_step_seconds == pytest.approx(0.151)
    # Named interconnects: InfiniBand NDR 50 GB/s -> t_ar = 1.75 x 4e6 / 50e9 = 1.4e-4 s.
    r = make_whatif(profile, num_processes=8, num_machines=2, interconnect="infiniband")
    assert r.busbw_GBps == 50.0 and r.allreduce_seconds == pytest.approx(1.4e-4)
    assert {k: v[0] for k, v in INTERCONNECTS.items()} == {
        "nvlink": 450.0, "infiniband": 50.0, "ethernet": 12.5, "measured": None}


def test_measured_busbw_gives_back_the_profile(tmp_path):
    # busbw = 4e6 B / 0.02 s (median per sync) x 2 x 1/2 = 0.2 GB/s, whatever the block's busbw_GBps
    # (the mean over syncs) says: at the profiled n the model's exposed time is the measured 0.015 s.
    r = make_whatif(write_summary(tmp_path, {**COMM, "busbw_GBps": 0.15}))
    assert r.busbw_GBps == pytest.approx(0.2) and r.exposed_comm_seconds == pytest.approx(0.015)


def test_solved_k_is_the_smallest_meeting_the_share(profile):
    # e = 0.015, c = 0.03, o = 0.01, s = 0.1: K >= (0.015 x 0.9 / 0.1 - 0.01) / 0.03 = 4.17 -> 5;
    # share(5) = 0.015 / 0.175 = 8.6 % <= 10 %, share(4) = 0.015 / 0.145 = 10.3 % > 10 %.
    assert solve_k_for_comm_share(0.03, 0.015, 0.01, 0.1) == 5
    assert make_whatif(profile, max_comm_share=0.1).k_for_max_comm_share == 5
    assert solve_k_for_comm_share(0.03, 0.0, 0.01, 0.1) == 1  # nothing exposed: K = 1 already
    # Against the definition over a grid (no formula from the code under test): K meets the share and
    # K - 1 does not; where K is small, also against brute force from K = 1.
    for c in (0.001, 0.03, 0.5):
        for e in (0.0, 0.004, 0.1, 2.0):
            for o in (0.0, 0.01, 0.3):
                for s in (0.01, 0.05, 0.1, 0.333, 0.9):
                    share = lambda k: e / (k * c + e + o)  # noqa: E731
                    k = solve_k_for_comm_share(c, e, o, s)
                    assert share(k) <= s and (k == 1 or share(k - 1) > s), (c, e, o, s, k)
                    if k < 5000:
                        assert k == next(j for j in range(1, 5001) if share(j) <= s)


def test_monotonicity(profile):
    r = make_whatif(profile, accumulation_steps=list(range(1, 65)))
    rows = r.rows
    for a, b in zip(rows, rows[1:]):
        assert b.no_sync_step_seconds > a.no_sync_step_seconds
        assert b.comm_share_no_sync < a.comm_share_no_sync
        assert b.speedup > a.speedup
        assert b.comm_share_sync_each_batch >= a.comm_share_sync_each_batch
    assert rows[0].speedup == pytest.approx(1.0)  # K = 1: both modes sync once
    # More processes, slower links: more all-reduce time; a looser target share needs no larger K.
    times = [ring_allreduce_seconds(4e6, n, 10.0) for n in (1, 2, 4, 8, 64)]
    assert times[0] == 0 and all(x < y for x, y in zip(times, times[1:]))
    assert ring_allreduce_seconds(4e6, 8, 1.0) > ring_allreduce_seconds(4e6, 8, 10.0)
    ks = [make_whatif(profile, busbw_GBps=bw).k_for_max_comm_share for bw in (0.01, 0.1, 1.0, 10.0)]
    assert all(x >= y for x, y in zip(ks, ks[1:])) and ks[0] > ks[-1]
    ks = [make_whatif(profile, max_comm_share=s).k_for_max_comm_share for s in (0.01, 0.05, 0.1, 0.5)]
    assert all(x >= y for x, y in zip(ks, ks[1:])) and ks[0] > ks[-1]


def test_predict_one_row():
    # c = 1, e = 0.5, o = 0.25, K = 2, B x n = 4: no_sync 2.75, sync_each_batch 3.25, 8 examples / 2.75 s.
    w = predict(2, 1.0, 0.5, 0.25, 4)
    assert (w.no_sync_step_seconds, w.sync_each_batch_step_seconds) == (2.75, 3.25)
    assert w.examples_per_second_no_sync == pytest.approx(8 / 2.75)


def test_plan_text_and_json(capsys, profile):
    code, out, err = plan(capsys, "--gradient_accumulation_steps", "8", "--from_profile", profile)
    assert code == 0, err
    # The arithmetic for the plan's K (8), with the numbers of test_formulas_by_hand.
    assert "no_sync = K c + e + o = 8 x 0.03 + 0.015 + 0.01 = 0.265 s" in out
    assert "t_ar = 2 (n-1)/n x bytes / busbw = 2 x 1/2 x 4e+06 B / 0.2 GB/s = 0.02 s" in out
    assert "--gradient_accumulation_steps 5" in out and "left out: stragglers" in out
    assert "2 processes" in out  # num_processes defaults to the profile's world size
    code, out, _ = plan(capsys, "--from_profile", profile, "--num_processes", "16", "--num_machines", "2",
                        "--interconnect", "infiniband", "--accumulation_steps", "1", "4", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["batch"]["num_processes"] == 16
    w = d["whatif"]
    assert [r["K"] for r in w["rows"]] == [1, 4]
    assert w["busbw_GBps"] == 50.0 and "NDR" in w["busbw_source"]
    assert w["arithmetic"]["shown_for_K"] == 4  # the plan's default K
    assert w["allreduce_seconds"] == pytest.approx(2 * 15 / 16 * 4e6 / 50e9)
    code, out, _ = plan(capsys, "--num_processes", "2", "--json")
    assert code == 0 and json.loads(out)["whatif"] is None


def test_compare_bench_by_hand(capsys, tmp_path, profile):
    # Measured: K = 2 no_sync 0.09 s (predicted 2 x 0.03 + 0.015 + 0.01 = 0.085 s: -5.6 %),
    # sync_each_batch 0.1 s (predicted 2 x 0.045 + 0.01 = 0.1 s: 0 %), speedup 1.1 (predicted 0.1 / 0.085).
    # The bench's own inputs c = 0.04, a = 0.01, o = 0.005 + 0.005 give the noise floor:
    # no_sync 2 x 0.04 + 0.01 + 0.01 = 0.1 (+11.1 %), sync_each_batch 2 x 0.05 + 0.01 = 0.11 (+10 %).
    own = {"c_seconds": 0.04, "a_seconds": 0.01, "profile": {"no_sync": {"optimizer_s": 0.005, "other_s": 0.005}}}
    bench = {"presets": {"small": own, "comm_heavy": {}}, "config": {"per_device_train_batch_size": 1,
             "comm_hook": "none"}, "machine": {"world_size": 2},
             "rows": [{"preset": "small", "K": 2, "mode": "no_sync", "step_s_median": 0.09},
                      {"preset": "small", "K": 2, "mode": "sync_each_batch", "step_s_median": 0.1},
                      {"preset": "comm_heavy", "K": 2, "mode": "no_sync", "step_s_median": 9.0}],
             "per_k": [{"preset": "small", "K": 2, "speedup": 1.1}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    c = make_plan(1, from_profile=profile, compare_bench=str(path)).whatif.comparison
    assert c["preset"] == "small" and c["notes"] == []
    (row,) = c["rows"]
    assert row["no_sync_predicted_s"] == pytest.approx(0.085)
    assert row["no_sync_relative_error"] == pytest.approx((0.085 - 0.09) / 0.09)
    assert row["sync_each_batch_relative_error"] == pytest.approx(0.0, abs=1e-12)
    assert row["speedup_relative_error"] == pytest.approx((0.1 / 0.085 - 1.1) / 1.1)
    assert c["max_abs_relative_error"] == pytest.approx(0.005 / 0.09)
    assert c["speedup_max_abs_relative_error"] == pytest.approx(abs(0.1 / 0.085 - 1.1) / 1.1)
    assert c["same_run_max_abs_relative_error"] == pytest.approx(0.01 / 0.09)
    assert c["same_run_median_abs_relative_error"] == pytest.approx((0.01 / 0.09 + 0.1) / 2)
    assert c["compute_ratio_profile_over_bench"] == pytest.approx(0.75)
    code, out, _ = plan(capsys, "--from_profile", profile, "--compare_bench", str(path))
    assert code == 0 and "Predicted vs measured" in out and "-6%" in out and "noise floor" in out


@pytest.mark.parametrize("argv,flag,words", [
    (["--from_profile", "/no/such/train_summary.json"], "--from_profile", "no such file"),
    (["--from_profile", "{nocomm}"], "--from_profile", "--profile_comm"),
    (["--from_profile", "{one}"], "--from_profile", "1-process"),
    (["--from_profile", "{k1}"], "--from_profile", "no-sync"),
    (["--from_profile", "{ok}", "--busbw_GBps", "0"], "--busbw_GBps", "> 0"),
    (["--from_profile", "{ok}", "--busbw_GBps", "-3"], "--busbw_GBps", "> 0"),
    (["--from_profile", "{ok}", "--max_comm_share", "0"], "--max_comm_share", "> 0"),
    (["--from_profile", "{ok}", "--max_comm_share", "1"], "--max_comm_share", "< 1"),
    (["--from_profile", "{ok}", "--max_comm_share", "1.5"], "--max_comm_share", "< 1"),
    (["--from_profile", "{ok}", "--accumulation_steps", "0"], "--accumulation_steps", ">= 1"),
    (["--from_profile", "{ok}", "--num_machines", "0"], "--num_machines", ">= 1"),
    (["--from_profile", "{ok}", "--num_machines", "2", "--num_processes", "3"], "--num_processes", "evenly"),
    (["--from_profile", "{ok}", "--num_machines", "2", "--num_processes", "8", "--interconnect", "nvlink"],
     "--interconnect", "NVLink"),
    (["--from_profile", "{ok}", "--compare_bench", "/no/bench.json"], "--compare_bench", "no such file"),
    (["--num_machines", "2"], "--num_machines", "--from_profile"),
    (["--busbw_GBps", "50"], "--busbw_GBps", "--from_profile"),
])
def test_bad_input_exits_2(capsys, tmp_path, argv, flag, words):
    files = {"ok": write_summary(tmp_path), "nocomm": write_summary(tmp_path, None, "nocomm.json"),
             "one": write_summary(tmp_path, {**COMM, "world_size": 1, "allreduce_calls": 0, "syncs": 0,
                                             "allreduce_bytes": 0, "overlap_fraction": None}, "one.json"),
             "k1": write_summary(tmp_path, {**COMM, "backward_seconds_no_sync": None, "overlap_fraction": None},
                                 "k1.json")}
    code, out, err = plan(capsys, *[a.format(**files) for a in argv])
    assert code == 2 and out == ""
    assert err.startswith(f"error: {flag}:") and words in err, err
    with pytest.raises(UsageError):
        make_plan(1, **{"from_profile": files["ok"], "max_comm_share": 2.0})


def test_read_keys_exist_in_a_real_comm_block():
    # The profiler's own summary of synthetic records (2 steps of K = 2 on 2 processes) holds every key the
    # planner reads, and the planner loads what summarize_processes builds from it.
    from accum_kit.profiler.records import BucketCall, MicroBatchTimes, ProfileRecords, StepTimes
    from accum_kit.profiler.report import local_summary, summarize_processes

    rec = ProfileRecords()
    for step in range(2):
        for mb in range(2):
            sync = mb == 1
            rec.micro_batches.append(MicroBatchTimes(step, mb, sync, "no_sync", None, 0.01, 0.03 if sync else 0.02))
        rec.calls.append(BucketCall(step, 1, step, "no_sync", None, 0, 1000, 10.0 * step, 0.02))
        rec.steps.append(StepTimes(step, "no_sync", None, 0.005, 0.08))
    comm = summarize_processes(local_summary(rec, mode="no_sync", world_size=2, distributed=True), 1)
    assert set(COMM_KEYS) <= set(comm)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = load_profile(write_summary(Path(d), comm))
    # c = 0.01 + 0.02; 1000 B per sync; exposed 0.03 - 0.02 = 0.01, overlap 1 - 0.01 / 0.02 = 0.5;
    # o = 0.08 - 2 x 0.03 - 0.01 = 0.01.
    assert (p.compute_seconds, p.bytes_per_sync, p.gradient_accumulation_steps) == (pytest.approx(0.03), 1000, 2)
    assert p.overlap_fraction == pytest.approx(0.5) and p.other_seconds == pytest.approx(0.01)


def test_whatif_starts_without_torch(profile):
    code = (
        "import sys; from accum_kit.cli import main; "
        f"code = main(['plan', '--per_device_train_batch_size', '1', '--from_profile', {profile!r}, '--json']); "
        "heavy = sorted(m for m in ('torch', 'accelerate') if m in sys.modules); "
        "assert not heavy, heavy; sys.exit(code)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["whatif"]["k_for_max_comm_share"] == 5


# ---------------------------------------------------------------- batch size and K from the profile


def plan_argv(capsys, *argv):
    code = cli.run("plan", list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_batch_size_and_k_come_from_the_profile(capsys, tmp_path, monkeypatch):
    # The profiled run: B = 3, K = 2. The docs/whatif.md command gives neither flag.
    profile = write_summary(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=2)
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "5")  # the profile's K is the run's: not this
    code, out, err = plan_argv(capsys, "--from_profile", profile, "--num_machines", "2", "--num_processes", "8",
                               "--json")
    assert code == 0, err
    d = json.loads(out)
    b = d["batch"]
    assert (b["per_device_train_batch_size"], b["gradient_accumulation_steps"], b["num_processes"]) == (3, 2, 8)
    assert b["effective_batch_size"] == 48  # 3 x 2 x 8
    assert d["whatif"]["arithmetic"]["shown_for_K"] == 2
    # 8 processes: t_ar = 2 x 7/8 x 4e6 B / 0.2 GB/s = 0.035 s, e = 0.035 x 0.75 = 0.02625 s;
    # K = 1: step 0.03 + 0.02625 + 0.01 = 0.06625 s for 3 x 8 examples.
    assert d["whatif"]["rows"][0]["examples_per_second_no_sync"] == pytest.approx(24 / 0.06625)
    assert any(profile in note and "--per_device_train_batch_size 3" in note for note in d["notes"])
    code, out, _ = plan_argv(capsys, "--from_profile", profile, "--num_processes", "8")
    assert code == 0 and "--gradient_accumulation_steps 2 from" in out and "= 3 x 2 x 8" in out


def test_flags_override_the_profile(capsys, tmp_path):
    profile = write_summary(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=2)
    cases = [  # (flags, B, K): a flag given wins, the other value still comes from the profile
        (["--per_device_train_batch_size", "5"], 5, 2),
        (["--gradient_accumulation_steps", "6"], 3, 6),
        (["--per_device_train_batch_size", "5", "--gradient_accumulation_steps", "6"], 5, 6),
        (["--target_batch_size", "96"], 3, 4),  # K solved: 96 = 3 x 4 x 8 with B <= the profile's 3
        (["--accumulation_schedule", "0:1,10:4"], 3, 1),  # K from the schedule
    ]
    for flags, B, K in cases:
        code, out, err = plan_argv(capsys, "--from_profile", profile, "--num_processes", "8", "--json", *flags)
        assert code == 0, (flags, err)
        b = json.loads(out)["batch"]
        assert (b["per_device_train_batch_size"], b["gradient_accumulation_steps"]) == (B, K), flags
        assert b["effective_batch_size"] == B * K * 8
    code, out, _ = plan_argv(capsys, "--from_profile", profile, "--per_device_train_batch_size", "5",
                             "--gradient_accumulation_steps", "6")
    assert code == 0 and "from " + profile not in out  # nothing was taken from the profile


def test_batch_size_missing_everywhere_exits_2(capsys, tmp_path):
    profile = write_summary(tmp_path, per_device_train_batch_size=None)
    for argv in (["--from_profile", profile], ["--num_processes", "8"]):
        code, out, err = plan_argv(capsys, *argv)
        assert code == 2 and out == ""
        assert err.startswith("error: --per_device_train_batch_size:") and "Fix: pass" in err, err


def test_ddp_is_the_cost_tables_row_with_one_process_per_shard():
    """DDP read off the shared cost table: K syncs (or 1 with no_sync) of the whole gradient, no sharded collective."""
    from accum_kit.planning.ddp_costs import ddp_costs, syncs_per_window

    grad = 6_000_000.0
    for policy, syncs in (("sync_each_batch", 8), ("no_sync", 1)):
        c = ddp_costs(policy, world_size=4, accumulation_steps=8, gradient_bytes=grad)
        assert (c.all_reduce_calls, c.all_reduce_bytes) == (syncs, syncs * grad)
        assert (c.reduce_scatter_calls, c.all_gather_calls, c.shard_size) == (0, 0, 1)
        assert c.parameter_shard_bytes == grad and c.gradient_bytes == grad  # every process holds all of it
        assert syncs_per_window(policy, 8) == syncs
    assert ddp_costs("no_sync", world_size=1, accumulation_steps=8, gradient_bytes=grad).all_reduce_calls == 0
    # the what-if step times use those counts: K c + syncs e + o
    row = predict(8, 0.5, 0.25, 0.125)
    assert row.no_sync_step_seconds == pytest.approx(8 * 0.5 + 0.25 + 0.125)
    assert row.sync_each_batch_step_seconds == pytest.approx(8 * 0.5 + 8 * 0.25 + 0.125)
    with pytest.raises(UsageError, match="--accumulation_policy"):
        ddp_costs("no_sync_no_reshard", world_size=2, accumulation_steps=2, gradient_bytes=grad)
