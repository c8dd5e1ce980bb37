"""Activation memory of a decoder-only transformer, per micro-batch and per process, as formulas (torch-free).

What autograd keeps from a micro-batch's forward until its backward, in bytes, from the model's
config: L layers, hidden size h, a heads, MLP width f (4h in GPT-2), vocabulary V, sequence s
tokens, micro-batch b examples, e bytes per activation element (4 in fp32, 2 under bf16/fp16
autocast).

Source of the shape of the count: Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (arXiv:2205.05198), section 4.1: one layer keeps ``s b h (34 + 5 a s / h)``
bytes in 16-bit with dropout masks (:func:`korthikanti_layer_bytes`). accum-kit's presets run
torch's eager GPT-2 (``transformers.GPT2LMHeadModel``) without dropout and with SDPA, which on
CPU is ``scaled_dot_product_flash_attention_for_cpu`` and keeps no ``a s^2`` attention matrix,
so the count here is what that code actually saves, tensor by tensor (autograd's
``_saved_*`` of every node, counted per storage on torch 2.13 / transformers 5.24), per token
and layer, in elements:

==========================================  =============================================
what                                         elements per token
==========================================  =============================================
two LayerNorms: input, output, mean, rstd    4 h + 4
attention: the q/k/v projection output       3 h
  SDPA's query, key/value copies, output     3 h, + a (its logsumexp)
MLP: c_fc output and GELU output             2 f
  ``gelu_new`` (tanh GELU in Python ops)     + 3 f (x^3, tanh result, 0.5 x)
==========================================  =============================================

i.e. ``30 h + a + 4`` for GPT-2 (f = 4h, ``gelu_new``). Eager attention (``attn_implementation=
"eager"``) adds Korthikanti's ``a s`` terms (the softmax result and the attention weights, ``2 a s``;
not measured here). Families other than GPT-2 (Llama...) use Korthikanti's count converted to
elements (``(34 + 5 a s / h) / 2`` per h; its dropout masks included), marked ``measured=False``.

The head and the loss (``loss="logits"``): the final LayerNorm (``2 h + 2``), the log-softmax result the
cross-entropy keeps for its backward (one float32 copy of the b s V logits) and, during the loss's backward,
two more (the gradient ``nll_loss`` hands back and the logits' gradient): ``LOGIT_COPIES`` = 3 at once, in
float32 whatever the compute precision (under autocast Accelerate returns float32 logits and the cross-entropy
runs in float32). The logits themselves are not kept: the output layer saves its input, and the labels are
shifted, not the logits. With the loss computed inside the output layer in chunks of C tokens
(``loss="fused"``, :mod:`accum_kit.core.linear_cross_entropy`): the final LayerNorm, the gradients that layer
keeps for its backward (``b s h + V h (+ V)`` in float32) and, during its forward, one chunk's logits (``C V``
float32, plus the chunk's copies and the weight's in the compute dtype under autocast,
:func:`accum_kit.core.linear_cross_entropy.transient_bytes`).

What exists only for a moment: the loss's transient (the two extra logits copies at its backward, or the chunk
in the fused forward) and the backward's transient gradients of the layer being back-propagated (below). They
never coexist (the loss's backward runs before the blocks', the fused loss's chunks in the forward), so the
peak holds the larger of the two (``ActivationBytes.total``). Measured (torch 2.13 CPU, the ``tiny`` preset at
vocabulary 50257, 4 x 256 tokens, the tensors alive counted by a dispatch mode): the logits' peak at the
log-softmax's backward, the saved tensors + 3 copies to 0.1 MiB; the fused loss's peak at the end of its
forward, the saved tensors + the layer's gradients + one chunk.

With activation checkpointing (``gradient_checkpointing``: each block's forward is run again in
its backward, torch's non-reentrant ``torch.utils.checkpoint``) a block keeps only its input
(``h`` per token and layer) and, during its backward, one block's full activations exist again:
``L h + (one layer's count)`` per token instead of ``L x (one layer's count)``.

LoRA adapters (``peft``, every weight of the model frozen, adapters of rank r on some of GPT-2's block
layers; Hu et al. 2021): a frozen linear layer keeps no input for its weight's gradient, so an input that
nothing else saves is no longer kept, and each adapter keeps its own small tensors. Counted tensor by
tensor the same way (tests/test_adapter_costs.py), per token and layer against the table above:

==========================================  =============================================
what                                         elements per token
==========================================  =============================================
``c_fc`` frozen, without an adapter          - h (the second LayerNorm's output)
the MLP's ``c_proj`` frozen, without one     - f (the GELU output)
each adapted layer                           + r (``lora_A``'s output, kept by ``lora_B``)
each adapted layer, ``lora_dropout`` > 0     + its input width (the dropped copy ``lora_A`` keeps)
the first block                              - (h + 2): its first LayerNorm's input and statistics
                                             (the embeddings are frozen: nothing below needs a gradient);
                                             with dropout, - h more (``c_attn``'s input copy)
==========================================  =============================================

(the attention's ``c_proj`` input is SDPA's output, which SDPA keeps anyway). The frozen output layer keeps
no input either: the final LayerNorm's output (``h``) under the logits' loss, the ``V h`` weight gradient
under the fused one. The count is measured for adapters that include ``c_attn`` (peft's default for
GPT-2, and ``all-linear``); without it the first block's attention needs no backward at all and more is
saved than counted, so such shapes say ``measured=False``.

Calibration: the formulas count saved tensors; the process peak also holds the backward's
transient gradients of the layer being back-propagated, with or without checkpointing.
:data:`CALIBRATION` x one layer's activations stands for them (``transient``); it was fitted on ONE
measured run (``python -m accum_kit.bench.memory_bench``, the ``small`` preset, DDP ``no_sync``,
without checkpointing; docs/memory.md gives the figures) and is applied unchanged to every other row.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import UsageError

#: Copies of the (b s V) float32 logits alive at the loss's backward: the log-softmax result the cross-entropy saved,
#: the gradient ``nll_loss`` hands it and the logits' gradient it returns (measured, module docstring).
LOGIT_COPIES = 3
#: Of them, kept from the forward to the backward: the saved log-softmax.
LOGIT_COPIES_HELD = 1
#: GELU variants computed as several saved Python ops (tanh approximation in transformers' ``NewGELUActivation``).
MULTI_OP_GELU = ("gelu_new", "gelu_pytorch_tanh_python")
#: The backward's transient gradients, in layers' worth of activations, fitted on one run (module docstring): the
#: `small` preset, 2 DDP processes, ``no_sync``, micro-batch 4 x 256 tokens, K = 2, 3 steps, no checkpointing:
#: peak 1617.4 MiB (mean of the two processes) = 1580.3 MiB of every counted part + 0.619 x 60.05 MiB (one layer).
CALIBRATION = 0.619


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer's shape (elements; counts) and its activation element size (bytes).

    Attributes:
        layers: L; hidden: h; heads: a; ffn: f, the MLP's inner width; vocab: V.
        activation: the MLP's activation function name (``gelu_new`` saves 3 more f-wide tensors).
        attention: ``sdpa`` (no a s^2 term; what CPU's flash kernel saves) or ``eager`` (adds ``2 a s``).
        family: ``gpt2`` (the measured count) or another model type (Korthikanti's count).
        element_bytes: e, bytes per activation element (4: fp32; 2: bf16 / fp16 autocast).
        loss: ``logits`` (the cross-entropy of the full logits) or ``fused`` (computed in the output layer in
            chunks of ``loss_chunk`` tokens; None: :func:`accum_kit.core.linear_cross_entropy.chunk_tokens`).
        head_bias: the output layer has a bias (its gradient is kept too under ``fused``).
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    activation: str = "gelu_new"
    attention: str = "sdpa"
    family: str = "gpt2"
    element_bytes: int = 4
    loss: str = "logits"
    loss_chunk: int | None = None
    head_bias: bool = False
    lora_targets: tuple[str, ...] | None = None
    lora_r: int = 0
    lora_dropout: float = 0.0

    def with_lora(self, r: int, targets, dropout: float = 0.0) -> "TransformerShape":
        """This shape with every weight frozen and LoRA adapters of rank ``r`` on ``targets`` (GPT-2 block layer
        names, :func:`accum_kit.engines.model_units.gpt2_lora_targets`: None for peft's default ``c_attn``),
        ``dropout`` on the adapters' input (module docstring).

        Raises:
            UsageError (``--lora_target_modules``): a name that is no linear layer of a GPT-2 block.
        """
        from dataclasses import replace

        from .model_units import gpt2_lora_targets

        return replace(self, lora_targets=gpt2_lora_targets(targets), lora_r=int(r), lora_dropout=float(dropout))

    @classmethod
    def from_config(cls, config: dict, element_bytes: int = 4) -> "TransformerShape":
        """From a transformers config as a dict (``config.to_dict()``): GPT-2's names (``n_layer``, ``n_embd``,
        ``n_head``, ``n_inner``, ``activation_function``) or Llama's (``num_hidden_layers``, ``hidden_size``,
        ``num_attention_heads``, ``intermediate_size``, ``hidden_act``).

        Raises:
            UsageError: the config has neither set of names (names ``--model_preset``).
        """
        def first(*keys):
            return next((config[k] for k in keys if config.get(k) is not None), None)

        L, h = first("n_layer", "num_hidden_layers"), first("n_embd", "hidden_size")
        a, V = first("n_head", "num_attention_heads"), first("vocab_size")
        if None in (L, h, a, V):
            raise UsageError("--model_preset", "the model config has no layer count, hidden size, head count or "
                             "vocabulary size", "use a GPT-2 or Llama style config")
        attention = config.get("_attn_implementation") or config.get("attn_implementation") or "sdpa"
        return cls(layers=int(L), hidden=int(h), heads=int(a), ffn=int(first("n_inner", "intermediate_size") or 4 * h),
                   vocab=int(V), activation=str(first("activation_function", "hidden_act") or "gelu_new"),
                   attention="eager" if attention == "eager" else "sdpa", family=str(config.get("model_type", "gpt2")),
                   element_bytes=element_bytes)

    @classmethod
    def from_preset(cls, preset: str, vocab: int, element_bytes: int = 4) -> "TransformerShape":
        """A GPT-2 preset of the train job (:data:`accum_kit.job.models.PRESETS`).

        Raises:
            UsageError: unknown preset (names ``--model_preset``).
        """
        from ..job.models import PRESETS

        if preset not in PRESETS:
            raise UsageError("--model_preset", f"unknown preset {preset!r}", f"use one of {sorted(PRESETS)}")
        p = PRESETS[preset]
        return cls(layers=p["n_layer"], hidden=p["n_embd"], heads=p["n_head"], ffn=4 * p["n_embd"], vocab=vocab,
                   element_bytes=element_bytes)

    @property
    def measured(self) -> bool:
        """Whether the layer count is the one measured tensor by tensor (GPT-2 with SDPA, adapters if any including
        ``c_attn``), not Korthikanti's."""
        return self.family == "gpt2" and self.attention == "sdpa" and (
            self.lora_targets is None or "c_attn" in self.lora_targets)

    def lora_elements_per_token(self) -> float:
        """What LoRA changes in one block's count, elements per token (module docstring; 0 without adapters)."""
        if self.lora_targets is None or self.family != "gpt2":
            return 0.0
        from .model_units import GPT2_LINEARS

        h, f, t = self.hidden, self.ffn, self.lora_targets
        widths = {1: h, 4: f}
        change = (-h if "c_fc" not in t else 0) + (-f if "c_proj" not in t else 0)
        for name in t:
            for i, _ in GPT2_LINEARS[name]:
                change += self.lora_r + (widths[i] if self.lora_dropout > 0 else 0)
        return float(change)

    def first_layer_saving(self) -> float:
        """Elements per token the first block keeps less than the others when the embeddings below it are frozen
        (LoRA): its first LayerNorm's input and statistics (``h + 2``) and, with dropout on ``c_attn``'s adapter,
        the input copy the dropped one replaces (its input needs no gradient there); 0 otherwise."""
        if self.lora_targets is None or self.family != "gpt2":
            return 0.0
        dropped = self.hidden if self.lora_dropout > 0 and "c_attn" in self.lora_targets else 0
        return float(self.hidden + 2 + dropped)

    def layer_elements_per_token(self, seq: int) -> float:
        """Elements one layer keeps per token for its backward (table of the module docstring)."""
        h, a, f = self.hidden, self.heads, self.ffn
        if self.family != "gpt2":
            return (34 + 5 * a * seq / h) / 2 * h  # Korthikanti's bytes in 16-bit, in elements
        mlp = (5 if self.activation in MULTI_OP_GELU else 2) * f
        eager = 2 * a * seq if self.attention == "eager" else 0
        return 4 * h + 4 + 6 * h + a + mlp + eager + self.lora_elements_per_token()

    def with_loss(self, loss: dict | str | None) -> "TransformerShape":
        """This shape with the loss that ran or will run: a :class:`accum_kit.core.loss.CausalLMLoss`'s ``used``
        record (``implementation`` ``chunked`` / ``torch`` -> ``fused`` with its ``chunk_tokens``; ``logits``), or
        ``"fused"`` / ``"logits"``; None: unchanged."""
        from dataclasses import replace

        if loss is None:
            return self
        if isinstance(loss, str):
            return replace(self, loss=loss)
        fused = loss.get("implementation") in ("chunked", "torch")
        return replace(self, loss="fused" if fused else "logits", loss_chunk=loss.get("chunk_tokens") if fused else None)

    def head_bytes(self, tokens: int) -> tuple[float, float, str]:
        """``(kept, transient, formula)``, bytes: what the final LayerNorm and the loss keep from the forward to the
        backward, and what the loss makes for a moment besides (its backward's logits gradients, or one chunk
        of the fused forward), for ``tokens`` tokens (module docstring)."""
        from ..core.linear_cross_entropy import chunk_tokens, held_bytes, transient_bytes

        T, h, V, e = tokens, self.hidden, self.vocab, self.element_bytes
        frozen = self.lora_targets is not None  # LoRA: the output layer frozen, its input and weight gradient not kept
        if self.loss != "fused":
            logit = max(4, e)  # float32 logits whatever the compute precision
            extra = LOGIT_COPIES - LOGIT_COPIES_HELD
            n = h + 2 if frozen else 2 * h + 2  # a frozen output layer keeps no input for its weight's gradient
            return (float(T * n * e + T * LOGIT_COPIES_HELD * V * logit), float(T * extra * V * logit),
                    f"b s ({'h' if frozen else '2 h'} + 2) e + b s {LOGIT_COPIES_HELD} V x {logit}, and {extra} b s V x "
                    f"{logit} at the loss's backward = {T} x {n} x {e} + {T} x {V} x {logit}, and {T} x {extra} x {V} x "
                    f"{logit}")
        norm = T * (2 * h + 2) * e
        C = min(T, self.loss_chunk or chunk_tokens(V))
        acc = max(4, e)
        held, transient = held_bytes(T, h, V, self.head_bias, acc), transient_bytes(V, C, e, hidden=h)
        if frozen:  # no weight (or bias) gradient for a frozen output layer
            held = acc * T * h
        return (float(norm + held), float(transient),
                f"b s (2 h + 2) e + {acc} (b s h{'' if frozen else ' + V h'}{' + V' if self.head_bias and not frozen else ''}"
                f"), and one chunk in the forward C V (4{' + 2 e) + 2 V h e' if e < 4 else ')'} = {T} x (2 x {h} + 2) x "
                f"{e} + {held}, and {transient} "
                f"(C = {C})")


def korthikanti_layer_bytes(seq: int, micro_batch: int, hidden: int, heads: int) -> float:
    """Korthikanti et al. 2022, eq. (1): one layer's activations in 16-bit with dropout, ``s b h (34 + 5 a s / h)``."""
    return seq * micro_batch * hidden * (34 + 5 * heads * seq / hidden)


@dataclass(frozen=True)
class ActivationBytes:
    """A micro-batch's activation memory per process at its peak (start of the backward), bytes.

    Attributes:
        blocks: what the transformer blocks keep (all of it without checkpointing; their inputs with it).
        recompute: one block's activations recomputed during its backward (checkpointing only; else 0).
        head: what the final LayerNorm and the loss keep: the saved log-softmax (:data:`LOGIT_COPIES_HELD`), or
            the fused loss's gradients (:meth:`TransformerShape.head_bytes`).
        head_transient: what the loss makes for a moment: two more logits copies at its backward, or one chunk of
            the fused forward.
        transient: the backward's transient gradients, ``calibration`` x one layer's activations.
        counted: blocks + recompute + head, as counted; total: ``counted + max(transient, head_transient)`` (the
            two never exist at once, module docstring).
        calibration: :data:`CALIBRATION` (0: the count as is).
        tokens: b s; checkpointing; measured (False: Korthikanti's layer count); formulas: with the numbers.
    """

    blocks: float
    recompute: float
    head: float
    head_transient: float
    transient: float
    counted: float
    total: float
    calibration: float
    tokens: int
    checkpointing: bool
    measured: bool
    formulas: dict

    def to_dict(self) -> dict:
        return asdict(self)


def activation_bytes(shape: TransformerShape, micro_batch: int, seq: int, *, checkpointing: bool = False,
                     calibration: float = CALIBRATION) -> ActivationBytes:
    """The activation bytes of one micro-batch of ``micro_batch`` x ``seq`` tokens (module docstring).

    Args:
        shape: the model (:class:`TransformerShape`).
        micro_batch: b, examples per micro-batch per process; seq: s, tokens per example.
        checkpointing: the blocks recompute their forward in backward (``--gradient_checkpointing``).
        calibration: one layer's activations counted this many times more, the backward's transient gradients
            (default :data:`CALIBRATION`).

    Raises:
        UsageError: b or s below 1 (names ``--per_device_train_batch_size`` / ``--block_size``).
    """
    for flag, v in (("--per_device_train_batch_size", micro_batch), ("--block_size", seq)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(flag, f"must be a positive integer (got {v!r})", "pass a positive integer")
    T, e, L, h = micro_batch * seq, shape.element_bytes, shape.layers, shape.hidden
    layer = shape.layer_elements_per_token(seq)
    if checkpointing:
        blocks, recompute = float(T * L * h * e), float(T * layer * e)
        bf = f"b s L h e = {T} x {L} x {h} x {e} (block inputs)"
        rf = f"b s x one layer x e = {T} x {layer:g} x {e}"
    else:
        first = shape.first_layer_saving()
        blocks, recompute = float(T * (L * layer - first) * e), 0.0
        bf, rf = f"b s L x one layer x e = {T} x {L} x {layer:g} x {e}", "0 (no checkpointing)"
        if first:
            bf = f"b s (L x one layer - first) e = {T} x ({L} x {layer:g} - {first:g}) x {e} (LoRA: first block)"
    head, head_transient, head_formula = shape.head_bytes(T)
    counted, transient = blocks + recompute + head, calibration * T * layer * e
    return ActivationBytes(
        blocks=blocks, recompute=recompute, head=head, head_transient=head_transient, transient=transient,
        counted=counted, total=counted + max(transient, head_transient),
        calibration=calibration, tokens=T, checkpointing=checkpointing, measured=shape.measured,
        formulas={"blocks": bf, "recompute": rf,
                  "head": head_formula,
                  "one_layer": ("30 h + a + 4 (GPT-2, SDPA, gelu_new)" if shape.measured else
                                "Korthikanti et al. 2022: (34 + 5 a s / h) h / 2") + f" = {layer:g} elements per token",
                  "transient": f"{calibration:g} x b s x one layer x e (fitted, CALIBRATION); the peak holds the larger "
                               "of it and the loss's transient"})


def peak_parts(costs: dict, activations: ActivationBytes, resident_before_training: float | None = None,
               communication_buffers: float = 0.0) -> dict:
    """The predicted peak per process by part, bytes: the cost table's row plus the activations.

    Args:
        costs: a :class:`accum_kit.engines.costs.PolicyCosts` as a dict (``parameter_shard_bytes``,
            ``optimizer_state_bytes``, ``gradient_bytes``, ``gathered_parameter_bytes``).
        activations: :func:`activation_bytes` of the run's micro-batch.
        resident_before_training: the process's measured resident set (or allocated bytes on CUDA) just
            before the first micro-batch, which holds the parameters already; None: no baseline part.
        communication_buffers: the engine's persistent gradient buffers (DDP's buckets,
            :meth:`accum_kit.engines.base.Engine.communication_buffer_bytes`): allocated before training but
            resident only from the first sync, so not in ``resident_before_training``.

    Returns:
        ``{"baseline", "parameters", "frozen_parameters", "gradients", "optimizer_state", "gathered_parameters",
        "communication_buffers", "activations", "logits", "total"}``; ``parameters`` the trainable ones (their
        shards), ``frozen_parameters`` the others (a LoRA run's base weights: held, or their shards, but with no
        gradient or optimizer state; 0 in full fine-tuning); ``baseline`` = ``resident_before_training`` - both
        (what the process holds besides its parameters: Python, the libraries, the data; 0 when not given).
    """
    params = float(costs.get("parameter_shard_bytes") or 0.0)
    frozen = float(costs.get("frozen_parameter_bytes") or 0.0)
    # the head's part: what it keeps, and its transient where that is the larger of the two transients
    head = activations.head + (activations.head_transient if activations.head_transient > activations.transient else 0.0)
    parts = {"baseline": max(0.0, resident_before_training - params) if resident_before_training is not None else 0.0,
             "parameters": params - frozen, "frozen_parameters": frozen,
             "gradients": float(costs.get("gradient_bytes") or 0.0),
             "optimizer_state": float(costs.get("optimizer_state_bytes") or 0.0),
             "gathered_parameters": float(costs.get("gathered_parameter_bytes") or 0.0),
             "communication_buffers": float(communication_buffers),
             "activations": activations.total - head, "logits": head}
    parts["total"] = sum(parts.values())
    return parts


def sharded_buffer_bytes(largest_unit: int, compute_bytes: int, reduce_bytes: int, *, keeps_gathered: bool,
                         reduces_each_micro_batch: bool, largest_trainable_unit: int | None = None) -> float:
    """FSDP2's communication buffers in flight during a backward, bytes: the largest unit's parameters
    all-gathered twice (the unit running and the next one, prefetched; 0 when the policy keeps every unit
    gathered) and, when every micro-batch reduce-scatters, its unsharded gradient copied into the
    reduce-scatter's input. A model of FSDP2's design, checked by the memory benchmark (docs/memory.md).

    Args:
        largest_unit: elements of the largest unit; compute_bytes: b_c; reduce_bytes: b_r.
        keeps_gathered: the policy's ``reshard_after_forward`` is False (``no_sync_no_reshard``).
        reduces_each_micro_batch: ``sync_each_batch`` (and HSDP's ``reduce_scatter_each_batch``).
        largest_trainable_unit: the trainable elements of the unit with the most (its reduce-scatter input; a
            LoRA run's adapters); None: ``largest_unit`` (full fine-tuning).
    """
    gathers = 0 if keeps_gathered else 2 * largest_unit * compute_bytes
    reduced = largest_unit if largest_trainable_unit is None else largest_trainable_unit
    return float(gathers + (reduced * reduce_bytes if reduces_each_micro_batch else 0))
