"""Model presets built from transformers configs, and loading from a local path.

No model hub is needed: a preset builds a randomly initialised GPT-2-style
model (``transformers.GPT2LMHeadModel``) from a ``GPT2Config``, or a Llama one
(``transformers.LlamaForCausalLM``, :data:`LLAMA_PRESETS`) for checks that
depend on the model family (``verify``'s Trainer row). The
``--model_name_or_path`` route loads a saved model (``save_pretrained`` output,
or a hub name for users who can reach the hub).
"""

from __future__ import annotations

import os

from .errors import UsageError

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
}


#: Llama-family presets (``LlamaConfig`` fields); vocab_size and max_position_embeddings come from the caller.
LLAMA_PRESETS: dict[str, dict] = {
    # ~0.1M parameters: the Llama counterpart of "tiny" (verify's model family check).
    "llama_tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                       intermediate_size=128),
}


def build_llama_model(preset: str, vocab_size: int, n_positions: int, seed: int | None = None):
    """A randomly initialised ``transformers.LlamaForCausalLM`` (float32, no dropout) from :data:`LLAMA_PRESETS`.

    Args:
        preset: a key of :data:`LLAMA_PRESETS`.
        vocab_size: tokens in the vocabulary.
        n_positions: ``max_position_embeddings``, tokens.
        seed: if given, seeds torch before initialising the weights.

    Raises:
        UsageError: unknown preset (names ``--model_preset``).
    """
    if preset not in LLAMA_PRESETS:
        raise UsageError("--model_preset", f"unknown Llama preset {preset!r}", f"use one of {sorted(LLAMA_PRESETS)}")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=n_positions, attention_dropout=0.0,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, **LLAMA_PRESETS[preset])
    return LlamaForCausalLM(config)


def build_model(preset: str, vocab_size: int, n_positions: int, seed: int | None = None, **config_overrides):
    """A randomly initialised GPT-2-style causal LM from a named preset.

    Args:
        preset: a key of :data:`PRESETS`.
        vocab_size: tokenizer size (``len(tokenizer)``), tokens.
        n_positions: maximum sequence length, tokens (at least ``--block_size``).
        seed: if given, seeds torch before initialising the weights.
        **config_overrides: extra ``GPT2Config`` fields (e.g. ``eos_token_id``
            and ``pad_token_id`` of the tokenizer).

    Returns:
        ``transformers.GPT2LMHeadModel`` in float32.

    Raises:
        UsageError: unknown preset (names ``--model_preset``).
    """
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


def load_model(model_name_or_path: str):
    """Load a causal LM with ``AutoModelForCausalLM.from_pretrained``.

    Args:
        model_name_or_path: a local directory written by ``save_pretrained``,
            or a hub model name.

    Raises:
        UsageError: the path does not exist and the hub cannot provide it
            (names ``--model_name_or_path``).
    """
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(model_name_or_path)
    except (OSError, ValueError) as exc:
        where = "a local directory" if os.path.isdir(model_name_or_path) else "a local path or a reachable hub model"
        raise UsageError(
            "--model_name_or_path",
            f"cannot load {model_name_or_path!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
            f"pass {where} written by save_pretrained, or use --model_preset instead",
        ) from exc


def count_parameters(model) -> int:
    """Number of trainable parameters (elements, not bytes)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
