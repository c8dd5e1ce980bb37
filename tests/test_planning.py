"""Tests of accum_kit.planning against hand arithmetic and against Accelerate itself.

Expected values are worked out by hand in the comments (or come from
Accelerate's own sampler / accumulation logic), never from the planning code.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from accum_kit import cli
from accum_kit.errors import UsageError
from accum_kit.planning import (
    make_plan,
    plan_batch,
    scale_learning_rate,
    solve_accumulation_steps,
)

ENV_K = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"


@pytest.fixture(autouse=True)
def no_launcher_k(monkeypatch):
    """K from the environment would change the default K these tests rely on."""
    monkeypatch.delenv(ENV_K, raising=False)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.run("plan", list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------- batch plan


def test_eight_processes_no_accumulation_800_examples():
    # 2 nodes x 4 GPUs, B=1, K=1: 1*1*8 = 8 per step; 800 / 8 = 100 micro-batches per
    # process, one optimizer step each; 800 is a multiple of 8, so no padding.
    plan = plan_batch(1, 1, 8, 800)
    assert plan.effective_batch_size == 8
    assert plan.micro_batches_per_process == 100
    assert plan.optimizer_steps_per_epoch == 100
    assert plan.examples_padded == 0
    assert plan.examples_dropped == 0
    assert plan.last_step_is_partial is False


def test_partial_last_window():
    # B=4, P=2: a global micro-batch is 8 examples; 50 examples -> ceil(50/8) = 7
    # micro-batches per process; K=3 -> windows of 3,3,1 -> 3 optimizer steps, the
    # last with 1 micro-batch = 8 examples (6 of them padding: 7*8 - 50 = 6).
    plan = plan_batch(4, 3, 2, 50)
    assert plan.effective_batch_size == 24
    assert plan.micro_batches_per_process == 7
    assert plan.optimizer_steps_per_epoch == 3
    assert plan.last_step_micro_batches == 1
    assert plan.last_step_examples == 8
    assert plan.last_step_is_partial is True
    assert plan.examples_padded == 6


def test_padding_count():
    # B=32, K=4, P=8: global micro-batch 256; 100000 / 256 = 390.625 -> 391 micro-batches,
    # 391 * 256 = 100096 slots -> 96 padded; steps ceil(391/4) = 98; last window 391 - 97*4 = 3.
    plan = plan_batch(32, 4, 8, 100_000)
    assert plan.effective_batch_size == 1024
    assert plan.micro_batches_per_process == 391
    assert plan.examples_per_epoch == 100_096
    assert plan.examples_padded == 96
    assert plan.optimizer_steps_per_epoch == 98
    assert plan.last_step_micro_batches == 3


def test_drop_last_counts_dropped_examples():
    # B=4, P=2, 50 examples: floor(50/8) = 6 micro-batches, 48 used, 2 dropped; K=3 -> 2 full steps.
    plan = plan_batch(4, 3, 2, 50, drop_last=True)
    assert plan.micro_batches_per_process == 6
    assert plan.examples_dropped == 2
    assert plan.examples_padded == 0
    assert plan.optimizer_steps_per_epoch == 2
    assert plan.last_step_is_partial is False


def test_fewer_examples_than_one_global_batch():
    # B=4, P=4: 16 slots, 10 examples -> 1 micro-batch each, 6 padded (repeats).
    plan = plan_batch(4, 2, 4, 10)
    assert (plan.micro_batches_per_process, plan.examples_padded, plan.optimizer_steps_per_epoch) == (1, 6, 1)
    with pytest.raises(UsageError) as err:
        plan_batch(4, 2, 4, 10, drop_last=True)
    assert err.value.flag == "--num_examples"


@pytest.mark.parametrize(
    "n, b, p, drop_last",
    [(800, 1, 8, False), (50, 4, 2, False), (50, 4, 2, True), (10, 4, 4, False), (1001, 3, 5, False), (1001, 3, 5, True)],
)
def test_counts_match_accelerate_batch_sampler_shard(n, b, p, drop_last):
    """Oracle: Accelerate's own BatchSamplerShard, iterated for every process."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    per_process, seen = [], []
    for rank in range(p):
        shard = BatchSamplerShard(
            BatchSampler(SequentialSampler(range(n)), b, drop_last), num_processes=p, process_index=rank
        )
        batches = list(shard)
        per_process.append(len(batches))
        seen += [i for batch in batches for i in batch]
    plan = plan_batch(b, 1, p, n, drop_last=drop_last)
    assert per_process == [plan.micro_batches_per_process] * p
    assert len(seen) - len(set(seen)) == plan.examples_padded
    assert n - len(set(seen)) == plan.examples_dropped


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_steps_per_epoch_match_accelerate_sync(fresh_accelerate_state):
    """Oracle: the optimizer-step boundaries Accelerate signals on a prepared dataloader (1 process, CPU)."""
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model = torch.nn.Linear(1, 1)
    loader = torch.utils.data.DataLoader(torch.zeros(28, 1), batch_size=4)  # 7 micro-batches
    model, loader = accelerator.prepare(model, loader)
    boundaries = []
    for batch in loader:
        with accelerator.accumulate(model):
            boundaries.append(accelerator.sync_gradients)
    assert boundaries == [False, False, True, False, False, True, True]  # windows 3, 3, 1
    plan = plan_batch(4, 3, 1, 28)
    assert plan.optimizer_steps_per_epoch == sum(boundaries) == 3
    assert plan.last_step_micro_batches == 1


@pytest.mark.parametrize("n,b,k", [(10, 4, 3), (30, 4, 3), (9, 2, 2)])
def test_one_process_pads_nothing(fresh_accelerate_state, n, b, k):
    """Oracle: a prepared 1-process DataLoader, whose last micro-batch is short (no BatchSamplerShard padding)."""
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
    model = torch.nn.Linear(1, 1)
    model, loader = accelerator.prepare(model, torch.utils.data.DataLoader(torch.arange(n).view(n, 1), batch_size=b))
    windows, current = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            current += batch.view(-1).tolist()
            if accelerator.sync_gradients:
                windows.append(current)
                current = []
    seen = [x for w in windows for x in w]
    plan = plan_batch(b, k, 1, n)
    assert sorted(seen) == list(range(n))  # every example once, none repeated
    assert plan.examples_padded == 0 and plan.examples_per_epoch == len(seen)
    assert plan.optimizer_steps_per_epoch == len(windows)
    assert plan.last_step_examples == len(windows[-1])


# ---------------------------------------------------------------- learning rate


def test_sqrt_and_linear_scaling_512_to_1024():
    sqrt = scale_learning_rate(1e-4, 512, 1024, "sqrt")
    linear = scale_learning_rate(1e-4, 512, 1024, "linear")
    none = scale_learning_rate(1e-4, 512, 1024, "none")
    assert sqrt.multiplier == pytest.approx(math.sqrt(2))
    assert sqrt.learning_rate == pytest.approx(1.4142135623730951e-4)
    assert linear.learning_rate == pytest.approx(2e-4)
    assert none.learning_rate == pytest.approx(1e-4)
    assert "Goyal" in linear.source and "Krizhevsky" in sqrt.source and "Hoffer" in sqrt.source
    assert not (sqrt.warmup_suggested or linear.warmup_suggested)


def test_warmup_suggested_for_large_scale_up():
    # 256 -> 8192 is k = 32: linear x32 and sqrt x5.66 both exceed 4; none (x1) does not.
    # 10 steps/epoch -> 5 warmup epochs = 50 steps.
    linear = scale_learning_rate(0.1, 256, 8192, "linear", steps_per_epoch=10)
    assert linear.learning_rate == pytest.approx(3.2)
    assert (linear.warmup_suggested, linear.warmup_epochs, linear.warmup_steps) == (True, 5, 50)
    assert scale_learning_rate(0.1, 256, 8192, "sqrt").warmup_suggested
    assert not scale_learning_rate(0.1, 256, 8192, "none").warmup_suggested
    # 256 -> 1024 linear is exactly x4: not above the threshold.
    assert not scale_learning_rate(0.1, 256, 1024, "linear").warmup_suggested


def test_scaling_down_lowers_the_rate():
    assert scale_learning_rate(1e-3, 1024, 256, "linear").learning_rate == pytest.approx(2.5e-4)
    assert scale_learning_rate(1e-3, 1024, 256, "sqrt").learning_rate == pytest.approx(5e-4)


def test_cli_512_to_1024_sqrt(capsys):
    # 32 x 4 x 8 = 1024
    code, out, _ = run(capsys, "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "4",
                       "--num_processes", "8", "--base_learning_rate", "1e-4", "--base_batch_size", "512",
                       "--lr_scaling", "sqrt", "--json")
    assert code == 0
    data = json.loads(out)
    assert [r["rule"] for r in data["learning_rates"]] == ["sqrt"]
    assert data["learning_rates"][0]["learning_rate"] == pytest.approx(1e-4 * math.sqrt(2))


def test_cli_prints_all_three_rules_by_default(capsys):
    code, out, _ = run(capsys, "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "4",
                       "--num_processes", "8", "--base_learning_rate", "1e-4", "--base_batch_size", "512")
    assert code == 0
    for text in ("none", "linear", "sqrt", "0.0002", "0.000141421", "Goyal", "Krizhevsky", "Hoffer", "warmup"):
        assert text in out


# ---------------------------------------------------------------- solving for K


def test_solve_target_256():
    # 256 / 4 processes = 64 per process; 16 divides 64 -> B=16, K=4.
    sol = solve_accumulation_steps(256, 16, 4)
    assert (sol.per_device_train_batch_size, sol.gradient_accumulation_steps) == (16, 4)
    assert sol.note is None


def test_solve_prefers_largest_divisor_below_max():
    # 240 / 4 = 60 per process; divisors of 60 up to 16: 1,2,3,4,5,6,10,12,15 -> B=15, K=4.
    sol = solve_accumulation_steps(240, 16, 4)
    assert (sol.per_device_train_batch_size, sol.gradient_accumulation_steps) == (15, 4)
    assert "15" in sol.note and "192" in sol.note and "256" in sol.note  # multiples of 16*4 around 240
    # max larger than needed: 8 / 4 = 2 per process -> B=2, K=1.
    sol = solve_accumulation_steps(8, 16, 4)
    assert (sol.per_device_train_batch_size, sol.gradient_accumulation_steps) == (2, 1)


def test_solve_not_divisible_lists_nearest_sizes():
    # 250 is not a multiple of 4: nearest reachable 248 (62 = 2*31 -> B=2, K=31) and 252 (63 = 9*7 -> B=9, K=7);
    # with B=16 (multiples of 64): 192 and 256.
    with pytest.raises(UsageError) as err:
        solve_accumulation_steps(250, 16, 4)
    assert err.value.flag == "--target_batch_size"
    msg = str(err.value)
    for text in ("248 (B=2, K=31)", "252 (B=9, K=7)", "192 (B=16, K=3)", "256 (B=16, K=4)"):
        assert text in msg


def test_solve_target_below_process_count():
    with pytest.raises(UsageError) as err:
        solve_accumulation_steps(3, 16, 4)
    assert "4 (B=1, K=1)" in str(err.value)


def test_cli_target(capsys):
    code, out, _ = run(capsys, "--target_batch_size", "256", "--per_device_train_batch_size", "16",
                       "--num_processes", "4", "--num_examples", "1000", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["solution"]["per_device_train_batch_size"] == 16
    assert data["solution"]["gradient_accumulation_steps"] == 4
    # 1000 / 64 = 15.625 -> 16 micro-batches, 1024 - 1000 = 24 padded, ceil(16/4) = 4 steps.
    assert data["batch"]["effective_batch_size"] == 256
    assert data["batch"]["optimizer_steps_per_epoch"] == 4
    assert data["batch"]["examples_padded"] == 24


def test_cli_target_not_divisible_exit_2(capsys):
    code, out, err = run(capsys, "--target_batch_size", "250", "--per_device_train_batch_size", "16",
                         "--num_processes", "4")
    assert code == 2 and out == ""
    assert err.startswith("error: --target_batch_size") and "248" in err and "252" in err


# ---------------------------------------------------------------- command line


def test_cli_text_output(capsys):
    code, out, _ = run(capsys, "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
                       "--num_processes", "8", "--num_examples", "800")
    assert code == 0
    assert "effective batch size         8" in out
    assert "optimizer steps per epoch    100" in out


def test_cli_text_mentions_partial_last_step(capsys):
    code, out, _ = run(capsys, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "3",
                       "--num_processes", "2", "--num_examples", "50")
    assert code == 0
    assert "PARTIAL: 1 of 3 micro-batches" in out
    assert "fewer than K=3" in out


def test_cli_json_parses(capsys):
    code, out, _ = run(capsys, "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
                       "--num_processes", "8", "--num_examples", "800", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["batch"]["effective_batch_size"] == 8
    assert data["batch"]["optimizer_steps_per_epoch"] == 100
    assert data["solution"] is None and data["learning_rates"] == []


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
        (["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps"),
        (["--per_device_train_batch_size", "2", "--num_processes", "-8"], "--num_processes"),
        (["--per_device_train_batch_size", "2", "--num_examples", "0"], "--num_examples"),
        (["--per_device_train_batch_size", "2", "--target_batch_size", "0"], "--target_batch_size"),
        (["--per_device_train_batch_size", "2", "--target_batch_size", "8", "--gradient_accumulation_steps", "2"],
         "--gradient_accumulation_steps"),
        (["--per_device_train_batch_size", "2", "--base_learning_rate", "1e-4"], "--base_batch_size"),
        (["--per_device_train_batch_size", "2", "--base_batch_size", "256"], "--base_learning_rate"),
        (["--per_device_train_batch_size", "2", "--lr_scaling", "sqrt"], "--lr_scaling"),
        (["--per_device_train_batch_size", "2", "--base_learning_rate", "-1", "--base_batch_size", "8"],
         "--base_learning_rate"),
        (["--per_device_train_batch_size", "2", "--base_learning_rate", "nan", "--base_batch_size", "8"],
         "--base_learning_rate"),
        (["--per_device_train_batch_size", "2", "--base_learning_rate", "1e-4", "--base_batch_size", "0"],
         "--base_batch_size"),
        (["--per_device_train_batch_size", "4", "--num_processes", "4", "--num_examples", "10", "--drop_last"],
         "--num_examples"),
    ],
)
def test_bad_input_exit_2_names_flag(capsys, argv, flag):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith(f"error: {flag}:")
    assert "Fix:" in err


@pytest.mark.parametrize(
    "argv",
    [
        [],  # --per_device_train_batch_size is required
        ["--per_device_train_batch_size", "two"],
        ["--per_device_train_batch_size", "2", "--lr_scaling", "cubic"],
    ],
)
def test_argparse_errors_return_2(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert "error:" in err


def test_make_plan_python_api():
    report = make_plan(16, num_processes=4, target_batch_size=256, base_learning_rate=0.1, base_batch_size=256)
    assert report.solution.gradient_accumulation_steps == 4
    assert [r.multiplier for r in report.learning_rates] == [1.0, 1.0, 1.0]
    assert json.loads(json.dumps(report.to_dict()))["batch"]["effective_batch_size"] == 256


# ---------------------------------------------------------------- default K and start-up


def test_default_k_is_the_train_rule(capsys, monkeypatch):
    # No flag, no environment: K = 4 -> 1 x 4 x 8 = 32 per step; 800 / 8 = 100 micro-batches, ceil(100/4) = 25 steps.
    code, out, _ = run(capsys, "--per_device_train_batch_size", "1", "--num_processes", "8",
                       "--num_examples", "800", "--json")
    assert code == 0
    batch = json.loads(out)["batch"]
    assert (batch["gradient_accumulation_steps"], batch["effective_batch_size"]) == (4, 32)
    assert batch["optimizer_steps_per_epoch"] == 25
    # The launcher's K beats the default: K = 5 -> 40 per step, ceil(100/5) = 20 steps.
    monkeypatch.setenv(ENV_K, "5")
    code, out, _ = run(capsys, "--per_device_train_batch_size", "1", "--num_processes", "8",
                       "--num_examples", "800", "--json")
    assert code == 0
    batch = json.loads(out)["batch"]
    assert (batch["gradient_accumulation_steps"], batch["optimizer_steps_per_epoch"]) == (5, 20)
    # A flag that disagrees with the launcher is refused, as in train.
    code, out, err = run(capsys, "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "3")
    assert code == 2 and out == ""
    assert err.startswith("error: --gradient_accumulation_steps:")


def test_plan_starts_without_torch():
    # A fresh interpreter: `accum-kit plan` must not import torch or accelerate; afterwards the
    # package's public names (loaded lazily) still resolve, the loop's bringing torch in.
    code = (
        "import sys; from accum_kit.cli import main; "
        "code = main(['plan', '--per_device_train_batch_size', '1', '--num_processes', '8', "
        "'--num_examples', '800', '--json']); "
        "heavy = sorted(m for m in ('torch', 'accelerate') if m in sys.modules); "
        "assert not heavy, heavy; "
        "import accum_kit; from accum_kit import train_loop, optimizer_steps_per_epoch; "
        "assert 'torch' in sys.modules and callable(train_loop); "
        "assert all(getattr(accum_kit, name) is not None for name in accum_kit.__all__); "
        "assert not hasattr(accum_kit, 'no_such_name'); "
        "sys.exit(code)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["batch"]["effective_batch_size"] == 32  # K = 4 by default


def test_python_m_accum_kit_plan(capsys):
    # The command-line path end to end, and the same output as cli.main.
    argv = ["plan", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "3",
            "--num_processes", "2", "--num_examples", "50"]
    proc = subprocess.run([sys.executable, "-m", "accum_kit", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert cli.main(argv) == 0
    assert proc.stdout == capsys.readouterr().out
    assert "PARTIAL: 1 of 3 micro-batches" in proc.stdout


# ---------------------------------------------------------------- accumulation schedule (batch-size warm-up)


def test_cli_schedule_phases_with_tokens_and_epochs(capsys):
    # B=8, P=2, N=4000: M = 4000 / 16 = 250 micro-batches per process per epoch; 3 epochs.
    code, out, err = run(capsys, "--per_device_train_batch_size", "8", "--num_processes", "2",
                         "--num_examples", "4000", "--accumulation_schedule", "0:1,100:2,300:4",
                         "--block_size", "1024", "--num_train_epochs", "3", "--json")
    assert code == 0, err
    data = json.loads(out)
    phases = data["schedule"]
    # epoch 0: steps 0-99 K=1 (100 mb), 150 mb left at K=2 -> 75 steps (175 done).
    # epoch 1: K=2 steps 175-299 = 125 steps (250 mb, the whole epoch; 300 done).
    # epoch 2: K=4: ceil(250 / 4) = 63 steps (62 full + a partial window of 2); 363 done.
    assert [(p["start_step"], p["end_step"], p["gradient_accumulation_steps"]) for p in phases] == [
        (0, 100, 1), (100, 300, 2), (300, 363, 4)]
    assert [p["steps"] for p in phases] == [100, 200, 63]
    assert [p["micro_batches_per_process"] for p in phases] == [100, 400, 250]
    assert [p["examples_per_step"] for p in phases] == [16, 32, 64]  # B x K x P
    assert [p["tokens_per_step"] for p in phases] == [16 * 1024, 32 * 1024, 64 * 1024]
    assert [p["epochs"] for p in phases] == [pytest.approx(0.4), pytest.approx(1.6), pytest.approx(1.0)]
    assert data["batch"]["gradient_accumulation_steps"] == 1  # the schedule's K at step 0


def test_cli_schedule_text_without_examples_says_what_is_missing(capsys):
    code, out, _ = run(capsys, "--per_device_train_batch_size", "4", "--accumulation_schedule", "0:1,10:2,30:4")
    assert code == 0
    assert "Accumulation schedule" in out and "to the end" in out
    assert "pass --block_size for tokens per step" in out and "pass --num_examples" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0-", "10-", "30-"))]
    assert rows == [["0-10", "1", "4", "10"], ["10-30", "2", "8", "20"], ["30-", "4", "16", "to", "the", "end"]]


@pytest.mark.parametrize("argv,flag,detail", [
    (["--accumulation_schedule", "10:2"], "--accumulation_schedule", "no K for step 0"),
    (["--accumulation_schedule", "0:1,5"], "--accumulation_schedule", "'5' is not a STEP:K pair"),
    (["--accumulation_schedule", "0:0"], "--accumulation_schedule (K at step 0)", "got 0"),
    (["--accumulation_schedule", "0:1,-3:2"], "--accumulation_schedule (step)", "got -3"),
    (["--accumulation_schedule", "0:1,4:2,4:3"], "--accumulation_schedule", "step 4 appears twice"),
    (["--accumulation_schedule", "0:2", "--gradient_accumulation_steps", "3"], "--gradient_accumulation_steps",
     "--accumulation_schedule"),
    (["--accumulation_schedule", "0:2", "--target_batch_size", "64"], "--target_batch_size", "sets K"),
])
def test_cli_schedule_bad_input_exit_2(capsys, argv, flag, detail):
    code, out, err = run(capsys, "--per_device_train_batch_size", "4", *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"error: {flag}: ") and detail in err, err


def test_scheduled_steps_equals_a_micro_batch_by_micro_batch_count():
    """The phase-jumping count against the definition, walked one micro-batch at a time."""
    import itertools

    from accum_kit.planning import optimizer_steps_per_epoch, scheduled_steps

    def walk(m, schedule, epochs):
        steps = 0
        for _ in range(epochs):
            size = 0
            for j in range(m):
                k = schedule[max(s for s in schedule if s <= steps)]
                size += 1
                if size == k or j == m - 1:
                    steps, size = steps + 1, 0
        return steps

    for m, schedule, epochs in itertools.product((1, 5, 7, 23), ({0: 1, 1: 3, 3: 2}, {0: 4, 2: 1}, {0: 3}), (1, 3)):
        assert scheduled_steps(m, schedule, epochs) == walk(m, schedule, epochs), (m, schedule, epochs)
    assert scheduled_steps(23, {0: 4}, 3) == 3 * optimizer_steps_per_epoch(23, 4)
