"""A tiny mixture-of-experts language model with one ``nn.Module`` per expert, and data that decides which micro-batch
of a window (and which rank) sends tokens to which expert (not a test module).

transformers' Mixtral / OLMoE / Qwen2-MoE keep their experts in one 3-D parameter, so every expert's weights get
a gradient from every backward; an MoE whose experts are separate modules gives an expert's parameters no
gradient at all in a backward in which it received no token. That is what this model is for.

Routing is fixed by the token id (no learned choice, so a test can force it): ``ROUTES[t]`` lists the experts of
token ``t`` in order, the first ``top_k`` of them are used, weighted by the router's softmax probabilities of the
chosen experts (top-1: the probability itself, as the Switch Transformer; top-2: renormalised over the two, as
Mixtral), so the router gets a gradient from every token. Tokens ``0 .. COMMON - 1`` go to experts 0 and 1; each
routing pattern of :data:`PATTERNS` has a special token that goes to its own expert first (then expert 0), so one
run exercises every pattern at once, one expert each (``EXPERT_OF``).

:func:`pattern_examples` builds a dataset whose special tokens land where the routing patterns say, given
Accelerate's data layout (``shuffle=False``, ``split_batches=False``: data-parallel rank ``r`` gets global
micro-batches ``r, r + W, r + 2W, ...``, so micro-batch ``j`` of window ``s`` on rank ``r`` is global batch
``s K W + j W + r`` while windows are full).
"""

from __future__ import annotations

import random
import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

#: pattern -> whether micro-batch ``j`` (0-based, in its window) on data-parallel rank ``r`` sends tokens to the
#: pattern's expert; ``boundary``: it is the window's last micro-batch
PATTERNS = {
    "first": lambda j, boundary, r: j == 0,
    "middle": lambda j, boundary, r: j == 1 and not boundary,
    "last": lambda j, boundary, r: boundary,
    "one_rank_first": lambda j, boundary, r: r == 0 and j == 0,
    "one_rank_last": lambda j, boundary, r: r == 0 and boundary,
    "never": lambda j, boundary, r: False,
}
COMMON, DIM, SEQ = 12, 8, 6
#: experts 0 and 1 take the common tokens; expert 2 + i takes the special token COMMON + i of pattern i
EXPERT_OF = {name: 2 + i for i, name in enumerate(PATTERNS)}
EXPERTS, VOCAB = 2 + len(PATTERNS), COMMON + len(PATTERNS)
#: token -> its experts in order of preference (top-1 uses the first)
ROUTES = [[0, 1] if t % 2 == 0 else [1, 0] for t in range(COMMON)] + [[EXPERT_OF[p], 0] for p in PATTERNS]

class Expert(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class MoEBlock(nn.Module):
    """Router and experts; ``forward(h, input_ids)`` calls only the experts that received a token."""

    def __init__(self, dim: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(EXPERTS))
        self.register_buffer("routes", torch.tensor(ROUTES), persistent=False)

    def forward(self, h, input_ids):
        flat = h.reshape(-1, h.size(-1))
        choice = self.routes[input_ids.reshape(-1), : self.top_k]  # (tokens, k)
        probs = torch.softmax(self.router(flat), dim=-1).gather(-1, choice)
        if self.top_k > 1:
            probs = probs / probs.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = (choice == e).nonzero(as_tuple=True)
            if tok.numel():  # an expert without tokens is not called: its parameters get no gradient
                out = out.index_add(0, tok, probs[tok, slot, None].to(flat.dtype) * expert(flat[tok]))
        return out.reshape(h.shape)


class TinyMoE(nn.Module):
    """Embedding, one residual MoE block (one FSDP unit: ``_no_split_modules``), output head; ``.logits`` out."""

    _no_split_modules = ["MoEBlock"]

    def __init__(self, top_k: int = 1):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = MoEBlock(DIM, top_k)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, attention_mask=None, **_):
        h = self.embed(input_ids)
        h = h + self.block(h, input_ids)
        return CausalLMOutput(logits=self.head(h))  # a dict: DDP's find_unused_parameters finds its tensors


class DenseWithUnused(nn.Module):
    """A dense model (no experts) with a parameter the loss never uses: embedding, one residual linear layer, output
    head, and ``unused`` (a linear layer no forward calls). ``.logits`` out."""

    def __init__(self, top_k: int = 1):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.unused = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, attention_mask=None, **_):
        h = self.embed(input_ids)
        h = h + torch.tanh(self.mix(h))
        return CausalLMOutput(logits=self.head(h))


#: ``cell["model"]`` -> the model class (tests/moe_worker.py, tests/test_moe.py's oracle)
MODELS = {"moe": TinyMoE, "dense": DenseWithUnused}
UNUSED_NAMES = ["unused.weight", "unused.bias"]  # DenseWithUnused's parameters no token reaches


def expert_names(index: int) -> list[str]:
    """The parameter names of expert ``index`` in :class:`TinyMoE`."""
    return [f"block.experts.{index}.{m}.{w}" for m in ("up", "down") for w in ("weight", "bias")]


def pattern_examples(patterns, *, K: int, W: int, B: int, windows: int, tail: int, seed: int = 0) -> list[dict]:
    """Examples (``input_ids`` and ``labels`` of ``SEQ`` tokens) in dataset order for ``windows`` full windows of
    ``K`` micro-batches of ``B`` examples on each of ``W`` ranks, then a partial window of ``tail`` micro-batches.

    Every example of a micro-batch that :data:`PATTERNS` ``[p]`` selects, for each ``p`` in ``patterns``, holds
    pattern ``p``'s special token once (at a position of its own); the other tokens are common ones."""
    rng = random.Random(seed)
    out = []
    for s in range(windows + (1 if tail else 0)):
        k = K if s < windows else tail
        for j in range(k):
            for r in range(W):
                specials = [COMMON + i for i, p in enumerate(PATTERNS) if p in patterns and PATTERNS[p](j, j == k - 1, r)]
                for _ in range(B):
                    ids = [rng.randrange(COMMON) for _ in range(SEQ)]
                    for pos, token in zip(rng.sample(range(SEQ), len(specials)), specials):
                        ids[pos] = token
                    out.append({"input_ids": ids, "labels": list(ids)})
    return out
