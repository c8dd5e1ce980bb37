"""The soak benchmark, short: what a run keeps stays bounded (counts and sizes, never times).

One 2-process FSDP2 run of benchmarks/soak.py (a script run of conftest.py's shared ``fsdp_pool`` launch): 40 optimizer steps at K=4
with the profiler keeping at most 20 raw records of each kind, a checkpoint
every 10 steps (2 kept), a sample every 10 steps. Oracles: the step and
micro-batch counts the flags imply, and the keep_records bound.
"""

from __future__ import annotations

import json

import pytest

import job_helpers as jh

STEPS, K, KEEP, EVERY, SAMPLE = 40, 4, 20, 10, 10


def test_short_soak_keeps_bounded_records_and_a_constant_loop_state(tmp_path, fsdp_pool):
    out = tmp_path / "soak"
    res = fsdp_pool.submit("soak", ["--steps", STEPS, "--K", K, "--keep_records", KEEP, "--checkpoint_every", EVERY,
                                    "--sample_every", SAMPLE, "--block_steps", "10", "--no_tracker", "--output_dir", out],
                           script=jh.REPO / "benchmarks" / "soak.py").result()
    assert res.returncode == 0, res.describe()
    report = json.loads((out / "soak.json").read_text())
    assert report["steps"] == STEPS and "FSDP" in report["distributed_type"]
    counted = report["profiler_calls_counted"]
    # the whole run's figures count every micro-batch and step ...
    assert (counted["optimizer_steps"], counted["micro_batches"]) == (STEPS, STEPS * K)
    assert counted["all_gather_calls"] > KEEP and counted["reduce_scatter_calls"] > KEEP
    # ... while the raw records kept never pass the bound
    samples = report["samples"]
    assert [s["step"] for s in samples] == list(range(SAMPLE, STEPS + 1, SAMPLE))
    for s in samples:
        assert all(0 <= n <= KEEP for n in s["records_kept"].values()), s
    assert samples[-1]["records_kept"] == {"calls": 0, "micro_batches": KEEP, "steps": KEEP, "collectives": KEEP}
    # the loop state does not grow with the step count (the history is in chunks beside it)
    sizes = [s["loop_state_bytes"] for s in samples if s["loop_state_bytes"] is not None]
    assert len(sizes) >= 3 and max(sizes) - min(sizes) <= 8, sizes
    assert [t["name"] for t in report["checkpoint_saves"]] == [f"step_{n}" for n in range(EVERY, STEPS + 1, EVERY)]
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == [f"step_{STEPS - EVERY}", f"step_{STEPS}"]
    assert len(list((out / "checkpoints" / f"step_{STEPS}" / "history").iterdir())) == STEPS // EVERY


def test_step_time_trend_is_the_least_squares_slope_with_a_t_interval():
    """The soak's trend over block medians against numpy's polyfit (slope) and a textbook t-interval."""
    import importlib.util

    import numpy as np

    from accum_kit.stats import t_quantile

    spec = importlib.util.spec_from_file_location("soak_script", jh.REPO / "benchmarks" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    rng = np.random.default_rng(0)
    block, n = 100, 7
    # step 1 is left out; then 7 blocks whose medians rise 1 ms a block around 50 ms, with noise
    times = [9.0] + [0.050 + 0.001 * (i // block) + rng.normal(0, 2e-4) for i in range(n * block)]
    got = soak.block_trend(times, block)
    med = np.array([np.median(times[1 + i * block:1 + (i + 1) * block]) * 1e3 for i in range(n)])
    x = (np.arange(n) + 0.5) * block
    slope, icept = np.polyfit(x, med, 1)
    resid = med - (slope * x + icept)
    se = np.sqrt(resid @ resid / (n - 2) / ((x - x.mean()) ** 2).sum())
    scale = 1e6 / med[0]
    assert np.allclose(got["block_median_ms"], med)
    assert got["percent_per_10000_steps"] == pytest.approx(slope * scale, rel=1e-9)
    half = t_quantile(0.975, n - 2) * se * scale
    assert (got["low"], got["high"]) == pytest.approx((slope * scale - half, slope * scale + half), rel=1e-9)
    assert got["low"] > 0  # a rise of 2 % a block is found
    assert soak.block_trend(times[:2 * block + 1], block) is None  # fewer than 3 blocks
