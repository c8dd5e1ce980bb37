"""Summed cross-entropy of a linear output layer, in chunks of tokens: no (tokens, vocabulary) tensor at once.

A causal LM's last step is ``logits = hidden @ W.T (+ bias)``, a (tokens, V) tensor, followed by the
cross-entropy. At 8 x 1024 tokens and GPT-2's V = 50257 one float32 copy of the logits is 1.65 GB, and
the usual path holds several (the logits, a float32 cast under autocast, the log-softmax the loss saves,
their gradients): the largest tensors of a step. :func:`chunked_linear_cross_entropy` computes the same
sum ``sum_i [logsumexp(z_i) - z_i[t_i]]`` over ``C`` tokens at a time: each chunk's logits exist only
while that chunk is processed, and the chunk's gradients with respect to the hidden states and the
weight are computed right there (``softmax(z) - onehot(t)`` times the inputs), so nothing of size V is
kept per token for the backward. The technique is the one of Liger-Kernel's fused linear cross-entropy
(Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training", arXiv:2410.10989, section
3.1) and of Apple's cut-cross-entropy (Wijmans et al. 2024, arXiv:2411.09009), here in plain PyTorch ops
so that it runs on every device; the FLOPs are those of the unfused path (one matmul forward, two for the
gradients).

Precision is that of the unfused path, chunk for chunk: the chunk's logits come from the same
``F.linear`` (so under ``torch.autocast`` the matmul runs in the autocast dtype, as it would in the
model), the log-sum-exp and the gradient of the logits are computed in float32 (float64 for a float64
model), and the weight's gradient is accumulated over chunks in float32 (float64).

What it holds between the forward and the backward, in bytes, for ``N`` tokens, hidden size ``h``,
vocabulary ``V`` and ``a`` = 4 (8 for float64): ``a N h`` (the gradient of the hidden states) +
``a V h`` (of the weight) + ``a V`` (of the bias, when there is one); during the forward, one chunk:
``C V`` elements of logits in float32 plus, under autocast, their ``C V`` copies and the weight's ``V h`` in the
autocast dtype (:func:`transient_bytes`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
#: Default bytes of one chunk's float32 logits (the chunk's token count is this over ``4 V``, at least 1).
CHUNK_BYTES = 64 * 2**20


def chunk_tokens(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that a chunk's float32 logits take at most ``chunk_bytes`` bytes (at least 1 token).

    Measured on 2 CPU cores (1024 tokens, h = 512, V = 50257, forward + backward of the loss alone): 256
    tokens per chunk (51 MB of logits) took 0.98 s against 1.03 s for the unfused loss in float32, and about
    the same in bf16; 64 tokens per chunk was 8 % slower (fp32) and 1.9x slower (bf16), so chunks should
    not be much smaller than a few hundred tokens.
    """
    return max(1, int(chunk_bytes) // (4 * int(vocab)))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are kept in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i CE(hidden_i @ W.T + b, target_i)``; the gradients are computed in the forward, chunk by chunk, and
    multiplied by the incoming gradient (a scalar) in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, chunk):
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        acc = _acc_dtype(weight.dtype)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if want_b else None
        weight_c = None  # the weight in the matmuls' dtype (autocast's), cast once for every chunk
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start:start + chunk], target[start:start + chunk]
            z = F.linear(h, weight, bias)  # under autocast: the autocast dtype, as in the model
            logits = z if z.dtype == _acc_dtype(z.dtype) else z.to(_acc_dtype(z.dtype))
            valid = t != IGNORE_INDEX
            safe = torch.where(valid, t, 0)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            top = logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(top).exp_()  # in place: one (C, V) float tensor for the whole chunk
            sums = probs.sum(dim=1)
            total += torch.where(valid, sums.log() + top.squeeze(1) - picked, 0.0).sum().to(acc)
            if want_h and weight_c is None:
                weight_c = weight.to(z.dtype)  # no copy in float32
            if want_h or want_w or want_b:
                _chunk_gradients(probs, sums, safe, valid, picked, z.dtype, h, weight_c, start, chunk, acc,
                                 grad_h, grad_w, grad_b)
            # free this chunk's (C, V) tensors before the next chunk's matmul makes its own (measured: without
            # this, two chunks' logits were alive at once at the loss's peak)
            del z, logits, probs
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        # in place: no second (V, h) tensor at the peak; a second backward through the same graph (retain_graph)
        # then fails loudly in autograd's saved-tensor version check instead of reusing scaled values
        grad_h, grad_w, grad_b = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        return (None if grad_h is None else grad_h.mul_(grad_out).to(h_dtype),
                None if grad_w is None else grad_w.mul_(grad_out).to(w_dtype),
                None if grad_b is None else grad_b.mul_(grad_out).to(b_dtype), None, None)


def _chunk_gradients(probs, sums, safe, valid, picked, dtype, h, weight_c, start, chunk, acc, grad_h, grad_w,
                     grad_b):
    """One chunk's gradients, added into the sums: ``probs`` (C, V, float32, overwritten) becomes
    ``softmax - onehot(target)`` (zero on ignored tokens), the gradient of the chunk's logits; ``weight_c`` is the
    output weight in ``dtype`` (None when the hidden states need no gradient)."""
    probs.div_(sums[:, None])
    probs.scatter_add_(1, safe[:, None], torch.full_like(picked[:, None], -1.0))
    probs.mul_(valid[:, None])
    d = probs.to(dtype)  # the matmuls' dtype (autocast's); no copy in float32
    if grad_h is not None:
        grad_h[start:start + chunk] = d @ weight_c
    if grad_w is not None:
        if d.dtype == acc:  # added in place by the matmul: no (V, h) product next to the sum
            grad_w.addmm_(d.t(), h)
        else:  # autocast: the product in the compute dtype, then added into the float32 sum
            grad_w += d.t() @ h.to(dtype)
    if grad_b is not None:
        grad_b += probs.sum(dim=0).to(acc)


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                 bias: torch.Tensor | None = None, *, chunk: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T + bias`` against ``target``, ``chunk`` tokens at a time.

    Args:
        hidden: (N, h) hidden states (any float dtype; under ``torch.autocast`` the matmuls run in its dtype).
        weight: (V, h) output layer weight; bias: (V,) or None.
        target: (N,) int64 class ids; ``-100`` is ignored (no loss, no gradient).
        chunk: tokens per chunk (None: :func:`chunk_tokens` of V).

    Returns:
        A scalar in nats, float32 (float64 for float64 inputs): the sum over the tokens that are not ignored
        (0 when all are). Differentiable with respect to ``hidden``, ``weight`` and ``bias``.

    Raises:
        ValueError: shapes that do not fit together.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or target.shape != hidden.shape[:1]:
        raise ValueError(f"chunked_linear_cross_entropy: hidden (N, h), weight (V, h), target (N,) expected, got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, target, int(chunk or chunk_tokens(weight.shape[0])))


def torch_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, *, chunk: int | None = None) -> torch.Tensor:
    """The same sum through PyTorch's ``torch.nn.functional.linear_cross_entropy`` (torch >= 2.13) with its chunked
    options (``torch.nn.LinearCrossEntropyOptions``, ``batch_chunk_size=chunk``). Arguments as
    :func:`chunked_linear_cross_entropy`.

    Measured on 2 CPU cores (torch 2.13, 1024 tokens, h 512, V 50257, forward + backward): 2.9 s in float32
    against 1.0 s for :func:`chunked_linear_cross_entropy`; under bf16 autocast 5 s or more, and its result
    was the float32 one (autocast does not reach inside it), so it is not the default anywhere.

    Raises:
        RuntimeError: this torch has no ``linear_cross_entropy``.
    """
    fn = getattr(F, "linear_cross_entropy", None)
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if fn is None or options is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (torch >= 2.13)")
    return fn(hidden, weight, target, linear_bias=bias, reduction="sum", ignore_index=IGNORE_INDEX,
              options=options(batch_chunk_size=chunk) if chunk else options())


#: Implementations by name (``--fused_linear_cross_entropy``).
IMPLEMENTATIONS = {"chunked": chunked_linear_cross_entropy, "torch": torch_linear_cross_entropy}


def transient_bytes(vocab: int, chunk: int, compute_bytes: int = 4, hidden: int = 0) -> int:
    """Bytes one chunk allocates during the forward: ``chunk x V`` float32 logits (one chunk at a time: each is
    freed before the next is made, and in float32 the weight's gradient is added in place) and, when the matmul
    runs in a narrower dtype (``compute_bytes`` 2 under bf16 / fp16 autocast), its output and the logits'
    gradient in that dtype (``2 x chunk x V x compute_bytes``), the weight in that dtype and the chunk's
    weight-gradient product before it is added into the float32 sum (``2 x V x hidden x compute_bytes``)."""
    extra = 2 * compute_bytes if compute_bytes < 4 else 0
    weight = 2 * vocab * hidden * compute_bytes if compute_bytes < 4 else 0
    return chunk * vocab * (4 + extra) + weight


def held_bytes(tokens: int, hidden: int, vocab: int, bias: bool = False, acc_bytes: int = 4) -> int:
    """Bytes :func:`chunked_linear_cross_entropy` keeps from its forward to its backward: the gradients of the hidden
    states (``tokens x hidden``), of the weight (``vocab x hidden``) and of the bias (``vocab``), in the
    accumulation dtype (``acc_bytes`` 4; 8 for a float64 model)."""
    return acc_bytes * (tokens * hidden + vocab * hidden + (vocab if bias else 0))
