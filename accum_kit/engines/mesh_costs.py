"""What a dense transformer costs per window and per process on a mesh R x S x cp x tp (torch-free).

The model is Llama-style (``transformers.LlamaForCausalLM``): L layers of width h with a attention
heads (a_kv key/value heads of width d = h / a), an MLP of inner width f (SwiGLU: gate, up, down), a
vocabulary of V tokens, RMSNorm weights, no biases. The mesh is :class:`accum_kit.engines.mesh.Mesh`
(Accelerate's dims ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``). Tensor parallel follows
transformers' own tp plan of the model: q, k, v, gate, up ``colwise`` (output features split over tp),
o, down ``rowwise`` (input features split), the embedding ``embedding_rowwise`` (vocab-parallel), the
head ``colwise_gather_output`` (vocab split, logits gathered); the 2 L + 1 RMSNorm weights stay whole
on every tp rank. Context parallel is Ulysses (DeepSpeed's ``DistributedAttention``): every process
holds s / cp tokens of each sequence, and attention all-to-alls q, k, v (sequence-split to
head-split) and its output (back). FSDP2 shards every parameter (the tp rank's local slice) over
``dp_shard_cp`` (S cp processes) and replicates over R.

**Data parallel** (:func:`accum_kit.engines.costs.policy_costs`, unchanged): each tp rank's FSDP2
group of R S cp processes runs exactly the collectives the cost table counts for the same policy on
the same units, with each unit's parameters the tp rank's local ones:

- layer unit: ``(2 h^2 + 2 h a_kv d + 3 h f) / tp + 2 h``;
- head unit (kept after forward): ``V h / tp + h`` (lm_head, final norm; with a tied embedding, once);
- root unit (kept): ``V h / tp`` (the embedding; nothing when tied).

So parameters, gradients, gathered parameters and optimizer state per process are the table's
(divided by S cp) of ``P_tp = (tp-sharded parameters) / tp + (norm weights)``. Vocabularies and
head counts that do not divide by tp are refused (heads) or rounded up (V: the largest rank's slice);
FSDP2's padding is left out as in the table.

**Tensor parallel**, per micro-batch, in the tp group (tp processes; ``T = b s / cp`` tokens per
process, ``e`` bytes per activation element), counted from transformers 5.24's tp layers (each
``colwise`` module turns its replicated input into a DTensor on its own, so its input gradient is
all-reduced per module; a ``rowwise`` output is Partial and all-reduced in forward):

=========================  =====================================  ====================
pass                       collectives                            elements each
=========================  =====================================  ====================
forward                    all-reduce: o, down per layer; embed.  T h      (2 L + 1)
forward                    all-gather: the logits                 T V      (1)
backward                   all-reduce: q, k, v, gate, up inputs;  T h      (5 L + 1)
                           the head's input
=========================  =====================================  ====================

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism", arXiv:1909.08053, section 3 and figure 4) fuses q k v and gate up, which
gives its 2 all-reduces per layer per pass (4 L per micro-batch): the forward count here is that, the
backward 5 L instead of 2 L because transformers does not fuse. These run on every micro-batch:
``no_sync`` does not touch them.

**Context parallel** (Ulysses; Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models", arXiv:2309.14509, section 3.1: four
all-to-alls per layer in forward; their backward is an all-to-all each, DeepSpeed's
``_SeqAllToAll.backward``): per layer and micro-batch 4 in forward (q, k, v, attention output) and 4
in backward, in the cp group. Each process's buffer is its tensor: ``T h / tp`` elements (q, output)
or ``T a_kv d / tp`` (k, v); it keeps 1/cp of it and sends 1/cp to each of the cp - 1 peers.

Activations per micro-batch per process (what autograd keeps until the backward): per token and layer
``6 h + 2`` elements outside tp (two RMSNorms: input, normalised, rsqrt, output) plus
``(2 h + 2 a_kv d + a + 4 f) / tp`` inside it (SDPA's q, k, v, output and log-sum-exp; gate, up, SiLU
and product), counted per storage on eager Llama with SDPA, torch 2.13 / transformers 5.24, at tp 1
and 2; with cp the output all-to-all's result is a tensor of its own (``+ h / tp``, an estimate: not
measured); the head keeps ``3 h + 1`` per token in the compute dtype and, under tp (the logits are gathered:
the loss cannot be computed in the vocabulary-split output layer, :mod:`accum_kit.core.fused_head`),
``LOGIT_COPIES V`` float32 logits per token; without tp the train job's default loss computes the cross-entropy
in the output layer in chunks (``fused=True``): ``T h + V h`` float32 gradients and one chunk's logits instead
(:meth:`accum_kit.engines.activation_memory.TransformerShape.head_bytes`). All on ``T = b s / cp`` tokens. The backward's transient gradients
(:data:`accum_kit.engines.activation_memory.CALIBRATION`) are not included. Activation checkpointing is not
modelled here (its recompute would run the forward's tp all-reduces and cp all-to-alls again in backward).

Checked (tests/test_mesh_costs.py, one process, torch's fake process group): the local parameters per
unit, the tp collectives of a forward and a backward (``CommDebugMode``) and the saved activations at tp
1 and 2 of a transformers Llama split by its own tp plan. Estimates (``MeshCosts.estimates``): the cp
all-to-all counts (Ulysses' design, not counted on a run), cp's activation copy, the left-out transient
gradients and FSDP2's padding.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace

from ..errors import UsageError
from ..job.models import LLAMA_PRESETS
from .activation_memory import LOGIT_COPIES
from .costs import PolicyCosts, policy_costs
from .model_units import ADAMW_STATE_BYTES, ShardedModel

TP_FLAG, CP_FLAG = "--tp_size", "--cp_size"


@dataclass(frozen=True)
class DenseTransformer:
    """A Llama-style decoder's shape (counts; elements).

    Attributes:
        layers: L; hidden: h; heads: a; kv_heads: a_kv (grouped-query attention; a for plain multi-head);
        ffn: f, the MLP's inner width; vocab: V; tied: the head shares the embedding's weight.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    source: str = ""

    @classmethod
    def from_config(cls, config: dict, source: str = "") -> "DenseTransformer":
        """From a Llama config as a dict (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
        ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``).

        Raises:
            UsageError: a field missing or not a positive integer (names ``--config_name``).
        """
        keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
        bad = [k for k in keys if not isinstance(config.get(k), int) or isinstance(config.get(k), bool)
               or config[k] < 1]
        if bad:
            raise UsageError("--config_name", f"the config has no positive integer {bad[0]}",
                             "pass a Llama-style config.json (transformers' LlamaConfig fields)")
        kv = config.get("num_key_value_heads") or config["num_attention_heads"]
        return cls(config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"], int(kv),
                   config["intermediate_size"], config["vocab_size"], bool(config.get("tie_word_embeddings", False)),
                   source)

    @property
    def head_dim(self) -> int:
        """d = h / a."""
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """a_kv d: the k (and v) projection's output features."""
        return self.kv_heads * self.head_dim

    @property
    def layer_sharded(self) -> int:
        """A layer's tp-sharded parameters: q, o ``h^2`` each, k, v ``h a_kv d`` each, gate, up, down ``h f``."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_width + 3 * h * self.ffn

    @property
    def parameters(self) -> int:
        """All parameters (elements): L layers, embedding, head (once when tied), 2 L + 1 norm weights."""
        h, V = self.hidden, self.vocab
        return self.layers * (self.layer_sharded + 2 * h) + V * h * (1 if self.tied else 2) + h

    def units(self, tp: int = 1) -> ShardedModel:
        """FSDP2's units (``TRANSFORMER_BASED_WRAP``) holding one tp rank's local parameters (module docstring)."""
        h, vh = self.hidden, -(-self.vocab // tp) * self.hidden
        kept = (vh + h,) if self.tied else (vh + h, vh)
        return ShardedModel(tuple([self.layer_sharded // tp + 2 * h] * self.layers), kept,
                            f"{self.source or 'Llama-style'}: tp rank's local parameters, tp {tp}")


#: Shapes the mesh plan knows by name: the train job's Llama presets (:data:`accum_kit.job.models.LLAMA_PRESETS`,
#: their V from ``--vocab_size``) and the published Meta-Llama-3-8B config
#: (huggingface.co/meta-llama/Meta-Llama-3-8B, config.json).
MESH_PRESETS = {
    **{name: None for name in LLAMA_PRESETS},
    "llama3_8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
}


def dense_transformer(model_preset: str | None = None, config_name: str | None = None,
                      vocab_size: int = 384) -> DenseTransformer:
    """The model of a preset of :data:`MESH_PRESETS` or of a ``config.json`` (a file, or a folder holding one).

    Raises:
        UsageError: neither or both given, an unknown preset (``--model_preset``), an unreadable config
            (``--config_name``).
    """
    if (model_preset is None) == (config_name is None):
        raise UsageError("--model_preset", "the mesh plan needs one model" if model_preset is None else
                         "conflicts with --config_name", f"pass --model_preset (one of {sorted(MESH_PRESETS)}) "
                         "or --config_name <Llama config.json>, not both")
    if config_name is not None:
        path = os.path.join(config_name, "config.json") if os.path.isdir(config_name) else config_name
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise UsageError("--config_name", f"cannot read {path}: {e}", "pass a config.json file or its folder")
        if not isinstance(config, dict):
            raise UsageError("--config_name", f"{path} is not a JSON object", "pass a Llama config.json")
        return DenseTransformer.from_config(config, path)
    if model_preset not in MESH_PRESETS:
        raise UsageError("--model_preset", f"{model_preset!r} is not a Llama-style model (the tp plan is "
                         "Llama's)", f"use one of {sorted(MESH_PRESETS)}, or --config_name <config.json>")
    config = MESH_PRESETS[model_preset] or dict(LLAMA_PRESETS[model_preset], vocab_size=vocab_size)
    return DenseTransformer.from_config(config, f"preset {model_preset}")


def check_mesh(model: DenseTransformer, mesh, seq: int) -> None:
    """Whether ``model`` runs on ``mesh`` with sequences of ``seq`` tokens.

    Raises:
        UsageError: tp not dividing the attention or key/value heads (``--tp_size``); cp not dividing the
            heads left per tp rank (Ulysses splits heads) or the sequence (``--cp_size``); a size below 1.
    """
    tp, cp = getattr(mesh, "tp", 1), getattr(mesh, "cp", 1)
    for flag, v in ((TP_FLAG, tp), (CP_FLAG, cp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(flag, f"must be a positive integer (got {v!r})", "pass 1 (off) or more")
    a, kv = model.heads, model.kv_heads
    if a % tp or kv % tp:
        ok = [d for d in range(1, kv + 1) if kv % d == 0 and a % d == 0]
        raise UsageError(TP_FLAG, f"{tp} does not divide the {a} attention heads and {kv} key/value heads "
                         "(colwise q, k, v split whole heads)", f"pass one of {ok}")
    if (a // tp) % cp or (kv // tp) % cp:
        ok = [d for d in range(1, kv // tp + 1) if (kv // tp) % d == 0 and (a // tp) % d == 0]
        raise UsageError(CP_FLAG, f"{cp} does not divide the {a // tp} heads and {kv // tp} key/value heads per "
                         f"tp rank (Ulysses' all-to-all gives each cp rank whole heads)", f"pass one of {ok}")
    if seq % cp:
        raise UsageError(CP_FLAG, f"a sequence of {seq} tokens (--block_size) does not split into {cp} equal "
                         "slices", f"pass a --block_size that is a multiple of {cp}, or a --cp_size dividing {seq}")


@dataclass(frozen=True)
class Collective:
    """One kind of collective per window in one group: calls, bytes (nccl-tests' S: the whole buffer of
    an all-reduce or all-gather; an all-to-all's per-process buffer), and the formula with its numbers."""

    kind: str
    group: str
    group_size: int
    calls: int
    bytes: float
    formula: str
    per_micro_batch: bool  # runs on every micro-batch (no_sync leaves it alone)


@dataclass(frozen=True)
class MeshCosts:
    """One layout's costs: memory per process (bytes) and collectives per window, by group.

    Attributes:
        mesh: ``{"dp_replicate_size", "dp_shard_size", "cp_size", "tp_size"}``; policy; K; micro_batch b;
            seq s; tokens_per_process: ``b s / cp`` per micro-batch.
        data_parallel: the cost table's row (:class:`PolicyCosts` as a dict) of one tp rank's FSDP2 group.
        memory: ``parameters``, ``gradients``, ``optimizer_state``, ``gathered_parameters``, ``activations``,
            ``total`` per process (activations: one micro-batch's saved tensors, module docstring).
        collectives: the :class:`Collective` list (FSDP group's, tp group's, cp group's).
        no_sync_saves: what ``no_sync`` saves against ``sync_each_batch`` per window, by group: bytes
            (data parallel only: tp's and cp's are per micro-batch and stay).
        estimates: which figures are estimates, and why.
    """

    mesh: dict
    policy: str
    accumulation_steps: int
    micro_batch: int
    seq: int
    tokens_per_process: int
    data_parallel: dict
    memory: dict
    collectives: list
    no_sync_saves: dict
    estimates: list = field(default_factory=list)

    def group_totals(self) -> dict:
        """``{group: {"calls", "bytes"}}`` per window, summed over the group's collective kinds."""
        out = {}
        for c in self.collectives:
            g = out.setdefault(c.group, {"calls": 0, "bytes": 0.0})
            g["calls"] += c.calls
            g["bytes"] += c.bytes
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "group_totals": self.group_totals()}


def _data_parallel(dp: PolicyCosts, fsdp: int, R: int) -> list[Collective]:
    S = fsdp // R
    shard = f"fsdp ({S})"
    out = [Collective("all_gather", shard, S, dp.all_gather_calls, float(dp.all_gather_bytes),
                      dp.formulas.get("all_gather", ""), False),
           Collective("reduce_scatter", shard, S, dp.reduce_scatter_calls, float(dp.reduce_scatter_bytes),
                      dp.formulas.get("reduce_scatter", ""), False)]
    if R > 1:
        out.append(Collective("all_reduce", f"dp_replicate ({R})", R, dp.all_reduce_calls, float(dp.all_reduce_bytes),
                              dp.formulas.get("all_reduce", ""), False))
    return out


def tp_collectives(model: DenseTransformer, tp: int, tokens: int, K: int, e: int) -> list[Collective]:
    """The tp group's collectives per window of K micro-batches of ``tokens`` tokens per process (module
    docstring's table); empty when tp is 1. ``e``: bytes per activation element."""
    if tp < 2:
        return []
    L, h, V = model.layers, model.hidden, model.vocab
    g = f"tp ({tp})"
    return [Collective("all_reduce", g, tp, K * (2 * L + 1), float(K * (2 * L + 1) * tokens * h * e),
                       f"forward: K (2 L + 1) = {K} x (2 x {L} + 1) calls of T h e = {tokens} x {h} x {e} "
                       "(o, down per layer; the vocab-parallel embedding)", True),
            Collective("all_gather", g, tp, K, float(K * tokens * V * e),
                       f"forward: K = {K} calls of T V e = {tokens} x {V} x {e} (the head's logits)", True),
            Collective("all_reduce", g, tp, K * (5 * L + 1), float(K * (5 * L + 1) * tokens * h * e),
                       f"backward: K (5 L + 1) = {K} x (5 x {L} + 1) calls of T h e = {tokens} x {h} x {e} "
                       "(q, k, v, gate, up inputs per layer; the head's input); Megatron-LM's fused count: "
                       f"2 L = {2 * L} per micro-batch", True)]


def cp_collectives(model: DenseTransformer, cp: int, tp: int, tokens: int, K: int, e: int) -> list[Collective]:
    """The cp group's all-to-alls per window (Ulysses, module docstring); empty when cp is 1."""
    if cp < 2:
        return []
    L, h, kvw = model.layers, model.hidden, model.kv_width
    width = (2 * h + 2 * kvw) // tp  # q + output + k + v, per tp rank
    calls, n_bytes = 8 * L * K, float(2 * L * K * tokens * width * e)
    return [Collective("all_to_all", f"cp ({cp})", cp, calls, n_bytes,
                       f"8 L K = 8 x {L} x {K} calls (q, k, v, output; forward and backward); buffers 2 L K T "
                       f"(2 h + 2 a_kv d) / tp e = 2 x {L} x {K} x {tokens} x (2 x {h} + 2 x {kvw}) / {tp} x {e}; "
                       f"each process sends (cp - 1) / cp of them, 1/cp to each peer: {n_bytes * (cp - 1) / cp:.6g} B",
                       True)]


def activation_bytes_per_process(model: DenseTransformer, tp: int, cp: int, tokens: int, e: int,
                                 fused: bool = False) -> tuple[float, str]:
    """One micro-batch's saved activations per process (module docstring), bytes, and the formula.

    ``fused``: the loss is computed in the output layer in chunks where it can be (tp = 1); else the logits."""
    from ..core.linear_cross_entropy import chunk_tokens, held_bytes, transient_bytes

    L, h, a, f, kvw, V = model.layers, model.hidden, model.heads, model.ffn, model.kv_width, model.vocab
    sharded = 2 * h + 2 * kvw + a + 4 * f + (h if cp > 1 else 0)
    layer = 6 * h + 2 + sharded / tp
    body = float(tokens * (L * layer + 3 * h + 1) * e)
    lead = (f"T (L (6 h + 2 + (2 h + 2 a_kv d + a + 4 f{' + h' if cp > 1 else ''}) / tp) + 3 h + 1) e"
            f" = {tokens} x ({L} x ({6 * h + 2} + {sharded} / {tp}) + {3 * h + 1}) x {e}")
    if fused and tp == 1:
        C, acc = min(tokens, chunk_tokens(V)), max(4, e)
        loss = held_bytes(tokens, h, V, False, acc) + transient_bytes(V, C, e, hidden=h)
        return body + loss, f"{lead} + {acc} (T h + V h) + one chunk of {C} tokens' logits = {loss:g} (fused loss)"
    logit = max(4, e)  # float32 logits whatever the compute precision
    return body + tokens * LOGIT_COPIES * V * logit, f"{lead} + T {LOGIT_COPIES} V x {logit} = {tokens} x {LOGIT_COPIES} x {V} x {logit}"


def mesh_costs(model: DenseTransformer, mesh, *, policy: str, accumulation_steps: int, micro_batch: int, seq: int,
               param_bytes: int = 4, compute_bytes: int | None = None, reduce_bytes: int | None = None,
               optimizer_bytes: int = ADAMW_STATE_BYTES, fused: bool = False) -> MeshCosts:
    """The costs of ``policy`` on ``mesh`` per window (collectives by group) and per process (memory).

    Args:
        model: the :class:`DenseTransformer`.
        mesh: an :class:`accum_kit.engines.mesh.Mesh` (``replicate`` R, ``shard`` S, ``tp``, ``cp``).
        policy: an accumulation policy of :data:`accum_kit.engines.policies.POLICIES`.
        accumulation_steps: K, micro-batches per window.
        micro_batch: b, examples per micro-batch per data-parallel rank (shared by its tp and cp ranks).
        seq: s, tokens per example (cp ranks hold s / cp each).
        param_bytes, compute_bytes, reduce_bytes, optimizer_bytes: b_p, b_c (also the activations' and tp/cp
            collectives' bytes per element), b_r, b_o, as in :func:`accum_kit.engines.costs.policy_costs`.
        fused: price the head as the loss computed in the output layer in chunks where there is no tp (the train
            job's default), else as the full float32 logits.

    Raises:
        UsageError: :func:`check_mesh`'s; b or s below 1; the policy's (unknown, HSDP-only with R = 1).
    """
    check_mesh(model, mesh, seq)
    for flag, v in (("--per_device_train_batch_size", micro_batch), ("--block_size", seq)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(flag, f"must be a positive integer (got {v!r})", "pass a positive integer")
    R, S, tp, cp = mesh.replicate, mesh.shard, getattr(mesh, "tp", 1), getattr(mesh, "cp", 1)
    K, fsdp = accumulation_steps, R * S * cp
    b_c = compute_bytes or param_bytes
    kw = dict(world_size=fsdp, param_bytes=param_bytes, compute_bytes=b_c, reduce_bytes=reduce_bytes,
              optimizer_bytes=optimizer_bytes, replicate_size=R)
    units = model.units(tp)
    dp = policy_costs(policy, units, accumulation_steps=K, **kw)
    held = policy_costs(policy, units, accumulation_steps=max(K, 2), **kw)  # a window of one holds them in backward
    tokens = micro_batch * seq // cp
    acts, acts_f = activation_bytes_per_process(model, tp, cp, tokens, b_c, fused)
    memory = {"parameters": dp.parameter_shard_bytes, "gradients": held.gradient_bytes,
              "optimizer_state": dp.optimizer_state_bytes, "gathered_parameters": held.gathered_parameter_bytes,
              "activations": acts}
    memory["total"] = sum(memory.values())
    dp = replace(dp, activation_bytes=acts, formulas={**dp.formulas, "activations": acts_f})
    collectives = (_data_parallel(dp, fsdp, R) + tp_collectives(model, tp, tokens, K, b_c)
                   + cp_collectives(model, cp, tp, tokens, K, b_c))
    sync = policy_costs("sync_each_batch", units, accumulation_steps=K, **kw)
    nos = policy_costs("no_sync", units, accumulation_steps=K, **kw)
    saved = {f"fsdp ({fsdp // R})": float(sync.reduce_scatter_bytes - nos.reduce_scatter_bytes
                                          + sync.all_gather_bytes - nos.all_gather_bytes),
             **({f"dp_replicate ({R})": sync.all_reduce_bytes - nos.all_reduce_bytes} if R > 1 else {}),
             **({f"tp ({tp})": 0.0} if tp > 1 else {}), **({f"cp ({cp})": 0.0} if cp > 1 else {})}
    estimates = ["activations: saved tensors of eager Llama with SDPA (counted at tp 1 and 2 on CPU), the "
                 "backward's transient gradients left out",
                 "FSDP2's padding of each parameter's first dimension to a multiple of S cp is left out"]
    if cp > 1:
        estimates += ["cp all-to-alls: from DeepSpeed-Ulysses' design (4 per layer and pass), not counted on a run",
                      "cp activations: the output all-to-all's result as a tensor of its own (+ h / tp per token "
                      "and layer), not measured"]
    return MeshCosts(mesh={"dp_replicate_size": R, "dp_shard_size": S, "cp_size": cp, "tp_size": tp}, policy=policy,
                     accumulation_steps=K, micro_batch=micro_batch, seq=seq, tokens_per_process=tokens,
                     data_parallel=dp.to_dict(), memory=memory, collectives=collectives, no_sync_saves=saved,
                     estimates=estimates)


def layout_meshes(num_processes: int, replicate: int, tp: int, cp: int) -> dict:
    """The layouts the plan compares on W processes: data parallel only, dp x tp, dp x cp, dp x cp x tp (the
    latter three when their sizes are above 1), as ``{name: Mesh}`` with S = W / (R cp tp).

    Raises:
        UsageError: R tp cp not dividing W (naming ``--tp_size`` or ``--cp_size``).
    """
    from .mesh import Mesh

    W, R = num_processes, replicate
    wanted = {"data parallel": (1, 1)}
    if tp > 1:
        wanted["dp x tp"] = (tp, 1)
    if cp > 1:
        wanted["dp x cp"] = (1, cp)
    if tp > 1 and cp > 1:
        wanted["dp x cp x tp"] = (tp, cp)
    if W % R:
        raise UsageError("--parallelism_config_dp_replicate_size", f"{R} does not divide --num_processes {W}",
                         "pass a divisor of --num_processes")
    out = {}
    for name, (t, c) in wanted.items():
        if (W // R) % (t * c):
            flag = TP_FLAG if (W // R) % t else CP_FLAG
            ok = [d for d in range(1, W // R + 1) if (W // R) % d == 0]
            raise UsageError(flag, f"tp x cp = {t} x {c} does not divide the {W // R} processes of each replica "
                             f"(--num_processes {W} / dp_replicate {R})", f"pass sizes whose product is one of {ok}")
        S = W // (R * t * c)
        if R > 1 and S * c == 1:
            raise UsageError("--parallelism_config_dp_replicate_size", f"{R} replicas leave {name} one process to "
                             f"shard over (dp_shard x cp = 1): that is DDP, which a parallelism config refuses",
                             f"pass a smaller replicate size, or a smaller --tp_size than {t}")
        out[name] = Mesh(R, S, tp=t, cp=c)
    return out
