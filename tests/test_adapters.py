"""The train job with LoRA adapters (``--use_peft``, TRL's flags): saving, resuming, bad input; the refusals.

Expected values come from plain peft and transformers: the saved adapter is loaded with
``PeftModel.from_pretrained`` onto a base model rebuilt here from the preset and the seed, and its
validation loss recomputed from the corpus; the checkpoints are read back as files. Exactness of the
update itself (every engine, against the float64 single-process PeftModel) is checked in the modules
that own the launches (tests/lora_oracle.py).

Cost: two in-process runs of the job on one process (a few seconds each), in-process refusals.
"""

from __future__ import annotations

import json

import pytest
import torch

import job_helpers as jh
import test_train_job as tj

pytest.importorskip("peft")

LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0"]
STEPS, EVERY = 4, 2


def _flags(out, corpus, *extra):
    return tj.job_flags(out, "--max_train_steps", STEPS, "--per_device_train_batch_size", 2,
                        "--gradient_accumulation_steps", 3, "--max_train_samples", tj.MAX_TRAIN,
                        "--max_eval_samples", tj.MAX_EVAL, *extra, train_file=corpus)


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """The LoRA job on one process, in-process: 4 steps saving every 2, then the same job resumed from step_2 into
    another folder. Returns ``(corpus, first output dir, resumed output dir, datasets cache)``."""
    root = tmp_path_factory.mktemp("adapters")
    corpus = jh.write_corpus(root / "stdlib_corpus.txt")
    first, resumed = root / "first", root / "resumed"
    with pytest.MonkeyPatch.context() as mp:
        jh.isolate_in_process(mp, root / "hf_datasets_cache")
        try:
            from accum_kit.cli import run

            assert run("train", [str(a) for a in _flags(first, corpus, *LORA, "--checkpointing_steps", EVERY)]) == 0
            jh.reset_accelerate_state()
            assert run("train", [str(a) for a in _flags(resumed, corpus, *LORA, "--resume_from_checkpoint",
                                                        first / f"step_{EVERY}")]) == 0
        finally:
            jh.reset_accelerate_state()
    return corpus, first, resumed, root / "hf_datasets_cache"


def _base_model():
    """The preset's model as the job initialises it (the tiny preset, ByT5's 384 tokens, seed 42)."""
    from accum_kit.job.models import build_model

    return build_model(tj.PRESET, tj.BYTE_VOCAB, tj.BLOCK, seed=tj.SEED, eos_token_id=1, pad_token_id=0)


def test_summary_counts_trainable_and_frozen_parameters(lora_runs):
    _, first, _, _ = lora_runs
    s = tj.load_summary(first)
    base = _base_model()
    total = sum(p.numel() for p in base.parameters())  # the tied embedding / output weight once
    layers, width = base.config.n_layer, base.config.n_embd
    lora = layers * 4 * (width + 3 * width)  # r (h + 3h) per c_attn (h -> 3h): lora_A r x h, lora_B 3h x r
    assert s["trainable_parameters"] == s["adapter"]["trainable_parameters"] == lora
    assert s["model_parameters"] == total + lora and s["adapter"]["frozen_parameters"] == total
    assert s["adapter"]["target_modules"] == ["c_attn"] and s["adapter"]["r"] == 4 and s["adapter"]["lora_alpha"] == 8
    assert s["loss"]["implementation"] == "chunked", s["loss"]  # LoRA is not on the output layer: its loss ran
    assert s["optimizer_steps"] == STEPS and s["eval_loss_after"] < s["eval_loss_before"]


def test_saved_adapter_loads_with_peft_and_evaluates_to_the_reported_loss(lora_runs):
    """adapter_config.json + adapter_model.safetensors only (no full model), loadable with PeftModel.from_pretrained
    on the rebuilt base; the loaded model's loss on the validation blocks (recomputed from the file) is the summary's."""
    from peft import PeftModel

    corpus, first, _, _ = lora_runs
    s = tj.load_summary(first)
    names = {p.name for p in first.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "train_summary.json"} <= names
    assert "model.safetensors" not in names
    config = json.loads((first / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["target_modules"] == ["c_attn"]
    model = PeftModel.from_pretrained(_base_model(), first).eval()
    blocks = tj.packed_blocks(tj.split_lines(corpus)[0])[:tj.MAX_EVAL]
    assert tj.lm_loss(model, blocks) == pytest.approx(s["eval_loss_after"], rel=1e-5)
    assert tj.lm_loss(_base_model().eval(), blocks) == pytest.approx(s["eval_loss_before"], rel=1e-5)


def test_checkpoints_hold_frozen_weights_unchanged_and_optimizer_state_for_adapters_only(lora_runs):
    from safetensors.torch import load_file

    _, first, _, _ = lora_runs
    ckpt = first / f"step_{EVERY}"
    saved = load_file(ckpt / "model.safetensors")
    base = _base_model().state_dict()
    frozen = {k: v for k, v in saved.items() if "lora_" not in k}
    assert frozen and all(".lora_" in k for k in set(saved) - set(frozen))
    for k, v in frozen.items():  # peft's names: base_model.model.<name>, its wrapped layers' base_layer.<weight>
        name = k.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(v, base[name]), f"frozen {name} changed"
    optimizer = torch.load(ckpt / "optimizer.bin", weights_only=True)
    states = [s for s in optimizer["state"].values() if s]
    lora_tensors = [v for k, v in saved.items() if "lora_" in k]
    assert sorted(s["exp_avg"].numel() for s in states) == sorted(v.numel() for v in lora_tensors)
    assert json.loads((ckpt / "loop_state.json").read_text())["adapter"]["r"] == 4


def test_resumed_run_is_bitwise_the_uninterrupted_one(lora_runs):
    from safetensors.torch import load_file

    _, first, resumed, _ = lora_runs
    a, b = tj.load_summary(first), tj.load_summary(resumed)
    assert b["resumed_from_step"] == EVERY and b["train_loss"] == a["train_loss"]
    assert b["eval_loss_after"] == a["eval_loss_after"]
    got, want = load_file(resumed / "adapter_model.safetensors"), load_file(first / "adapter_model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


BAD_RESUMES = {
    "another_rank": (["--use_peft", "--lora_r", "8", "--lora_alpha", "8"], "--lora_r", "r 4"),
    "other_targets": ([*LORA, "--lora_target_modules", "c_fc"], "--lora_target_modules", "['c_attn']"),
    "without_adapters": ([], "--use_peft", "trained LoRA adapters"),
}


@pytest.mark.parametrize("case", sorted(BAD_RESUMES))
def test_adapter_checkpoint_resumed_into_another_adapter_exits_2(lora_runs, tmp_path, capsys, monkeypatch, case):
    corpus, first, _, cache = lora_runs
    flags, flag, detail = BAD_RESUMES[case]
    out = tmp_path / "out"
    error = _refused(capsys, monkeypatch, cache, _flags(out, corpus, *flags, "--resume_from_checkpoint",
                                                        first / f"step_{EVERY}"), flag, detail)
    assert ". Fix: " in error, error
    assert not out.exists() and jh.staging_leftovers(out) == []


def _refused(capsys, monkeypatch, cache, argv, flag: str, detail: str) -> str:
    """Run the job in-process on ``argv``: exit 2 with one error line naming ``flag`` and holding ``detail``;
    returns that line."""
    jh.isolate_in_process(monkeypatch, cache)
    try:
        code, _, err = tj.run_main(capsys, argv)
    finally:
        jh.reset_accelerate_state()
    errors = tj.error_lines(err)
    assert code == 2 and len(errors) == 1, err[-3000:]
    assert errors[0].startswith(f"error: {flag}: ") and detail in errors[0], errors[0]
    return errors[0]


BAD_FLAGS = {
    # name: (flags, the flag the error names, text the message must contain)
    "lora_flag_without_use_peft": (["--lora_r", "8"], "--lora_r", "--use_peft is not given"),
    "target_without_use_peft": (["--lora_target_modules", "c_attn"], "--lora_target_modules", "--use_peft"),
    "qlora_4bit": (["--use_peft", "--load_in_4bit"], "--load_in_4bit", "not supported"),
    "qlora_8bit": (["--load_in_8bit"], "--load_in_8bit", "not supported"),
    "rank_zero": (["--use_peft", "--lora_r", "0"], "--lora_r", "got 0"),
    "alpha_zero": (["--use_peft", "--lora_alpha", "0"], "--lora_alpha", "got 0"),
    "dropout_one": (["--use_peft", "--lora_dropout", "1"], "--lora_dropout", "below 1"),
    "unknown_target": (["--use_peft", "--lora_target_modules", "q_proj"], "--lora_target_modules",
                       "q_proj names no module"),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_adapter_flags_exit_2_naming_the_flag(lora_runs, tmp_path, capsys, monkeypatch, case):
    corpus, _, _, cache = lora_runs
    flags, flag, detail = BAD_FLAGS[case]
    out = tmp_path / "out"
    error = _refused(capsys, monkeypatch, cache, _flags(out, corpus, *flags), flag, detail)
    if case == "unknown_target":  # the fix lists the modules LoRA can wrap in this model
        assert all(name in error for name in ("c_attn", "c_fc", "c_proj")), error
    assert not out.exists()


def test_use_peft_on_a_model_that_carries_an_adapter_is_refused(tmp_path):
    """A PeftModel, and a transformers model loaded from an adapter folder (transformers attaches it), both refused."""
    from peft import get_peft_model, LoraConfig
    from transformers import AutoModelForCausalLM

    from accum_kit.errors import UsageError
    from accum_kit.job.adapters import LoraSettings, apply_lora

    settings = LoraSettings(4, 8, 0.0, None)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    _base_model().save_pretrained(base_dir)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(r=4, target_modules=["c_attn"]))
    peft_model.save_pretrained(adapter_dir)
    loaded = AutoModelForCausalLM.from_pretrained(adapter_dir)  # transformers loads the base and attaches the adapter
    for model in (peft_model, loaded):
        with pytest.raises(UsageError) as info:
            apply_lora(model, settings)
        assert info.value.flag == "--use_peft" and "already carries a peft adapter" in str(info.value)
    wrapped = apply_lora(AutoModelForCausalLM.from_pretrained(base_dir), settings)  # the plain one is wrapped
    assert sum(p.requires_grad for p in wrapped.parameters()) == 2 * tj.fresh_tiny_model().config.n_layer


def test_model_type_without_default_targets_asks_for_them():
    from accum_kit.errors import UsageError
    from accum_kit.job.adapters import LoraSettings, apply_lora

    model = _base_model()
    model.config.model_type = "no_such_type"  # peft has no default targets for it
    with pytest.raises(UsageError) as info:
        apply_lora(model, LoraSettings(4, 8, 0.0, None))
    assert info.value.flag == "--lora_target_modules" and "c_attn" in info.value.fix


def test_tensor_parallel_of_an_adapted_model_is_refused():
    from peft import get_peft_model, LoraConfig

    from accum_kit.engines.model_parallel import refuse_adapters_under_tp
    from accum_kit.errors import UsageError

    refuse_adapters_under_tp(_base_model(), 2)  # a plain model passes
    with pytest.raises(UsageError) as info:
        refuse_adapters_under_tp(get_peft_model(_base_model(), LoraConfig(r=4, target_modules=["c_attn"])), 2)
    assert info.value.flag == "--parallelism_config_tp_size" and "adapters" in info.value.problem


def test_lora_on_the_output_layer_falls_back_to_the_logits_and_says_why():
    """LoRA on lm_head: the layer is a peft wrapper, so the loss runs from the logits, with the reason recorded; the
    summed loss equals the plain formula's."""
    from peft import get_peft_model, LoraConfig

    from accum_kit.core.loss import CausalLMLoss, logits_causal_lm_loss

    model = get_peft_model(_base_model(), LoraConfig(r=4, target_modules=["c_attn", "lm_head"]))
    ids = torch.randint(3, tj.BYTE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = CausalLMLoss()
    summed, n = loss(model, {"input_ids": ids, "labels": ids})
    assert loss.used["implementation"] == "logits" and "peft adapter" in loss.used["reason"], loss.used
    want, m = logits_causal_lm_loss(model, {"input_ids": ids, "labels": ids})
    assert int(n) == int(m) == 2 * 15 and torch.equal(summed, want)
