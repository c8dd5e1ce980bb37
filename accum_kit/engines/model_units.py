"""How FSDP2 splits a model into units (:class:`ShardedModel`), GPT-2's units, and bytes per element (torch-free).

The cost table (:mod:`accum_kit.engines.costs`) prices each policy from these: P_f parameters in the
U_f units resharded after forward, P_0 in the U_0 units kept, bytes per stored, gathered and reduced
element.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..job.models import PRESETS

#: Bytes per element of the dtypes a run can use.
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
#: AdamW keeps two fp32 moments per parameter (torch.optim.AdamW, ``exp_avg`` and ``exp_avg_sq``).
ADAMW_STATE_BYTES = 8


@dataclass(frozen=True)
class ShardedModel:
    """How FSDP2 splits a model into units: the parameters (elements, unsharded) of each unit.

    Attributes:
        resharded: one entry per unit that frees its gathered parameters after
            forward (the transformer layers); their sum is P_f, their count U_f.
        kept: one entry per unit that keeps them until its backward (the root,
            Accelerate's output-head unit); sum P_0, count U_0.
        source: where the split comes from (for the report).
        trainable: the elements of each unit that require a gradient, in the order of ``(*resharded, *kept)``;
            None: every parameter is trained (full fine-tuning). A LoRA run (``peft``) freezes the model's
            weights and trains its adapters: every parameter is still gathered and held, but only the trainable
            ones get gradients, optimizer state and reductions (FSDP2 reduce-scatters a unit only when one of its
            parameters has a gradient).
    """

    resharded: tuple[int, ...]
    kept: tuple[int, ...] = ()
    source: str = ""
    trainable: tuple[int, ...] | None = None

    @property
    def parameters(self) -> int:
        """P = P_f + P_0."""
        return sum(self.resharded) + sum(self.kept)

    @property
    def layer_parameters(self) -> int:
        """P_f."""
        return sum(self.resharded)

    @property
    def other_parameters(self) -> int:
        """P_0."""
        return sum(self.kept)

    @property
    def units(self) -> int:
        """U = U_f + U_0."""
        return len(self.resharded) + len(self.kept)

    @property
    def trainable_parameters(self) -> int:
        """P_t: the elements that require a gradient (P when :attr:`trainable` is None)."""
        return self.parameters if self.trainable is None else sum(self.trainable)

    @property
    def trainable_units(self) -> int:
        """U_t: the units holding a trainable parameter, the ones that reduce gradients (U when all train)."""
        return self.units if self.trainable is None else sum(1 for t in self.trainable if t)

    @property
    def frozen_parameters(self) -> int:
        """P - P_t: the frozen elements (held and gathered, never reduced)."""
        return self.parameters - self.trainable_parameters

    @property
    def largest_trainable_unit(self) -> int:
        """Trainable elements of the unit with the most of them (its reduce-scatter input)."""
        return max(self.trainable if self.trainable is not None else (*self.resharded, *self.kept), default=0)

    @property
    def recompute_forward_fraction(self) -> float:
        """P_f / P: the share of one forward that activation checkpointing runs again in backward (the blocks).

        Forward FLOPs taken as 2 per parameter and token (Kaplan et al. 2020, "Scaling Laws for Neural Language
        Models", C_forward = 2N), so a block's share is its share of the parameters; attention's
        sequence-length terms and the difference between an embedding lookup and a matmul are left out. The
        step-time model prices it as ``c (1 + fraction x forward share)``
        (:func:`accum_kit.planning.step_time.recompute_factor`).
        """
        return self.layer_parameters / self.parameters if self.parameters else 0.0

    @classmethod
    def from_units(cls, units: list[dict], source: str = "") -> "ShardedModel":
        """From the profiler's ``fsdp_units`` (``parameters``, ``reshard_after_forward``, and optionally
        ``trainable_parameters`` per unit: absent or equal to ``parameters`` everywhere means full fine-tuning)."""
        order = [u for u in units if u["reshard_after_forward"]] + [u for u in units if not u["reshard_after_forward"]]
        trainable = tuple(u.get("trainable_parameters", u["parameters"]) for u in order)
        frozen = any(t != u["parameters"] for t, u in zip(trainable, order))
        return cls(tuple(u["parameters"] for u in units if u["reshard_after_forward"]),
                   tuple(u["parameters"] for u in units if not u["reshard_after_forward"]), source,
                   trainable if frozen else None)


def gpt2_units_for(n_layer: int, n_embd: int, vocab_size: int, n_positions: int, source: str = "") -> ShardedModel:
    """The FSDP2 units of a ``transformers`` GPT-2 (tied embedding and head) under ``TRANSFORMER_BASED_WRAP``.

    A GPT-2 block of width d has ``12 d^2 + 13 d`` parameters (attention
    ``c_attn`` 3d^2 + 3d and ``c_proj`` d^2 + d, MLP ``c_fc`` 4d^2 + 4d and
    ``c_proj`` 4d^2 + d, two LayerNorms 4d): one resharded unit each. Kept
    after forward: the output-head unit (the tied embedding/head
    ``vocab_size x d`` and the final LayerNorm 2d) and the root (the position
    embedding ``n_positions x d``).
    """
    d = n_embd
    block = 12 * d * d + 13 * d
    return ShardedModel(tuple([block] * n_layer), (vocab_size * d + 2 * d, n_positions * d),
                        source or f"GPT-2: {n_layer} blocks x {block} + head {vocab_size} x {d} + {2 * d} "
                                  f"+ positions {n_positions} x {d}")


def gpt2_units(preset: str, vocab_size: int, n_positions: int) -> ShardedModel:
    """:func:`gpt2_units_for` of a preset of :data:`accum_kit.job.models.PRESETS`.

    Raises:
        UsageError: unknown preset (names ``--model_preset``).
    """
    if preset not in PRESETS:
        raise UsageError("--model_preset", f"unknown preset {preset!r}", f"use one of {sorted(PRESETS)}")
    cfg = PRESETS[preset]
    units = gpt2_units_for(cfg["n_layer"], cfg["n_embd"], vocab_size, n_positions)
    return ShardedModel(units.resharded, units.kept, f"preset {preset} ({units.source})")


#: GPT-2's linear layers in a block by peft's names, as (input, output) widths in units of d; ``c_proj`` names two
#: (attention d -> d, MLP 4d -> d), and peft wraps both when it is targeted.
GPT2_LINEARS = {"c_attn": ((1, 3),), "c_proj": ((1, 1), (4, 1)), "c_fc": ((1, 4),)}
#: peft's ``all-linear`` on GPT-2: every linear layer of the blocks (the output layer left out).
GPT2_ALL_LINEAR = ("c_attn", "c_proj", "c_fc")


def gpt2_lora_targets(target_modules) -> tuple[str, ...]:
    """The GPT-2 block layers ``--lora_target_modules`` names (None: peft's default for GPT-2, ``c_attn``;
    ``all-linear``: :data:`GPT2_ALL_LINEAR`), sorted.

    Raises:
        UsageError (``--lora_target_modules``): a name that is no linear layer of a GPT-2 block.
    """
    if target_modules is None:
        return ("c_attn",)
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if names == ["all-linear"]:
        return GPT2_ALL_LINEAR
    unknown = [n for n in names if n not in GPT2_LINEARS]
    if unknown or not names:
        raise UsageError("--lora_target_modules", f"{', '.join(unknown) or 'nothing'} names no linear layer of a "
                         "GPT-2 block", f"pass some of {', '.join(GPT2_ALL_LINEAR)} (or all-linear)")
    return tuple(sorted(set(names)))


def gpt2_lora_block_parameters(d: int, r: int, targets) -> int:
    """Elements of the LoRA adapters in one GPT-2 block of width d at rank r: ``r (d_in + d_out)`` per wrapped
    layer (``lora_A`` r x d_in, ``lora_B`` d_out x r; Hu et al. 2021), i.e. 4 r d for ``c_attn``, 2 r d + 5 r d
    for the two ``c_proj``, 5 r d for ``c_fc``."""
    return sum(r * (i + o) * d for t in gpt2_lora_targets(targets) for i, o in GPT2_LINEARS[t])


def with_lora(units: ShardedModel, n_layer: int, d: int, r: int, targets=None) -> ShardedModel:
    """``units`` (a GPT-2's, :func:`gpt2_units_for`) with LoRA adapters of rank r on ``targets`` in every block:
    each block unit holds its adapters too, which are the only trainable parameters (the head and the embeddings
    frozen)."""
    if len(units.resharded) != n_layer:
        raise ValueError(f"{len(units.resharded)} resharded units for {n_layer} blocks")
    lora = gpt2_lora_block_parameters(d, r, targets)
    return ShardedModel(tuple(u + lora for u in units.resharded), units.kept,
                        f"{units.source}; LoRA r {r} on {', '.join(gpt2_lora_targets(targets))}: {lora} per block",
                        (lora,) * n_layer + (0,) * len(units.kept))


def dtype_bytes(mixed_precision: str) -> tuple[int, int, int]:
    """(b_p, b_c, b_r) for ``--mixed_precision`` ``no`` / ``bf16`` / ``fp16`` under accum-kit's FSDP2 plugin.

    accum-kit gives low precision ``MixedPrecisionPolicy(param_dtype=<low>,
    reduce_dtype=float32)`` (:func:`accum_kit.engines.fsdp2_plugin.fsdp_plugin_for`):
    fp32 master parameters, gathered in the low precision, gradients reduced
    and accumulated in fp32.
    """
    return (4, 4, 4) if mixed_precision in (None, "no") else (4, 2, 4)
