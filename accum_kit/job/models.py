"""Model presets built from transformers configs, and loading from a local path.

No model hub is needed: a preset builds a randomly initialised GPT-2-style
model (``transformers.GPT2LMHeadModel``) from a ``GPT2Config``, or a Llama one
(``transformers.LlamaForCausalLM``, :data:`LLAMA_PRESETS`) for checks that
depend on the model family (``verify``'s Trainer row). The
``--model_name_or_path`` route loads a saved model (``save_pretrained`` output,
or a hub name for users who can reach the hub); ``--config_name`` /
``--model_type`` build one from a config as transformers'
``run_clm_no_trainer.py`` does (:func:`resolve_config`, :func:`build_from_config`).
"""

from __future__ import annotations

import os

from ..errors import UsageError

# Architecture only; vocab_size and n_positions come from the tokenizer and --block_size.
# Dropout is 0 so that the exactness checks compare deterministic gradients.
PRESETS: dict[str, dict] = {
    # ~0.1M parameters: unit and multi-process tests.
    "tiny": dict(n_layer=2, n_embd=64, n_head=2),
    # ~3M parameters: the README demo, learns visibly within minutes on 2 CPU cores.
    "mini": dict(n_layer=4, n_embd=256, n_head=4),
    # ~29M parameters: the size of the step-time figures in the README and docs/design.md.
    "small": dict(n_layer=9, n_embd=512, n_head=8),
    # ~25M parameters, little compute per micro-batch: `accum-kit bench`'s communication-heavy case.
    "comm_heavy": dict(n_layer=2, n_embd=1024, n_head=16),
    # GPT-2 small's shape (Radford et al. 2019): 124M parameters at vocabulary 50257 and 1024 positions; the
    # one-process bench on a GPU (--vocab_size 50257 --block_size 1024).
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
}


#: Llama-family presets (``LlamaConfig`` fields); vocab_size and max_position_embeddings come from the caller.
LLAMA_PRESETS: dict[str, dict] = {
    # ~0.1M parameters: the Llama counterpart of "tiny" (verify's model family check).
    "llama_tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                       intermediate_size=128),
    # ~3.4M parameters besides the embeddings: benchmarks of tensor / context parallel (heads divisible by 2, 4, 8).
    "llama_small": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                        intermediate_size=688),
}


#: Mixture-of-experts presets (``MixtralConfig`` fields: experts fused in one 3-D parameter per layer, top-2).
MOE_PRESETS: dict[str, dict] = {
    # ~0.2M parameters: 4 experts of which each token uses 2; the router's aux loss weighs 0.02.
    "moe_tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                     intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02),
}


def build_moe_model(preset: str, vocab_size: int, n_positions: int, seed: int | None = None, **config_overrides):
    """A randomly initialised ``transformers.MixtralForCausalLM`` (float32, no dropout) from :data:`MOE_PRESETS`.

    Args:
        preset: a key of :data:`MOE_PRESETS`.
        vocab_size: tokens in the vocabulary.
        n_positions: ``max_position_embeddings``, tokens.
        seed: if given, seeds torch before initialising the weights.
        **config_overrides: extra ``MixtralConfig`` fields.

    Raises:
        UsageError: unknown preset (names ``--model_preset``).
    """
    return _decoder_from_preset(MOE_PRESETS, "mixture-of-experts", "Mixtral", preset, vocab_size, n_positions, seed,
                                config_overrides)


def build_llama_model(preset: str, vocab_size: int, n_positions: int, seed: int | None = None, **config_overrides):
    """A randomly initialised ``transformers.LlamaForCausalLM`` (float32, no dropout) from :data:`LLAMA_PRESETS`.

    Args:
        preset: a key of :data:`LLAMA_PRESETS`.
        vocab_size: tokens in the vocabulary.
        n_positions: ``max_position_embeddings``, tokens.
        seed: if given, seeds torch before initialising the weights.
        **config_overrides: extra ``LlamaConfig`` fields (e.g. the tokenizer's ``pad_token_id``).

    Raises:
        UsageError: unknown preset (names ``--model_preset``).
    """
    return _decoder_from_preset(LLAMA_PRESETS, "Llama", "Llama", preset, vocab_size, n_positions, seed,
                                config_overrides)


def _decoder_from_preset(presets: dict, kind: str, family: str, preset: str, vocab_size: int, n_positions: int,
                         seed: int | None, overrides: dict):
    """``transformers.<family>ForCausalLM`` from ``<family>Config`` with the preset's fields: no dropout, no special
    token ids unless overridden; torch seeded first when ``seed`` is given."""
    if preset not in presets:
        raise UsageError("--model_preset", f"unknown {kind} preset {preset!r}", f"use one of {sorted(presets)}")
    import torch
    import transformers

    if seed is not None:
        torch.manual_seed(seed)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=vocab_size, max_position_embeddings=n_positions, attention_dropout=0.0,
        **{"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **presets[preset], **overrides})
    return getattr(transformers, f"{family}ForCausalLM")(config)


def build_model(preset: str, vocab_size: int, n_positions: int, seed: int | None = None, **config_overrides):
    """A randomly initialised GPT-2-style causal LM from a named preset (a Llama one for :data:`LLAMA_PRESETS`, a
    Mixtral one for :data:`MOE_PRESETS`).

    Args:
        preset: a key of :data:`PRESETS`, :data:`LLAMA_PRESETS` or :data:`MOE_PRESETS`.
        vocab_size: tokenizer size (``len(tokenizer)``), tokens.
        n_positions: maximum sequence length, tokens (at least ``--block_size``).
        seed: if given, seeds torch before initialising the weights.
        **config_overrides: extra ``GPT2Config`` fields (e.g. ``eos_token_id``
            and ``pad_token_id`` of the tokenizer).

    Returns:
        ``transformers.GPT2LMHeadModel`` (``LlamaForCausalLM``, ``MixtralForCausalLM``) in float32.

    Raises:
        UsageError: unknown preset (names ``--model_preset``).
    """
    if preset in LLAMA_PRESETS:
        return build_llama_model(preset, vocab_size, n_positions, seed, **config_overrides)
    if preset in MOE_PRESETS:
        return build_moe_model(preset, vocab_size, n_positions, seed, **config_overrides)
    if preset not in PRESETS:
        raise UsageError("--model_preset", f"unknown preset {preset!r}", f"use one of {sorted(PRESETS)}")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if seed is not None:
        torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **{"bos_token_id": None, "eos_token_id": None, **PRESETS[preset], **config_overrides},
    )
    return GPT2LMHeadModel(config)


def load_model(model_name_or_path: str, *, config=None, trust_remote_code: bool = False,
               low_cpu_mem_usage: bool = False):
    """Load a causal LM with ``AutoModelForCausalLM.from_pretrained``.

    Args:
        model_name_or_path: a local directory written by ``save_pretrained``,
            or a hub model name.
        config: a ``PretrainedConfig`` to use instead of the saved one (``--config_name``).
        trust_remote_code: allow model classes defined by code in that directory.
        low_cpu_mem_usage: build the model empty and fill it from the weights
            (transformers 4; transformers 5 always loads this way and ignores it).

    Raises:
        UsageError: the path does not exist and the hub cannot provide it
            (names ``--model_name_or_path``), or it holds custom code and
            ``trust_remote_code`` is False (names ``--trust_remote_code``).
    """
    from transformers import AutoModelForCausalLM

    options = {"config": config} if config is not None else {}
    if low_cpu_mem_usage:  # otherwise the installed transformers' own default
        options["low_cpu_mem_usage"] = True
    try:
        # trust_remote_code=False, not None: None would prompt on a terminal before failing
        return AutoModelForCausalLM.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code, **options)
    except (OSError, ValueError) as exc:
        _raise_remote_code(exc, model_name_or_path)
        where = "a local directory" if os.path.isdir(model_name_or_path) else "a local path or a reachable hub model"
        raise UsageError(
            "--model_name_or_path",
            f"cannot load {model_name_or_path!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
            f"pass {where} written by save_pretrained, or use --model_preset instead",
        ) from exc


def _raise_remote_code(exc: Exception, path: str) -> None:
    """transformers refuses code shipped with a model unless trusted: say which flag allows it."""
    if "trust_remote_code" in str(exc):
        raise UsageError("--trust_remote_code", f"{path!r} defines its own model code, which is not run by default",
                         f"read the code in {path} and pass --trust_remote_code if you trust it") from exc


def causal_lm_model_types() -> tuple[str, ...]:
    """Model types with an ``AutoModelForCausalLM`` class (``gpt2``, ``llama``, ...), sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def resolve_config(config_name: str | None = None, model_name_or_path: str | None = None,
                   model_type: str | None = None, trust_remote_code: bool = False):
    """The model configuration as run_clm_no_trainer picks it, or None for a ``--model_preset``.

    ``config_name`` (``AutoConfig.from_pretrained``), else the config saved
    with ``model_name_or_path`` (None here: ``from_pretrained`` reads it),
    else the defaults of ``model_type`` (``AutoConfig.for_model``, e.g.
    ``GPT2Config()``: 124M parameters for ``gpt2``).

    Raises:
        UsageError: the config cannot be loaded or is not a causal LM's
            (``--config_name``), custom code not trusted (``--trust_remote_code``),
            an unknown type (``--model_type``).
    """
    from transformers import AutoConfig

    if config_name:
        try:
            config = AutoConfig.from_pretrained(config_name, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            _raise_remote_code(exc, config_name)
            raise UsageError("--config_name", f"cannot load a model configuration from {config_name!r} "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                             "pass a directory with a config.json (PretrainedConfig.save_pretrained)") from exc
        if config.model_type not in causal_lm_model_types() and not getattr(config, "auto_map", None):
            raise UsageError("--config_name", f"{config_name!r} is a {config.model_type!r} configuration, and "
                             "transformers has no causal LM of that type", "pass the config.json of a causal LM "
                             "(e.g. a GPT2Config saved with save_pretrained)")
        return config
    if model_name_or_path or model_type is None:
        return None
    check_model_type(model_type)
    return AutoConfig.for_model(model_type)


def check_model_type(model_type: str) -> None:
    """Raise UsageError (``--model_type``) unless transformers has a causal LM of this type."""
    if model_type not in causal_lm_model_types():
        raise UsageError("--model_type", f"unknown value {model_type!r}: transformers has no causal LM of that type",
                         "pass e.g. gpt2 (a key of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES; its default "
                         "config, 124M parameters for gpt2), or --config_name with a small config.json")


def build_from_config(config, seed: int | None = None, trust_remote_code: bool = False):
    """A randomly initialised ``AutoModelForCausalLM.from_config(config)``; torch seeded right before if ``seed``."""
    import torch
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def fit_embeddings(model, vocab_size: int) -> bool:
    """Grow the token embeddings to ``vocab_size`` rows if the tokenizer has more tokens (run_clm_no_trainer's rule).

    Returns True when the model was resized (the new rows are randomly initialised).
    """
    if vocab_size <= model.get_input_embeddings().num_embeddings:
        return False
    model.resize_token_embeddings(vocab_size)
    return True


def count_parameters(model, trainable_only: bool = True) -> int:
    """Number of parameters (elements, not bytes): those that require a gradient, or all with ``trainable_only=False``
    (a LoRA run's frozen weights included). A sharded parameter counts its full shape (FSDP2's DTensors)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
