"""The plain PyTorch loop on one process: what people write before they reach for a toolkit.

The one-process ``accum-kit bench`` times :func:`accum_kit.train_loop` against it, and its first loss is
the kit's oracle there (same weights, same data). It is PyTorch's automatic mixed precision recipe with
gradient accumulation (https://pytorch.org/docs/stable/notes/amp_examples.html, "Gradient accumulation"):
for every micro-batch the model's own mean loss (a transformers causal LM given ``labels``) under
``torch.autocast`` when a low-precision dtype is asked for, divided by K, ``backward``; on the window's last
micro-batch the optional clipping (after ``GradScaler.unscale_`` under float16), ``optimizer.step()`` and
``optimizer.zero_grad()``. No Accelerate, no wrapper, no host read inside the loop.

Its update is the mean over the window's K micro-batches of each micro-batch's mean token loss; with the same
number of target tokens in every micro-batch (the bench's default data) that is the token mean of the window,
the update of :func:`accum_kit.train_loop`.
"""

from __future__ import annotations

import torch

from ..core.callbacks import CallbackList, LoopState


def train_plain(model, optimizer, batches, gradient_accumulation_steps: int, max_train_steps: int, device, *,
                autocast_dtype=None, scaler=None, max_grad_norm: float | None = None, callbacks=()) -> list[float]:
    """Train ``max_train_steps`` optimizer steps of K micro-batches each; return each step's loss.

    Args:
        model: a causal LM on ``device`` that returns ``.loss`` (its mean over the micro-batch's targets) when
            called with ``labels``.
        optimizer: any ``torch.optim`` optimizer over ``model``'s parameters.
        batches: an iterator of dicts of (batch, seq) tensors (``input_ids``, ``labels`` with -100 = ignored,
            optionally ``attention_mask``), moved to ``device`` here; it must yield K x ``max_train_steps``.
        gradient_accumulation_steps: K, micro-batches per optimizer step.
        max_train_steps: optimizer steps.
        device: the ``torch.device`` the model is on.
        autocast_dtype: ``torch.bfloat16`` or ``torch.float16``: run the forward under
            ``torch.autocast(device.type, dtype)``; None: no autocast (float32).
        scaler: a ``torch.amp.GradScaler`` (float16), or None.
        max_grad_norm: clip the global gradient norm to this before the step; None or 0: no clipping.
        callbacks: :class:`accum_kit.LoopCallback` objects; only ``on_train_begin``, ``on_step_end`` and
            ``on_train_end`` are called (a timer's hooks: nothing inside the window).

    Returns:
        One loss per optimizer step, nats: the mean of the window's micro-batch mean losses (read from the
        device after the last step).

    Raises:
        StopIteration: ``batches`` ran out before the last step.
    """
    K = gradient_accumulation_steps
    hooks, state, losses = CallbackList(callbacks), LoopState(), []
    model.train()
    hooks("on_train_begin", state)
    for _ in range(max_train_steps):
        for _ in range(K):
            batch = {k: v.to(device) for k, v in next(batches).items()}
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = model(**batch).loss
            losses.append(loss.detach())
            loss = loss / K
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None and max_grad_norm:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        hooks("on_step_end", state)
    hooks("on_train_end", state)
    return torch.stack(losses).double().view(-1, K).mean(dim=1).tolist() if losses else []
