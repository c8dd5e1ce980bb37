"""The one step-time model (accum_kit.planning.step_time) and the one bus-bandwidth function, against hand arithmetic.

Every expected value is worked out in the comments from the model's definition (docs/fsdp_costs.md,
docs/whatif.md) and nccl-tests' bus bandwidth (doc/PERFORMANCE.md: busbw = algbw x 2 (n-1)/n for an
all-reduce, x (n-1)/n for an all-gather or a reduce-scatter, x 1 for a broadcast), never from the code
under test. Torch-free.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from accum_kit.engines.costs import (
    ShardedModel,
    algorithm_bandwidth,
    bus_bandwidth,
    busbw_factor,
    collective_seconds,
    ddp_costs,
    policy_costs,
    zero_costs,
)
from accum_kit.engines.engine_layouts import engine_layouts, group_links
from accum_kit.planning.step_time import BusBandwidths, MeasuredCommunication, step_time, window_seconds

# A hand-sized model: two layer units of 100 parameters (resharded after forward) and one kept unit of 50.
# P = 250, P_f = 200, P_0 = 50, U_f = 2, U_0 = 1, U = 3.
LAYOUT = ShardedModel((100, 100), (50,))
KBPS = 1e-6  # 1e-6 GB/s = 1000 bytes per second: seconds are bytes / 1000 x the ring factor


def test_bus_bandwidth_factors_by_hand():
    # nccl-tests: 4 processes, algbw 10 GB/s -> all-reduce busbw 10 x 2 x 3/4 = 15, reduce-scatter and
    # all-gather 10 x 3/4 = 7.5, broadcast 10; one process sends nothing over a link: 0.
    assert bus_bandwidth(10.0, "all_reduce", 4) == pytest.approx(15.0)
    assert bus_bandwidth(10.0, "reduce_scatter", 4) == pytest.approx(7.5)
    assert bus_bandwidth(10.0, "all_gather", 4) == pytest.approx(7.5)
    assert bus_bandwidth(10.0, "broadcast", 4) == pytest.approx(10.0)
    assert bus_bandwidth(10.0, "all_reduce", 1) == 0.0 and busbw_factor("all_gather", 1) == 0.0
    assert algorithm_bandwidth(15.0, "all_reduce", 4) == pytest.approx(10.0)  # and back
    # 8 processes, 1e9 bytes all-reduced at busbw 100 GB/s: 1e9 x 2 x 7/8 / 100e9 = 0.0175 s
    assert collective_seconds(1e9, 8, 100.0, "all_reduce") == pytest.approx(0.0175)
    assert collective_seconds(1e9, 8, 100.0, "reduce_scatter") == pytest.approx(0.00875)
    for bad in (lambda: busbw_factor("gossip", 4), lambda: busbw_factor("all_reduce", 0),
                lambda: algorithm_bandwidth(1.0, "all_reduce", 1)):
        with pytest.raises(ValueError):
            bad()


def test_window_by_hand():
    # K = 4, c = 0.5, a = 0.1, 3 adds, T = 0.8 with a quarter hidden, o = 0.2:
    # compute 4 x (0.5 - 0.1) + 3 x 0.1 = 1.9; exposed 0.8 x 0.75 = 0.6; step 1.9 + 0.6 + 0.2 = 2.7
    st = window_seconds(4, 0.5, communication_seconds=0.8, overlap=0.25, other_seconds=0.2, accumulation_seconds=0.1,
                        held_adds=3)
    assert (st.compute_seconds, st.exposed_seconds, st.seconds) == (pytest.approx(1.9), pytest.approx(0.6),
                                                                    pytest.approx(2.7))
    # nothing but compute: K c
    assert window_seconds(3, 0.25).seconds == pytest.approx(0.75)
    # a measured mean K (the profiler's) may be fractional: 2.5 x 0.4 + 0.3 + 0.1 = 1.4
    assert window_seconds(2.5, 0.4, communication_seconds=0.3, other_seconds=0.1).seconds == pytest.approx(1.4)
    for kwargs in ({"overlap": 1.5}, {"overlap": -0.1}, {"held_adds": 5}, {"other_seconds": float("nan")}):
        with pytest.raises(ValueError):
            window_seconds(4, 0.5, **kwargs)
    with pytest.raises(ValueError):
        window_seconds(-1, 0.5)


def test_ddp_step_by_hand():
    # DDP, 4 processes, K = 8, 1e9 gradient bytes, 100 GB/s: one all-reduce 2 x 3/4 x 1e9 / 100e9 = 0.015 s.
    # c = 0.1, o = 0.05, half of it hidden: no_sync 8 x 0.1 + 0.0075 + 0.05 = 0.8575;
    # sync_each_batch 8 x 0.1 + 8 x 0.0075 + 0.05 = 0.91. Both hold the whole .grad: 7 adds each.
    link = BusBandwidths(replicate_GBps=100.0)
    ns, se = (ddp_costs(p, world_size=4, accumulation_steps=8, gradient_bytes=1e9)
              for p in ("no_sync", "sync_each_batch"))
    assert (ns.syncs, se.syncs, ns.held_gradient_adds, se.held_gradient_adds) == (1, 8, 7, 7)
    assert step_time(ns, 0.1, link, overlap=0.5, other_seconds=0.05).seconds == pytest.approx(0.8575)
    assert step_time(se, 0.1, link, overlap=0.5, other_seconds=0.05).seconds == pytest.approx(0.91)
    # with a = 0.02 measured: both pay 8 x 0.08 + 7 x 0.02 = 0.78 of compute (the same for both policies)
    assert step_time(ns, 0.1, link, accumulation_seconds=0.02).compute_seconds == pytest.approx(0.78)
    assert step_time(se, 0.1, link, accumulation_seconds=0.02).compute_seconds == pytest.approx(0.78)
    # measured per sync (the bench's ideal): K c + syncs a = 8 x 0.1 + 0.04 and 8 x 0.1 + 8 x 0.04
    assert step_time(ns, 0.1, MeasuredCommunication(0.04)).seconds == pytest.approx(0.84)
    assert step_time(se, 0.1, MeasuredCommunication(0.04)).seconds == pytest.approx(1.12)


def test_fsdp2_and_hsdp_steps_by_hand():
    # W = 2, K = 3, fp32, 1000 B/s per link; c = 1, a = 0.2, o = 0.3.
    # no_sync: reduce-scatter U = 3 calls of P x 4 = 1000 B -> 1000 x 1/2 / 1000 = 0.5 s; all-gathers
    # K (2 P_f + P_0) x 4 = 3 x 450 x 4 = 5400 B -> 2.7 s; T = 3.2. It holds the unsharded gradient: 2 adds,
    # compute 3 x 0.8 + 2 x 0.2 = 2.8; step 2.8 + 3.2 + 0.3 = 6.3.
    link = BusBandwidths(shard_GBps=KBPS, replicate_GBps=KBPS)
    ns = policy_costs("no_sync", LAYOUT, world_size=2, accumulation_steps=3)
    assert step_time(ns, 1.0, link, accumulation_seconds=0.2, other_seconds=0.3).seconds == pytest.approx(6.3)
    # sync_each_batch: K x 1000 B reduce-scattered -> 1.5 s; all-gathers 2.7 s; no add into a held unsharded
    # gradient: compute 3 x 0.8 = 2.4; step 2.4 + 4.2 + 0.3 = 6.9.
    se = policy_costs("sync_each_batch", LAYOUT, world_size=2, accumulation_steps=3)
    assert step_time(se, 1.0, link, accumulation_seconds=0.2, other_seconds=0.3).seconds == pytest.approx(6.9)
    # no_sync_no_reshard: all-gathers U = 3 of P x 4 = 1000 B -> 0.5 s; T = 1.0; step 2.8 + 1.0 + 0.3 = 4.1
    nr = policy_costs("no_sync_no_reshard", LAYOUT, world_size=2, accumulation_steps=3)
    assert step_time(nr, 1.0, link, accumulation_seconds=0.2, other_seconds=0.3).seconds == pytest.approx(4.1)
    # HSDP, 2 replicas x 2 shards, reduce_scatter_each_batch: reduce-scatters 3 x 1000 B over 2 -> 1.5 s,
    # all-reduce of the 1000 / 2 = 500 B shard once over 2 replicas -> 2 x 1/2 x 500 / 1000 = 0.5 s,
    # all-gathers 2.7 s; the shards are summed, nothing unsharded is held: compute 2.4; step 2.4 + 4.7 + 0.3 = 7.4.
    rs = policy_costs("reduce_scatter_each_batch", LAYOUT, world_size=4, accumulation_steps=3, replicate_size=2)
    assert (rs.syncs, rs.held_gradient_adds) == (1, 0)
    assert step_time(rs, 1.0, link, accumulation_seconds=0.2, other_seconds=0.3).seconds == pytest.approx(7.4)


def test_zero_stages_adds_and_syncs():
    # ZeRO-1 all-reduces once per window and sums into the full .grad (K - 1 adds), ZeRO-2 reduces every
    # micro-batch to a partition (K syncs, no add). Priced per sync at 0.1 s, K = 4, c = 1, a = 0.25:
    # ZeRO-1 4 x 0.75 + 3 x 0.25 + 0.1 = 3.85; ZeRO-2 4 x 0.75 + 4 x 0.1 = 3.4.
    z1, z2 = (zero_costs(s, 1000, world_size=2, accumulation_steps=4) for s in ("zero1", "zero2"))
    assert (z1.syncs, z1.held_gradient_adds, z2.syncs, z2.held_gradient_adds) == (1, 3, 4, 0)
    assert step_time(z1, 1.0, MeasuredCommunication(0.1), accumulation_seconds=0.25).seconds == pytest.approx(3.85)
    assert step_time(z2, 1.0, MeasuredCommunication(0.1), accumulation_seconds=0.25).seconds == pytest.approx(3.4)
    assert zero_costs("zero3", 1000, world_size=2, accumulation_steps=4).comm_is_floor


def test_engine_meshes_and_links_from_the_table():
    # 8 processes on 2 machines (4 each): FSDP2's shard group (all 8) spans the machines, HSDP's (4 consecutive)
    # does not; every all-reduce group of several processes crosses them.
    layouts = {e.engine: e for e in engine_layouts(8, 2)}
    assert {k: (v.replicate_size, v.shard_size) for k, v in layouts.items()} == {
        "DDP": (8, 1), "FSDP2": (1, 8), "HSDP": (2, 4), "DeepSpeed": (1, 8)}
    assert set(layouts["DDP"].policies) == {"no_sync", "sync_each_batch"}
    fsdp = policy_costs("no_sync", LAYOUT, world_size=8, accumulation_steps=2)
    hsdp = policy_costs("no_sync", LAYOUT, world_size=8, accumulation_steps=2, replicate_size=2)
    assert group_links(fsdp, 2)["shard"] == "inter"
    assert group_links(hsdp, 2) == {"shard": "intra", "all_reduce": "inter"}
    assert "HSDP" not in {e.engine for e in engine_layouts(8, 1)}


def test_ddp_is_priced_alike_by_the_whatif_and_the_engine_comparison(tmp_path):
    """The what-if planner and plan --fsdp's engine comparison read DDP from the same row: same syncs, same
    all-reduce seconds, and with a profile the same compute for both policies (DDP holds the whole .grad)."""
    from accum_kit.planning.measured_profile import load_profile
    from accum_kit.planning.topology import compare_engines

    # FSDP2 profile: c = 0.1, a = 0.02, K_p = 4, exposed 0.3 s per step, step 0.8 s:
    # o = 0.8 - (4 x 0.08 + 3 x 0.02) - 0.3 = 0.12
    comm = {"world_size": 2, "optimizer_steps": 10, "micro_batches": 40, "reduce_scatter_calls": 40,
            "reduce_scatter_bytes": 4e7, "syncs": 10, "backward_seconds_no_sync": 0.05, "compute_seconds": 0.1,
            "accumulation_seconds": 0.02, "exposed_comm_seconds": 0.02, "all_gather_busbw_GBps": 0.2,
            "exposed_comm_seconds_per_step": 0.3, "optimizer_seconds": 0.05, "seconds_per_step": 0.8}
    path = tmp_path / "train_summary.json"
    path.write_text(json.dumps({"comm": comm}))
    profile = load_profile(str(path), "sharded")
    assert profile.other_seconds == pytest.approx(0.12) and profile.collectives == "sharded"
    cmp = compare_engines(LAYOUT, world=4, machines=1, K=8, element_bytes=(4, 4, 4), intra_GBps=KBPS,
                          inter_GBps=KBPS, profile=profile)
    rows = {(r["engine"], r["policy"]): r for r in cmp["rows"]}
    # DDP over 4 at 1000 B/s: one all-reduce of P x 4 = 1000 B is 2 x 3/4 x 1000 / 1000 = 1.5 s; no_sync 1 per
    # window, sync_each_batch 8; compute 8 x 0.08 + 7 x 0.02 = 0.78 for both; o = 0.12.
    assert rows[("DDP", "no_sync")]["all_reduce_calls"] == 1
    assert rows[("DDP", "sync_each_batch")]["all_reduce_calls"] == 8
    assert rows[("DDP", "no_sync")]["step_seconds"] == pytest.approx(0.78 + 1.5 + 0.12)
    assert rows[("DDP", "sync_each_batch")]["step_seconds"] == pytest.approx(0.78 + 12.0 + 0.12)
    ddp = ddp_costs("sync_each_batch", world_size=4, accumulation_steps=8, gradient_bytes=1000)
    assert rows[("DDP", "sync_each_batch")]["comm"]["all_reduce"] == pytest.approx(
        BusBandwidths(replicate_GBps=KBPS).seconds(ddp)["all_reduce"])


def test_bench_ideal_is_compute_plus_what_no_sync_cannot_skip():
    from accum_kit.bench.report import ideal_speedup, ideal_step_seconds

    # K = 8, c = 0.2, a = 0.05: no_sync 1.6 + 0.05 = 1.65; sync_each_batch 1.6 + 8 x 0.05 = 2.0
    assert ideal_step_seconds("no_sync", 8, 0.2, 0.05) == pytest.approx(1.65)
    assert ideal_step_seconds("sync_each_batch", 8, 0.2, 0.05) == pytest.approx(2.0)
    assert ideal_speedup(8, 0.2, 0.05) == pytest.approx(2.0 / 1.65)


def test_the_model_loads_without_the_command_or_torch():
    code = ("import sys; import accum_kit.planning.step_time; "
            "loaded = sorted(m for m in ('torch', 'tabulate', 'accum_kit.planning.plan_command') if m in sys.modules); "
            "assert not loaded, loaded")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
