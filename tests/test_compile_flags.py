"""torch.compile flags refused or turned into settings, and bench's compile figures: in-process, nothing compiled.

The compiled runs themselves are in tests/test_compile.py. Bad input exits 2
with a message that names the flag and the fix, before any output is written.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("argv,flag", [
    (["--torch_compile_backend", "nope"], "--torch_compile_backend"),
    (["--torch_compile_mode", "fastest"], "--torch_compile_mode"),
    (["--torch_compile_backend", "aot_eager", "--torch_compile_mode", "max-autotune"], "--torch_compile_mode"),
])
def test_unknown_backend_or_mode_exits_2_naming_the_flag(tmp_path, capsys, argv, flag):
    from accum_kit.cli import run

    out = tmp_path / "out"
    assert run("train", [*argv, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}:" in err and "Fix:" in err, err
    assert not out.exists()


def test_a_backend_without_its_compiler_says_what_to_install(monkeypatch):
    import shutil

    from accum_kit.engines.compiling import check_backend_available
    from accum_kit.errors import UsageError

    with pytest.raises(UsageError, match="pip install apache-tvm"):
        check_backend_available("tvm")  # registered with dynamo, its package is not installed here
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(UsageError, match="--torch_compile_backend: .*no C\\+\\+ compiler.*apt-get install g\\+\\+"):
        check_backend_available("inductor")


def test_ddp_buckets_below_one_mb_are_refused_when_compiling(monkeypatch):
    from accelerate.utils import DistributedDataParallelKwargs

    from accum_kit.engines.compiling import check_ddp_buckets, dynamo_plugin_for
    from accum_kit.errors import UsageError

    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    with pytest.raises(UsageError, match="--ddp_bucket_cap_mb: 0.5 MB"):
        check_ddp_buckets(dynamo_plugin_for(backend="eager"), [DistributedDataParallelKwargs(bucket_cap_mb=0.5)])
    check_ddp_buckets(dynamo_plugin_for(backend="eager"), [DistributedDataParallelKwargs(bucket_cap_mb=1)])
    check_ddp_buckets(dynamo_plugin_for(backend="eager", fsdp=True), [DistributedDataParallelKwargs(bucket_cap_mb=0.5)])


def test_flags_build_accelerates_dynamo_plugin(monkeypatch):
    from accum_kit.engines.compiling import dynamo_plugin_for

    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    assert dynamo_plugin_for() is None
    plugin = dynamo_plugin_for(torch_compile=True)
    assert plugin.backend.value == "INDUCTOR" and not plugin.use_regional_compilation
    assert dynamo_plugin_for(backend="aot_eager", fsdp=True).use_regional_compilation
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "EAGER")  # an accelerate config's dynamo_config
    assert dynamo_plugin_for(fsdp=True).backend.value == "EAGER"
    assert dynamo_plugin_for(fsdp=True).use_regional_compilation


def test_bench_figures_per_k_from_paired_runs():
    """Break-even and the paired ratio from hand-made runs (no compile): 2 repeats, compiled 0.8 s vs eager 1.0 s."""
    import math

    from accum_kit.bench.report_compiled import summarize_k

    runs = [{"K": 8, "repeat": rep, "mode": mode, "measured": [s], "losses": [1.0, 2.0 + (mode == "compiled") * 1e-7]}
            for rep, (e, c) in enumerate([(1.0, 0.8), (1.1, 0.77)]) for mode, s in (("eager", e), ("compiled", c))]
    row = summarize_k("tiny", runs, 8, compile_seconds=30.0)
    assert row["eager_step_seconds"] == pytest.approx(1.05) and row["compiled_step_seconds"] == pytest.approx(0.785)
    assert row["seconds_saved_per_step"] == pytest.approx(0.265)
    assert row["break_even_steps"] == pytest.approx(30.0 / 0.265)
    assert row["compiled_over_eager"]["geometric_mean"] == pytest.approx(math.sqrt(0.8 * 0.7))
    assert row["loss_max_abs_diff"] == pytest.approx(1e-7)
    lo, hi = row["break_even_steps_interval"]
    ci = row["compiled_over_eager"]
    assert lo == pytest.approx(30.0 / (1.05 * (1 - ci["low"]))) and (hi is None or hi > lo)
    slower = [{**r, "measured": [2.0]} if r["mode"] == "compiled" else r for r in runs]
    assert summarize_k("tiny", slower, 8, compile_seconds=30.0)["break_even_steps"] is None


@pytest.mark.parametrize("argv", [["--torch_compile", "--tune"], ["--torch_compile_backend", "nope"]])
def test_bench_compile_flags_are_checked(tmp_path, capsys, argv):
    from accum_kit.cli import run

    assert run("bench", [*argv, "--output_dir", str(tmp_path / "b")]) == 2
    assert "error: --torch_compile" in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["--torch_compile_backend", "nope"], "--torch_compile_backend"),
    (["--torch_compile_mode", "fastest"], "--torch_compile_mode"),
    (["--torch_compile_backend", "eager", "--torch_compile_mode", "max-autotune"], "--torch_compile_mode"),
])
def test_verify_refuses_unknown_compile_flags_exit_2(one_process, tmp_path, capsys, argv, flag):
    from accum_kit.cli import run

    out = tmp_path / "v.json"
    assert run("verify", [*argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}:" in err and "Fix:" in err, err
    assert not out.exists()


def test_verify_compile_arguments_must_agree_with_a_given_accelerator(one_process):
    from accum_kit import verify
    from accum_kit.errors import UsageError
    from accum_kit.launch import build_accelerator

    acc = build_accelerator(2)  # eager: nothing compiled, nothing run before the check
    with pytest.raises(UsageError, match="torch_compile: asked for, but the accelerator does not compile"):
        verify.verify_accumulation(acc, torch_compile_backend="eager")


TF32_PROBE = """
import sys, torch
torch.backends.cuda.matmul.allow_tf32 = sys.argv[2] == "user_on"
if sys.argv[1] == "accelerate":  # Accelerate alone: the positive control
    from accelerate import Accelerator
    Accelerator(dynamo_backend="aot_eager")
else:
    from accum_kit import build_accelerator
    build_accelerator(gradient_accumulation_steps=2, torch_compile=True, torch_compile_backend="aot_eager")
print(torch.backends.cuda.matmul.allow_tf32)
"""


@pytest.mark.parametrize("builder,user,expected", [("accelerate", "user_off", "True"), ("accum_kit", "user_off", "False"),
                                                   ("accum_kit", "user_on", "True")])
def test_a_compiled_fp32_accelerator_on_cuda_keeps_the_users_tf32_setting(tmp_path, builder, user, expected):
    """Accelerate turns TF32 matmuls on for a compiled fp32 run on CUDA; build_accelerator puts the user's back.
    CUDA is what Accelerate's state believes (ACCELERATE_TORCH_DEVICE); nothing runs on it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ACCELERATE_TORCH_DEVICE": "cuda", "ACCELERATE_MIXED_PRECISION": "no"}
    out = subprocess.run([sys.executable, "-c", TF32_PROBE, builder, user], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == expected
