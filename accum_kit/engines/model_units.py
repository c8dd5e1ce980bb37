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
    """

    resharded: tuple[int, ...]
    kept: tuple[int, ...] = ()
    source: str = ""

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
        """From the profiler's ``fsdp_units`` (``parameters``, ``reshard_after_forward`` per unit)."""
        return cls(tuple(u["parameters"] for u in units if u["reshard_after_forward"]),
                   tuple(u["parameters"] for u in units if not u["reshard_after_forward"]), source)


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


def dtype_bytes(mixed_precision: str) -> tuple[int, int, int]:
    """(b_p, b_c, b_r) for ``--mixed_precision`` ``no`` / ``bf16`` / ``fp16`` under accum-kit's FSDP2 plugin.

    accum-kit gives low precision ``MixedPrecisionPolicy(param_dtype=<low>,
    reduce_dtype=float32)`` (:func:`accum_kit.engines.fsdp2.fsdp_plugin_for`):
    fp32 master parameters, gathered in the low precision, gradients reduced
    and accumulated in fp32.
    """
    return (4, 4, 4) if mixed_precision in (None, "no") else (4, 2, 4)
