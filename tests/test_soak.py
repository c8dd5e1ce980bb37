"""The soak benchmark, short: what a run keeps stays bounded (counts and sizes, never times).

One 2-process FSDP2 run of benchmarks/soak.py (a script run of conftest.py's shared ``fsdp_pool`` launch): 40 optimizer steps at K=4
with the profiler keeping at most 20 raw records of each kind, a checkpoint
every 10 steps (2 kept), a sample every 10 steps. Oracles: the step and
micro-batch counts the flags imply, and the keep_records bound.
"""

from __future__ import annotations

import json

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
