"""Activation checkpointing in-process: the flags and their bad input, finding a model's blocks, one process against
plain PyTorch, the engines' refusals, and the cost table's and step-time model's terms.

The multi-process runs (DDP, FSDP2 under every policy, HSDP, ZeRO 1/2/3, compiled) share the launches of
tests/test_exactness.py, test_fsdp.py, test_hsdp.py, test_deepspeed.py, test_compile.py and test_examples.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings

import pytest
import torch

import job_helpers as jh

# --------------------------------------------------------------------------- the flags and their bad input


@pytest.mark.parametrize("value,problem", [
    ("{bad", "is not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"use_reentrant": false, "context_fn": 1}', "'context_fn' is not an argument"),
    ('{"reentrant": false}', "'reentrant' is not an argument"),
    ('{"use_reentrant": "no"}', "use_reentrant must be a JSON bool"),
])
def test_bad_kwargs_are_refused_naming_the_flag(value, problem):
    from accum_kit import UsageError
    from accum_kit.engines.activation_checkpointing import resolve_checkpointing

    with pytest.raises(UsageError) as err:
        resolve_checkpointing(True, value)
    assert err.value.flag == "--gradient_checkpointing_kwargs" and problem in err.value.problem, str(err.value)


def test_kwargs_without_the_switch_are_refused_and_the_default_is_non_reentrant():
    from accum_kit import UsageError
    from accum_kit.engines.activation_checkpointing import resolve_checkpointing

    with pytest.raises(UsageError) as err:
        resolve_checkpointing(False, '{"use_reentrant": false}')
    assert err.value.flag == "--gradient_checkpointing_kwargs" and "--gradient_checkpointing" in err.value.fix
    assert resolve_checkpointing(False, None) == (False, {})
    assert resolve_checkpointing(True, None) == (True, {"use_reentrant": False})
    assert resolve_checkpointing(True, '{"use_reentrant": true, "debug": false}') == \
        (True, {"use_reentrant": True, "debug": False})


@pytest.mark.parametrize("command", ["train", "verify", "bench"])
@pytest.mark.parametrize("argv", [["--gradient_checkpointing", "--gradient_checkpointing_kwargs", "{bad"],
                                  ["--gradient_checkpointing_kwargs", '{"use_reentrant": false}']])
def test_every_command_exits_2_on_bad_checkpointing_flags(one_process, tmp_path, command, argv):
    """train, verify and bench take Hugging Face's two flags; bad input exits 2 naming the flag, nothing written."""
    from accum_kit.cli import run

    out = tmp_path / "out"
    extra = {"train": ["--output_dir", str(out)], "bench": ["--output_dir", str(out)],
             "verify": ["--json", str(out / "v.json")]}[command]
    if command == "verify":
        out.mkdir()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = run(command, [*argv, *extra])
    assert code == 2 and "--gradient_checkpointing_kwargs" in err.getvalue(), err.getvalue()
    assert not out.exists() or not any(out.iterdir())


def test_train_config_keeps_the_kwargs_as_a_dict():
    from accum_kit.job.config import TrainConfig

    cfg = TrainConfig(gradient_checkpointing=True, gradient_checkpointing_kwargs='{"use_reentrant": true}')
    assert cfg.gradient_checkpointing_kwargs == {"use_reentrant": True}
    assert TrainConfig().gradient_checkpointing is False and TrainConfig().gradient_checkpointing_kwargs is None


# --------------------------------------------------------------------------- finding the blocks


class Block(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.inner = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + self.out(torch.tanh(self.inner(x)))


class Stack(torch.nn.Module):
    """A plain model: embedding, a ModuleList of repeated blocks, a head."""

    def __init__(self, n=3, d=8, vocab=11):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Named(torch.nn.Module):
    """Blocks outside any ModuleList, named in _no_split_modules as transformers models name theirs."""

    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.first, self.second, self.head = Block(), Block(), torch.nn.Linear(8, 2)


def test_blocks_are_found_as_transformers_finds_them():
    from transformers import GPT2Config, GPT2LMHeadModel

    from accum_kit.engines.activation_checkpointing import transformer_blocks

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    assert transformer_blocks(gpt2) == ["transformer.h.0", "transformer.h.1"]  # GradientCheckpointingLayer
    assert transformer_blocks(Named()) == ["first", "second"]  # _no_split_modules
    assert transformer_blocks(Stack()) == ["layers.0", "layers.1", "layers.2"]  # a ModuleList of one class
    mixed = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()]))
    assert transformer_blocks(mixed) == []


def test_a_model_without_blocks_is_refused_naming_the_flag():
    from accum_kit import UsageError
    from accum_kit.engines.activation_checkpointing import apply_to_model

    with pytest.raises(UsageError) as err:
        apply_to_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), {"use_reentrant": False})
    assert err.value.flag == "--gradient_checkpointing"
    assert "no transformer blocks found in Sequential" in err.value.problem, str(err.value)


# --------------------------------------------------------------------------- one process, against plain PyTorch


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_plain_module_checkpointed_in_prepare_gives_plain_pytorchs_gradient(one_process, reentrant):
    """build_accelerator(gradient_checkpointing=True): prepare wraps each block of a plain module, backward runs
    each block's forward again (counted by a hook inside the block), and one window's accumulated gradient equals
    plain PyTorch's big-batch gradient of an unwrapped copy (float32, 1e-6); the state_dict keys stay the same."""
    import copy

    from accum_kit import build_accelerator
    from accum_kit.compat.torch_checkpoint import is_checkpoint_wrapper

    torch.manual_seed(0)
    model = Stack()
    plain = copy.deepcopy(model)
    keys = list(model.state_dict())
    batches = [torch.randint(0, 11, (2, 5)) for _ in range(3)]
    calls = []
    for layer in model.layers:
        layer.inner.register_forward_hook(lambda *a: calls.append(1))
    acc = build_accelerator(3, cpu=True, gradient_checkpointing=True,
                            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    plan = acc.run_plan
    assert plan.gradient_checkpointing and plan.gradient_checkpointing_kwargs == {"use_reentrant": reentrant}
    prepared = acc.prepare(model)
    assert sum(is_checkpoint_wrapper(m) for m in prepared.modules()) == 3 and list(prepared.state_dict()) == keys
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    for ids in batches:
        with acc.accumulate(prepared):
            emb_out = prepared(ids)
            acc.backward(loss_fn(emb_out.flatten(0, 1), ids.flatten()))
    assert len(calls) == 2 * 3 * len(batches), "each block's forward did not run again in backward"
    big = torch.cat(batches)
    loss_fn(plain(big).flatten(0, 1), big.flatten()).backward()
    got = dict(prepared.named_parameters())
    for name, p in plain.named_parameters():
        wrapped = next(g for n, g in got.items() if n.replace("_checkpoint_wrapped_module.", "") == name)
        torch.testing.assert_close(wrapped.grad * 3, p.grad, atol=1e-6, rtol=1e-5)  # accumulate() divided by K
    plain.load_state_dict(prepared.state_dict())  # the keys of the unwrapped model


def test_the_plan_records_off_when_not_asked(one_process):
    from accum_kit import build_accelerator

    plan = build_accelerator(2, cpu=True).run_plan
    assert plan.gradient_checkpointing is False and plan.gradient_checkpointing_kwargs == {}


# --------------------------------------------------------------------------- the engines' own rules


@pytest.fixture
def fsdp_launch(monkeypatch):
    """What ``accelerate launch`` with an FSDP2 config exports, without a launch."""
    for var in jh.LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    yield monkeypatch


def _fsdp_engine():
    from accum_kit.engines.fsdp2 import FSDP2Engine
    from accum_kit.engines.policies import POLICIES

    engine = FSDP2Engine()
    engine.check_request(POLICIES["no_sync"], ddp_kwargs=None, compile_requested=False, world_size=2, on_cpu=True)
    return engine


def test_fsdp2_takes_accelerates_checkpointing_and_a_configs_switch_means_the_same(fsdp_launch):
    """The flag sets Accelerate's plugin switch; a config's fsdp_activation_checkpointing: true (its launch
    variable) turns checkpointing on without the flag; the plan gets Accelerate's fixed arguments."""
    from accum_kit.engines.fsdp2 import ACCELERATE_CHECKPOINT_KWARGS

    engine = _fsdp_engine()
    assert engine.resolve_activation_checkpointing(False, None) == (False, {})
    on = engine.resolve_activation_checkpointing(True, '{"use_reentrant": false}')
    assert on == (True, ACCELERATE_CHECKPOINT_KWARGS)
    assert engine.plugin.activation_checkpointing is True
    fsdp_launch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    assert _fsdp_engine().resolve_activation_checkpointing(False, None) == (True, ACCELERATE_CHECKPOINT_KWARGS)


@pytest.mark.parametrize("kwargs", ['{"use_reentrant": true}', '{"preserve_rng_state": true}', '{"debug": true}'])
def test_fsdp2_refuses_what_accelerates_wrapper_cannot_apply(fsdp_launch, kwargs):
    from accum_kit import UsageError

    with pytest.raises(UsageError) as err:
        _fsdp_engine().resolve_activation_checkpointing(True, kwargs)
    assert err.value.flag == "--gradient_checkpointing_kwargs" and "FSDP2" in err.value.problem


def test_fsdp2_turns_the_cache_off_and_warns_of_dropout():
    """Accelerate's wrapper runs a GPT-2 block whole again: its key/value cache must be off; with dropout the
    recompute without the RNG state draws other masks, which is said."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from accum_kit.engines.fsdp2 import FSDP2Engine

    quiet = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no dropout: nothing to say
        FSDP2Engine().apply_activation_checkpointing(None, quiet)
    assert quiet.config.use_cache is False
    noisy = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))  # dropout 0.1
    with pytest.warns(UserWarning, match="dropout layers with p > 0"):
        FSDP2Engine().apply_activation_checkpointing(None, noisy)


def test_ddp_refuses_reentrant_checkpointing_with_find_unused_parameters():
    """The one combination measured to fail under DDP ("Expected to mark a variable ready only once")."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedDataParallelKwargs

    from accum_kit import UsageError
    from accum_kit.engines.ddp import DDPEngine

    def acc(reentrant, find_unused, processes=2):
        plan = SimpleNamespace(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return SimpleNamespace(run_plan=plan, num_processes=processes,
                               ddp_handler=DistributedDataParallelKwargs(find_unused_parameters=find_unused))
    with pytest.raises(UsageError) as err:
        DDPEngine().apply_activation_checkpointing(acc(True, True), Stack())
    assert err.value.flag == "--gradient_checkpointing_kwargs" and "find_unused_parameters" in err.value.problem
    for ok in (acc(False, True), acc(True, False), acc(True, True, processes=1)):
        DDPEngine().apply_activation_checkpointing(ok, Stack())


# --------------------------------------------------------------------------- the cost table and the step-time model


@pytest.mark.parametrize("policy", ["no_sync", "sync_each_batch", "no_sync_no_reshard_after_backward",
                                    "no_sync_no_reshard"])
def test_checkpointing_changes_no_count_and_prices_one_more_forward_of_the_blocks(policy):
    """policy_costs(activation_checkpointing=True): every call and byte as without; the recompute share is P_f / P
    (computed here from the GPT-2 units by hand); the step-time model multiplies c by 1 + share / 3."""
    from dataclasses import asdict

    from accum_kit.engines.costs import gpt2_units_for, policy_costs
    from accum_kit.planning.step_time import BusBandwidths, step_time

    units = gpt2_units_for(2, 16, 64, 32)
    block, head, positions = 12 * 16 * 16 + 13 * 16, 64 * 16 + 2 * 16, 32 * 16
    share = 2 * block / (2 * block + head + positions)
    plain = policy_costs(policy, units, world_size=2, accumulation_steps=3)
    gc = policy_costs(policy, units, world_size=2, accumulation_steps=3, activation_checkpointing=True)
    assert {**asdict(gc), "recompute_forward_fraction": 0.0} == asdict(plain)
    assert gc.recompute_forward_fraction == pytest.approx(share, rel=1e-12) and plain.recompute_forward_fraction == 0
    pricing = BusBandwidths(shard_GBps=1.0)
    c = 0.3
    assert step_time(gc, c, pricing).compute_seconds == pytest.approx(3 * c * (1 + share / 3), rel=1e-12)
    assert step_time(plain, c, pricing).compute_seconds == pytest.approx(3 * c, rel=1e-12)


def test_verify_with_checkpointing_passes_against_its_eager_oracle(one_process, tmp_path):
    """accum-kit verify --gradient_checkpointing: the rows' copy checkpoints its blocks (prepare), the float64
    oracle keeps every activation; the tokens row passes (exit 0)."""
    from accum_kit.cli import run

    out = tmp_path / "verify.json"
    with contextlib.redirect_stdout(io.StringIO()):
        code = run("verify", ["--gradient_checkpointing", "--no_trainer_row", "--gradient_accumulation_steps", "2",
                              "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["passed"], report


# --------------------------------------------------------------------------- the train job (2 FSDP2 processes)


def test_the_fsdp2_train_job_with_checkpointing_logs_the_reference_jobs_losses(fsdp_reference, fsdp_pool, tmp_path):
    """``accum-kit train --gradient_checkpointing`` on conftest.py's shared FSDP2 job (tiny preset, K=3, 8 steps,
    no_sync_no_reshard): train_summary.json records checkpointing with Accelerate's arguments, and every logged
    loss and the eval loss are those of the reference run without it."""
    ref = fsdp_reference.result()
    assert ref.returncode == 0, ref.describe()
    out = tmp_path / "gc"
    argv = jh.fsdp_job_argv(fsdp_reference.corpus, out, "--gradient_checkpointing")[3:]
    res = fsdp_pool.submit("train", argv, datasets_cache=fsdp_reference.datasets_cache).result()
    assert res.returncode == 0, res.describe()
    got = json.loads((out / "train_summary.json").read_text())
    want = json.loads((fsdp_reference.output_dir / "train_summary.json").read_text())
    assert got["gradient_checkpointing"] is True and want["gradient_checkpointing"] is False
    assert got["gradient_checkpointing_kwargs"] == {"use_reentrant": False, "preserve_rng_state": False}
    gap = max(abs(a - b) / abs(b) for a, b in zip(got["train_loss"], want["train_loss"]))
    assert len(got["train_loss"]) == len(want["train_loss"]) == jh.FSDP_JOB_STEPS and gap <= 1e-5, gap
    assert got["eval_loss_after"] == pytest.approx(want["eval_loss_after"], rel=1e-5)
    print(f"\nFSDP2 train job with checkpointing: largest relative loss gap to the reference {gap:.1e}; "
          f"{res.seconds:.1f} s (the reference: {ref.seconds:.1f} s)")
