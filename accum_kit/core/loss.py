"""Token-count aware loss normalisation over one accumulation window.

The exact target of an accumulation window is the token-mean loss of one big
batch on one process::

    L = sum_{r, i} S_{r,i} / N,      N = sum_{r, i} n_{r,i}

where ``S_{r,i}`` is the summed token loss of micro-batch ``i`` on process ``r``
and ``n_{r,i}`` its number of target tokens (labels != -100). Two scalings sit
between a backward call and the gradient the optimizer sees:
``accelerator.backward`` divides the loss by K (``gradient_accumulation_steps``)
and DDP averages the gradients over the W processes. So backward of the plain
``S_{r,i}`` leaves ``sum S / (K W)`` after the boundary all-reduce, and one
multiplication of the gradients by ``K W / N`` makes it exact ("rescale after"
the boundary all-reduce; docs/design.md compares it with look-ahead). ``N`` is summed over processes with one all-reduce of a
3-element tensor (loss sum, tokens, micro-batches) per window, after the gradient all-reduce, so it needs no
look-ahead and nothing blocks earlier micro-batches; its result stays on the device (no host read: the
rescale factor is a tensor). A last partial window of
an epoch simply has a smaller ``N``: it is never divided by K.

Loss-scale headroom (fp16 with a GradScaler): each summed loss is divided by
a constant ``c`` before its backward, and ``c`` goes back into the boundary
rescale (``K W c / N``). ``c`` is a power of two close to the mean target
tokens per micro-batch, identical on every process and for every micro-batch
of a window, so the backward sees mean-sized gradients instead of ones about
(tokens per micro-batch) times larger. Because ``c`` is a power of two,
dividing by it and multiplying back are exact in binary floating point (no
rounding, barring underflow), so fp32 results are unchanged bit for bit.

References: the mean-of-means problem and its fix are described in the
transformers blog post "Fixing Gradient Accumulation" (Oct 2024, Trainer's
``num_items_in_batch``) and torchtune PR 1875; scaling the gradients once
after the backward passes instead of the losses before them is torchtune
PR 1917 (its ``scale_grads_``).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from .window_figures import WindowFigures

IGNORE_INDEX = -100
NORMALIZATIONS = ("tokens", "mean")

LossFn = Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], "tuple[torch.Tensor, torch.Tensor | int]"]


def scale_grads_(parameters, scale) -> None:
    """Multiply every existing ``.grad`` by ``scale`` in place.

    One ``torch._foreach_mul_`` per (device, dtype, device mesh) group of
    gradients, as torchtune's ``scale_grads_`` does, instead of a Python loop
    of ``mul_``: on GPU that is one fused kernel launch per group.

    Args:
        parameters: iterable of tensors; those whose ``.grad`` is None are skipped.
        scale: the factor (dimensionless): a Python float, passed to the kernel as an argument, or a
            one-element float64 tensor on the gradients' device, which stays there (no host read). The
            tensor is handed to each group rounded as the kernel rounds a Python float (:func:`_factor_type`),
            so both give the same bits. Gradients on another device (offloaded) get a copy, read there.
    """
    groups: dict = {}
    for p in parameters:
        if p.grad is not None:  # a sharded gradient's mesh too: DTensor takes a tensor factor on one mesh per call
            groups.setdefault((p.grad.device, p.grad.dtype, getattr(p.grad, "device_mesh", None)), []).append(p.grad)
    for (device, dtype, _), grads in groups.items():
        if isinstance(scale, torch.Tensor):
            torch._foreach_mul_(grads, scale.reshape(()).to(device=device, dtype=_factor_type(device, dtype)))
        else:
            torch._foreach_mul_(grads, scale)


def _factor_type(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The type ``torch._foreach_mul_(grads, python_float)`` rounds the float to (torch 2.x kernels): the type it
    computes in (``at::opmath_type``: float32 for 16-bit floats) on CUDA; on the CPU a 16-bit gradient's own type.
    (Checked bit for bit on the CPU by tests/test_callbacks.py; on CUDA from the kernels' source: a float is
    converted with ``to<opmath_t>``, and a tensor of another type than the gradients takes the per-tensor ``mul_``,
    which loads it as that type.)"""
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return dtype
    return _math_dtype(dtype)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type PyTorch's elementwise kernels compute ``dtype`` in (``at::opmath_type``): float32 for the
    16-bit floats, the type itself otherwise."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


_SQRT_HALF = math.sqrt(0.5)  # rounds up: a float m >= it exactly when m > 2^-0.5


def power_of_two(x):
    """The power of two nearest to ``x`` on a log scale (1 for ``x <= 1``): a float for a number, a tensor of
    ``x``'s type and device for a float tensor (computed there: no host read).

    ``x = m 2^e`` with ``0.5 <= m < 1`` (``frexp``); ``log2 x = e + log2 m`` rounds to ``e`` when
    ``m > 2^-0.5`` and to ``e - 1`` below (``m`` never equals the irrational ``2^-0.5``). Every step is exact
    (``x / m`` is ``2^e``), so a number and a tensor give the same value on any device. Dividing a float by
    the result and multiplying back is exact (only the exponent changes), which is why
    :class:`WindowNormalizer` rounds ``c`` to one.
    """
    if isinstance(x, torch.Tensor):
        m, _ = torch.frexp(x)
        p = x / m  # 2^e exactly (NaN for x = 0: not selected below)
        return torch.where(x > 1.0, torch.where(m >= _SQRT_HALF, p, p / 2), torch.ones_like(x))
    if x <= 1.0:
        return 1.0
    m, e = math.frexp(x)
    return math.ldexp(1.0, e if m >= _SQRT_HALF else e - 1)


def logits_causal_lm_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy of one micro-batch from the model's logits, and its target-token count.

    The plain formula: the reference path of :class:`CausalLMLoss` (``fused="off"``), the raw DDP baseline's
    loss, and the one for models whose output layer cannot compute the loss itself.

    Args:
        model: a causal LM returning ``.logits`` of shape (batch, seq, vocab).
        batch: ``input_ids`` and ``labels`` of shape (batch, seq), optionally
            ``attention_mask``; labels equal to -100 are ignored. Labels are
            shifted here (position t predicts token t+1, :func:`shifted_labels`),
            as transformers' ``ForCausalLMLoss`` does; a batch with ``shift_labels``
            (already shifted, e.g. one slice of a context-parallel split) uses
            them as they are.

    Returns:
        ``(summed_loss, num_tokens)``: a scalar tensor in nats (float32, float64
        for a float64 model), summed over target tokens, and a scalar int64
        tensor with the number of target tokens.
    """
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    logits = _at_least_float32(model(**inputs).logits)  # float32 already under Accelerate's autocast: no copy
    labels = shifted_labels(batch)  # the labels move, not the logits: a view, no copy of the (batch, seq, V) tensor
    summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                             reduction="sum")
    return summed, (labels != IGNORE_INDEX).sum()


def shifted_labels(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """(batch, seq) targets aligned with the positions: ``shift_labels`` as given (context parallel), else
    ``labels`` moved one position left with -100 at the end, so position t's target is token t+1 and the
    hidden states need no slicing (as transformers' ``ForCausalLMLoss`` pads the labels)."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    labels = batch["labels"]
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


FUSED_CHOICES = ("auto", "chunked", "torch", "off")


class CausalLMLoss:
    """The causal-LM ``loss_fn``: summed next-token cross-entropy and target tokens, by default without logits.

    ``loss(model, batch) -> (summed_loss, num_tokens)``, with the batch and the result as
    :func:`logits_causal_lm_loss`. Where the model's output layer allows it
    (:func:`accum_kit.core.fused_head.output_layer`: a ``torch.nn.Linear`` whose result the model returns
    unchanged, not split by tensor parallel), the layer computes the loss from the last hidden states in
    chunks of tokens (:mod:`accum_kit.core.linear_cross_entropy`) inside the model's own forward, so no
    (batch, seq, V) tensor is ever made; otherwise the logits' formula runs.

    Args:
        fused: ``"auto"`` (the chunked path where the model allows it, the logits otherwise), ``"chunked"`` or
            ``"torch"`` (that fused implementation, or an error), ``"off"`` (always the logits).
        chunk: tokens per chunk (None: a chunk's float32 logits take at most 64 MiB).

    Attributes:
        used: what the last call ran: ``{"fused_linear_cross_entropy": fused, "implementation": "chunked" |
            "torch" | "logits", "reason": why not fused (None when fused), "chunk_tokens": int | None}``
            (None before the first call); the train job writes it to ``train_summary.json``.

    Raises:
        UsageError (``--fused_linear_cross_entropy``): unknown ``fused``; a fused implementation asked for by
            name on a model whose output layer cannot serve it, or ``torch`` on a torch without
            ``linear_cross_entropy``.
    """

    def __init__(self, fused: str = "auto", chunk: int | None = None):
        from ..errors import UsageError

        if fused not in FUSED_CHOICES:
            raise UsageError("--fused_linear_cross_entropy", f"unknown value {fused!r}", f"use one of {FUSED_CHOICES}")
        if chunk is not None and int(chunk) < 1:
            raise UsageError("--fused_linear_cross_entropy_chunk", f"must be >= 1 token (got {chunk})",
                             "pass a positive token count or omit it")
        self.fused, self.chunk = fused, chunk
        self.used: dict | None = None

    def head(self, model):
        """The model's :class:`accum_kit.core.fused_head.FusedHead` when this loss fuses on it, else None (the reason
        goes to :attr:`used`)."""
        from ..errors import UsageError
        from .fused_head import FLAG, fused_head
        from .linear_cross_entropy import IMPLEMENTATIONS, chunk_tokens

        if self.fused == "off":
            self._record("logits", "off")
            return None
        name = "chunked" if self.fused == "auto" else self.fused
        if name == "torch" and not hasattr(F, "linear_cross_entropy"):
            raise UsageError(FLAG, f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy",
                             "use chunked (or auto), or torch >= 2.13")
        head, why = fused_head(model, IMPLEMENTATIONS[name], self.chunk)
        if head is None:
            if self.fused != "auto":
                raise UsageError(FLAG, f"{self.fused} cannot run on this model: {why}", f"pass {FLAG} off (or auto)")
            self._record("logits", why)
            return None
        self._record(name, None, self.chunk or chunk_tokens(head.vocab))
        return head

    def _record(self, implementation: str, reason, chunk: int | None = None):
        if self.used is None or self.used["implementation"] != implementation:
            self.used = {"fused_linear_cross_entropy": self.fused, "implementation": implementation, "reason": reason,
                         "chunk_tokens": chunk}

    def __call__(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.head(model)
        if head is None:
            return logits_causal_lm_loss(model, batch)
        target = shifted_labels(batch)
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
        summed, _ = head.loss(model, inputs, target)
        return summed, (target != IGNORE_INDEX).sum()

    @staticmethod
    def count_items(batch) -> torch.Tensor:
        """Target tokens of ``batch``, readable before the forward (DeepSpeed counts a window ahead)."""
        return _causal_lm_items(batch)

    def __repr__(self) -> str:
        return f"CausalLMLoss(fused={self.fused!r}, chunk={self.chunk})"


#: The default ``loss_fn`` of :func:`accum_kit.train_loop`: :class:`CausalLMLoss` with ``fused="auto"``.
causal_lm_loss = CausalLMLoss()


def check_supported(accelerator, mode: str) -> None:
    """Refuse a normalisation the Accelerator's distributed type cannot run exactly; today every type can.

    ``tokens`` rescales the synchronised gradients once per window (``K W c / N``)
    under DDP and FSDP2; under DeepSpeed, whose engine scales and owns the
    gradients, it counts the window first and scales each loss instead
    (:class:`accum_kit.engines.lookahead.LookaheadNormalizer`). Kept as the train job's
    early check so that a future engine without an exact path fails before any work.

    Raises:
        UsageError: ``mode`` is not one of :data:`NORMALIZATIONS`.
    """
    if mode not in NORMALIZATIONS:
        from ..errors import UsageError

        raise UsageError("--loss_normalization", f"unknown value {mode!r}", f"use one of {NORMALIZATIONS}")


def _causal_lm_items(batch) -> torch.Tensor:
    if "shift_labels" in batch:
        return (batch["shift_labels"] != IGNORE_INDEX).sum()
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def _at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """float16 / bfloat16 logits in float32 for the cross-entropy; float32 and float64 ones as they are."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# What the loss counts, readable before the forward (DeepSpeed counts a window ahead: accum_kit.engines.deepspeed).
logits_causal_lm_loss.count_items = _causal_lm_items


class WindowNormalizer:
    """Turns per-micro-batch summed losses into the window's exact gradient.

    Call :meth:`backward_loss` for every micro-batch (pass its result to
    ``accelerator.backward``) and :meth:`finish` once on the boundary
    micro-batch, after that backward and before clipping and the optimizer step.

    Args:
        accelerator: the ``accelerate.Accelerator`` in use (for K, W and the
            scalar all-reduce).
        mode: ``"tokens"``: divide by the target-token count of the whole
            window over all processes (exact); ``"mean"``: per-micro-batch mean
            divided by K, the arithmetic of Accelerate's gradient accumulation
            guide (a partial window is still divided by K).
        ranks: the :class:`accum_kit.core.token_ranks.TokenRanks` holding different tokens, over which the
            window's tokens are counted (None: every process; under tensor parallel the data-parallel x cp
            ranks, never tp; under context parallel it also cuts each micro-batch, see :meth:`batches`).
        gradient_mean_size: W, the processes the engine averages each gradient over (DDP: all; FSDP2: its
            ``(dp_replicate, dp_shard_cp)`` mesh, without tp); None: all processes.

    Raises:
        ValueError: unknown ``mode``.

    Note: ``tokens`` back-propagates ``S / c`` with ``c`` (:attr:`loss_divisor`)
    a power of two near the mean target tokens per micro-batch and per
    process: the previous window's (from the all-reduce :meth:`finish` does
    anyway), and for the first window the first micro-batch's token count
    averaged over processes (one extra scalar all-reduce per normalizer). The
    boundary rescale is ``K W c / N``. So the gradients before the rescale
    have the size of a mean loss's, and an fp16 GradScaler does not overflow
    where the summed loss would (tests/test_mixed_precision.py); in fp32 and
    bf16 the result is the same as without ``c`` (powers of two scale exactly).

    Nothing is read on the host (no ``item``, ``float(t)``, ``.cpu()``): ``c``
    (a 0-dim float64 tensor on the device), the window's sums, the rescale
    factor and the logged figures stay on the device (docs/loop.md, "Host
    reads"), so a GPU never waits for the host inside a window or at its end.
    """

    def __init__(self, accelerator, mode: str = "tokens", *, ranks=None, gradient_mean_size: int | None = None):
        from .token_ranks import TokenRanks

        if mode not in NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of {NORMALIZATIONS}, got {mode!r}")
        check_supported(accelerator, mode)
        self.accelerator, self.mode = accelerator, mode
        self.ranks = ranks if ranks is not None else TokenRanks(accelerator)
        self.gradient_mean_size = gradient_mean_size or accelerator.num_processes
        self._reset()
        self._set_divisor(None)  # c: a 0-dim float64 tensor on the device; None until the first micro-batch

    def _reset(self) -> None:
        # Local running sums kept as tensors: converting per micro-batch would
        # force a device sync on GPU. [summed loss or sum of means, target tokens, micro-batches]
        self._stats = None

    def _set_divisor(self, c) -> None:
        self.loss_divisor = c
        self._divisor_as: dict = {}  # c in each loss's (device, compute type), converted once per window

    def batches(self, iterable, loss_fn=None):
        """The batches to run: as they come, or this process's slice of each under context parallel.

        DeepSpeed's :class:`accum_kit.engines.lookahead.LookaheadNormalizer` reads a window ahead instead.
        """
        return iterable if self.ranks.split is None else map(self.ranks.part, iterable)

    @property
    def pending(self) -> bool:
        """True while a window has micro-batches that :meth:`finish` has not closed."""
        return self._stats is not None

    def backward_loss(self, summed_loss: torch.Tensor, num_items) -> torch.Tensor:
        """The loss of one micro-batch to hand to ``accelerator.backward``; reads nothing on the host.

        Args:
            summed_loss: scalar tensor, loss summed over the micro-batch's items.
            num_items: number of items (target tokens) in it, int or scalar tensor (a tensor on the loss's
                device, as the built-in losses return, is used where it is; an int is copied there).
        """
        n = torch.as_tensor(num_items, device=summed_loss.device)
        if self.mode == "tokens":
            if self.loss_divisor is None:
                self._set_divisor(self._first_divisor(n))
            loss, logged = self._divide(summed_loss), summed_loss
        else:
            loss = logged = summed_loss / n.clamp(min=1)
        step = torch.stack([logged.detach().double(), n.double(), torch.ones_like(n, dtype=torch.float64)])
        self._stats = step if self._stats is None else self._stats + step
        return loss

    def _first_divisor(self, n: torch.Tensor):
        """``c`` of the first window: the first micro-batch's tokens, averaged over processes (one all-reduce;
        the result stays on the device)."""
        total = self.ranks.sum(n.detach().double().reshape(1))
        return power_of_two(total.reshape(()) / self.ranks.size)

    def _divide(self, summed_loss: torch.Tensor) -> torch.Tensor:
        """``summed_loss / c`` in the loss's type, computed as dividing by the Python float c was: in the
        kernels' compute type (float32 for 16-bit losses), rounded back. Exact: c is a power of two."""
        c = self.loss_divisor
        if not isinstance(c, torch.Tensor):  # a float c (a test's fixed divisor)
            return summed_loss / c
        dtype = _math_dtype(summed_loss.dtype)
        key = (summed_loss.device, dtype)
        if key not in self._divisor_as:
            self._divisor_as[key] = c.to(device=summed_loss.device, dtype=dtype)
        return (summed_loss.to(dtype) / self._divisor_as[key]).to(summed_loss.dtype)

    @torch.no_grad()
    def finish(self, model: torch.nn.Module) -> WindowFigures:
        """Close the window: rescale gradients (``tokens`` mode) and return what to log; reads nothing on the host.

        One all-reduce of the window's ``[loss, tokens, micro-batches]`` (on the device); the rescale factor
        ``K W c / N``, the logged loss and the next window's ``c`` are computed from it there, in float64 as the
        Python numbers were (so the gradients are bit for bit those of a rescale by a Python float).

        Args:
            model: the prepared model whose ``.grad`` tensors hold the window's
                synchronised gradients.

        Returns:
            :class:`accum_kit.core.window_figures.WindowFigures`: the loss over the window in nats (token-mean
            over all processes for ``tokens``, mean of the micro-batch means for ``mean``) and the target-token
            count of the window summed over processes, read from the device when first asked for.
        """
        acc = self.accelerator
        stats = self._stats if self._stats is not None else torch.zeros(3, dtype=torch.float64, device=acc.device)
        loss_sum, tokens, micro = self.ranks.sum(stats).unbind()
        if self.mode == "tokens":
            # grads hold sum(S / c) / (K W) after backward's /K and the engine's mean over W: make them sum(S) / N.
            n = tokens.clamp(min=1.0)
            c = self.loss_divisor if self.loss_divisor is not None else 1.0
            kwc = acc.gradient_accumulation_steps * self.gradient_mean_size * c  # exact: c is a power of two
            if not isinstance(kwc, torch.Tensor):
                kwc = torch.full_like(n, kwc)  # float / tensor would multiply by a rounded reciprocal
            scale_grads_(model.parameters(), kwc / n)
            window_loss = loss_sum / n
            # Next window's c: this window's mean tokens per micro-batch per process (same on every process).
            self._set_divisor(power_of_two(tokens / micro.clamp(min=1.0)))
        else:
            window_loss = loss_sum / micro.clamp(min=1.0)
        self._reset()
        return WindowFigures(torch.stack([window_loss, tokens]))
