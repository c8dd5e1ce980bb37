"""The engine object and the run plan, in-process: which engine a launch asks for, what the plan changes in
Accelerate when a run switches K or the policy, what a DDP window costs, and that no module outside
``engines/`` and ``compat/`` asks which engine it runs under.

The engines' behaviour under a real launch (every FSDP2 and HSDP policy, every ZeRO stage, a user's loop
run unchanged under each) is tested by test_fsdp.py, test_hsdp.py and test_deepspeed.py.
"""

from __future__ import annotations

import re
import subprocess

import pytest

import job_helpers as jh


@pytest.mark.parametrize("env,name", [
    ({}, "ddp"),
    ({"ACCELERATE_USE_FSDP": "true"}, "fsdp2"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "deepspeed"),
    ({"ACCELERATE_USE_FSDP": "false", "ACCELERATE_USE_DEEPSPEED": "False"}, "ddp"),
])
def test_the_engine_a_launch_asks_for(monkeypatch, env, name):
    """What accelerate launch exports for each config decides the engine (torch-free)."""
    from accum_kit.engines import requested_engine_name

    for var in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert requested_engine_name() == name


def test_deepspeed_and_fsdp_together_are_refused(monkeypatch):
    from accum_kit import UsageError
    from accum_kit.engines import requested_engine_name

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UsageError) as err:
        requested_engine_name(deepspeed_plugin=object())
    assert err.value.flag == "--use_deepspeed"


def test_the_run_plan_is_the_one_writer_of_k_and_the_policy(accelerator):
    """K and the policy change through the plan, and Accelerate's own copy (what accumulate() reads) follows."""
    from accum_kit import UsageError
    from accum_kit.compat import sync_each_batch

    acc = accelerator(3)
    plan = acc.run_plan
    assert plan.engine.name == "ddp" and plan.first_accumulation_steps == 3 == acc.gradient_accumulation_steps
    assert plan.policy.name == plan.requested_policy.name == "no_sync" and acc.accumulation_policy is plan.policy
    acc.step = 5  # mid-window in an earlier loop: a switch must open a fresh window
    plan.set_accumulation_steps(4)
    assert acc.gradient_accumulation_steps == 4 and acc.gradient_state.plugin_kwargs["num_steps"] == 4 and acc.step == 0
    assert plan.use_policy("sync_each_batch") == "no_sync"
    assert acc.gradient_state.plugin_kwargs["sync_each_batch"] is True and plan.policy.name == "sync_each_batch"
    assert plan.requested_policy.name == "no_sync"  # what the run asked for is kept for its summaries
    with plan.policy_in_force("no_sync"):
        assert sync_each_batch(acc, distributed_only=False) is False
    assert plan.policy.name == "sync_each_batch"  # put back after the block
    with pytest.raises(UsageError) as err:
        plan.use_policy("no_sync_no_reshard")  # an FSDP2 policy under DDP
    assert err.value.flag == "--accumulation_policy"
    with pytest.raises(UsageError):
        plan.set_accumulation_steps(0)


def test_a_schedule_is_checked_once_and_kept_on_the_plan(accelerator, monkeypatch):
    from accum_kit import UsageError, build_accelerator

    for var in jh.LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    jh.reset_accelerate_state()
    acc = build_accelerator(None, cpu=True, accumulation_schedule={0: 1, 2: 3})
    assert acc.run_plan.schedule == {0: 1, 2: 3} and acc.run_plan.first_accumulation_steps == 1
    jh.reset_accelerate_state()
    with pytest.raises(UsageError) as err:
        build_accelerator(None, cpu=True, accumulation_schedule={1: 2})  # no entry for step 0
    assert err.value.flag == "--accumulation_schedule"


@pytest.mark.parametrize("policy,syncs", [("no_sync", 1), ("sync_each_batch", 4)])
def test_a_ddp_window_costs_one_whole_gradient_per_sync(policy, syncs):
    """The DDP engine's window from the cost table, against the count by hand: a 3 x 2 linear layer with bias
    (8 fp32 parameters, 32 bytes) on 2 processes, all-reduced once per synchronised backward, K = 4; on one
    process nothing is sent."""
    from types import SimpleNamespace

    import torch

    from accum_kit.engines.ddp import DDPEngine

    model = torch.nn.Linear(3, 2)
    costs = DDPEngine().window_costs(SimpleNamespace(num_processes=2), model, 4, policy)
    assert (costs.all_reduce_calls, costs.all_reduce_bytes) == (syncs, syncs * 32)
    assert costs.gradient_bytes == 32 and costs.reduce_scatter_calls == costs.all_gather_calls == 0
    alone = DDPEngine().window_costs(SimpleNamespace(num_processes=1), model, 4, policy)
    assert alone.all_reduce_calls == 0 and alone.all_reduce_bytes == 0


def test_no_module_outside_engines_and_compat_asks_which_engine_it_runs_under():
    """The architecture's rule, read from the source: engine checks live in accum_kit/engines and compat only."""
    out = subprocess.run(["git", "grep", "-n", "-i", "-E", r"^\s*(el)?if .*(deepspeed|fsdp|hsdp|zero_stage|is_zero)",
                          "--", "accum_kit", ":!accum_kit/engines", ":!accum_kit/compat"],
                         cwd=jh.REPO, capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr  # 1: nothing found
    assert out.stdout == "", f"engine checks outside engines/ and compat/:\n{out.stdout}"
    pattern = re.compile(r"getattr\([^)]*\"(deepspeed_plugin|is_fsdp2)\"|\.is_fsdp2\b|DistributedType\.(FSDP|DEEPSPEED)"
                         r"|__name__ == \"DeepSpeedEngine\"")
    offenders = []
    for path in sorted((jh.REPO / "accum_kit").rglob("*.py")):
        rel = path.relative_to(jh.REPO / "accum_kit").parts
        if rel[0] in ("engines", "compat"):
            continue
        offenders += [f"{path.relative_to(jh.REPO)}:{i}: {line.strip()}"
                      for i, line in enumerate(path.read_text().splitlines(), 1)
                      if pattern.search(line) and not line.lstrip().startswith("#")]
    assert not offenders, "\n".join(offenders)
