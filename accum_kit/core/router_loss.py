"""Mixture-of-experts: the router's load-balancing loss under accumulation, per window or per micro-batch.

A mixture-of-experts layer routes each token to its top-k experts. The load-balancing loss of the Switch
Transformer (Fedus et al. 2021, https://arxiv.org/abs/2101.03961, equations 4-6), as transformers computes
it for Mixtral, Qwen2-MoE and OLMoE (``load_balancing_loss_func``), is, over a set of tokens::

    aux = E * sum_e f_e * P_e

with E experts, ``f_e`` the fraction of (token, layer) rows whose top-k includes expert e and ``P_e`` the
mean router probability of e over the same rows (transformers pools the layers: rows = layers x tokens,
padding excluded). The model adds ``router_aux_loss_coef * aux`` to its language-model loss.

Under accumulation the set of tokens is the question. Computed per micro-batch and added per micro-batch
(the usual loop, and what transformers' model does on each call), the update depends on how the window is
split: the fractions of a micro-batch are not the window's. :class:`RouterAuxLoss` offers both:

- ``scope="window"``: the loss one big batch of the whole window on one process would compute. ``f`` is not
  differentiable, so the gradient is ``E * sum_e f_e^window * dP_e^window``, and ``P^window`` is a sum over
  the window's rows: every micro-batch back-propagates ``E * f^window . (its own probability sums) /
  rows^window``. ``f^window`` must be known before the first backward, so the window is read ahead and
  routed once without gradients (a forward pass per micro-batch: the cost), its counts summed over the
  ranks holding different tokens in one all-reduce.
- ``scope="micro_batch"``: each micro-batch's own ``aux``, averaged over the window's micro-batches on all
  ranks (transformers' per-call definition, accumulated). It needs the window's token and micro-batch
  counts ahead (no forward).

Both scale their term by the window's target-token count N (known ahead too) so that the loop's
normalisation, which divides every gradient by N once per window (:mod:`accum_kit.core.loss`), leaves
exactly ``coef * aux``: the update is ``grad(LM token mean + coef * aux)`` of the chosen definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UsageError
from .loss import IGNORE_INDEX, CausalLMLoss, shifted_labels
from .read_ahead import read_ahead

SCOPES = ("window", "micro_batch")
FLAG = "--router_aux_loss_scope"


def moe_settings(model) -> tuple[int, int, float, int]:
    """``(experts, top_k, router_aux_loss_coef, layers)`` of a transformers mixture-of-experts model's config.

    Raises:
        UsageError (:data:`FLAG`): a model whose config names no experts (not a mixture of experts).
    """
    config = getattr(getattr(model, "module", model), "config", None)
    experts = next((getattr(config, n) for n in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(config, n, None)), None)
    if experts is None:
        raise UsageError(FLAG, f"{type(model).__name__} is not a mixture-of-experts model (its config names no "
                         "experts)", "drop the flag, or train a mixture-of-experts model (--model_preset moe_tiny)")
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", 1)
    return int(experts), int(top_k), float(getattr(config, "router_aux_loss_coef", 0.0)), int(config.num_hidden_layers)


def _rows_mask(batch) -> torch.Tensor:
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    return (torch.ones_like(ids) if mask is None else mask).reshape(-1).float()


def _target_count(batch) -> torch.Tensor:
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def route_counts(router_logits, mask: torch.Tensor, experts: int, top_k: int) -> torch.Tensor:
    """Per expert, the (row, layer) pairs whose top-k includes it, padding excluded: shape (experts,), float64.

    Args:
        router_logits: one tensor per layer, each (rows, experts) with rows = batch x sequence.
        mask: (rows,) 1.0 for a real token, 0.0 for padding.
    """
    counts = torch.zeros(experts, dtype=torch.float64, device=mask.device)
    for logits in router_logits:
        chosen = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1).indices
        counts.scatter_add_(0, chosen.reshape(-1), mask.double().repeat_interleave(top_k))
    return counts


class RouterAuxLoss:
    """``loss_fn`` for :func:`accum_kit.train_loop`: causal-LM token loss plus the router's load-balancing loss.

    Args:
        accelerator: the run's Accelerator.
        model: the prepared model (read-ahead routing runs it without gradients, ``scope="window"``).
        scope: ``"window"`` (the big batch's definition, exact) or ``"micro_batch"`` (see the module docstring).
        ranks: the :class:`accum_kit.core.token_ranks.TokenRanks` to sum over (None: the run's engine's).
        lm_loss: the :class:`accum_kit.core.loss.CausalLMLoss` whose setting the LM part follows (None: the default,
            the output layer computing the loss in chunks where the model allows it).

    Attributes:
        windows: one record per closed window (:meth:`close_window`): ``lm_loss`` (nats, token mean),
            ``aux_loss_window`` and ``aux_loss_micro_batch_mean`` (both definitions' values, whichever trained),
            ``tokens_per_expert`` (routed (token, layer) pairs per expert over the window and all ranks) and
            ``expert_balance`` (the busiest expert's share over the mean share; 1.0 is perfect balance).

    Raises:
        UsageError (``--router_aux_loss_scope``): an unknown scope, or a model that is not a mixture of experts.
    """

    def __init__(self, accelerator, model, scope: str = "window", ranks=None, lm_loss=None):
        if scope not in SCOPES:
            raise UsageError(FLAG, f"unknown value {scope!r}", f"use one of {SCOPES}")
        self.accelerator, self.model, self.scope = accelerator, model, scope
        self.lm_loss = lm_loss if lm_loss is not None else CausalLMLoss()
        self.experts, self.top_k, self.coef, self.layers = moe_settings(model)
        if ranks is None:
            from ..engines import engine_of

            ranks = engine_of(accelerator).token_ranks(accelerator)
        self.ranks = ranks
        self.windows: list[dict] = []
        self._ahead = None  # the window's totals read ahead: counts (E), rows, targets, micro-batches
        self._local = None  # this window's running sums on this rank (detached)

    # ---- reading the window ahead ------------------------------------------------------------
    def window_batches(self, iterable):
        """Yield ``iterable``'s batches, reading each window ahead (K batches, fewer at the end of the data).

        ``scope="window"``: each batch is routed once without gradients to count its experts; then one
        all-reduce of the window's counts, rows, target tokens and micro-batches over the token ranks.
        """
        return read_ahead(self.accelerator, iterable, self._read)

    def _read(self, window) -> None:
        """The window's totals over the token ranks: expert counts (``scope="window"``), rows, targets, micro-batches."""
        acc = self.accelerator
        totals = torch.zeros(self.experts + 3, dtype=torch.float64, device=acc.device)
        for batch in window:
            part = self.ranks.part(batch)
            mask = _rows_mask(part).to(acc.device)
            if self.scope == "window":
                with torch.no_grad():  # only the routing is read: logits for one position, not (batch, seq, V)
                    out = self.model(**self._inputs(part), output_router_logits=True, logits_to_keep=1)
                totals[: self.experts] += route_counts(out.router_logits, mask, self.experts, self.top_k)
            totals[self.experts] += mask.sum().double() * self.layers  # on the device: no host read per batch
            totals[self.experts + 1] += self._targets(part).to(acc.device, torch.float64)
            totals[self.experts + 2] += 1.0
        self._ahead = self.ranks.sum(totals).cpu()  # the window's one read ahead: __call__ scales by its numbers

    @staticmethod
    def _inputs(batch) -> dict:
        return {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}

    def count_items(self, batch) -> torch.Tensor:
        """The target tokens :meth:`__call__` will count in ``batch`` (DeepSpeed's window normaliser counts ahead)."""
        return self._targets(batch)

    @staticmethod
    def _targets(batch) -> torch.Tensor:
        if "shift_labels" in batch:
            return (batch["shift_labels"] != IGNORE_INDEX).sum()
        return _target_count(batch)

    # ---- the loss of one micro-batch -----------------------------------------------------------
    def __call__(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(summed LM loss + the aux term scaled for the window, target tokens)`` of one micro-batch."""
        if self._ahead is None:
            raise RuntimeError("RouterAuxLoss needs its window read ahead: iterate the batches through "
                               "window_batches (accum_kit.train_loop does)")
        head = self.lm_loss.head(model)  # the output layer computes the LM loss where it can (no logits)
        labels = shifted_labels(batch)
        if head is not None:
            lm, out = head.loss(model, self._inputs(batch), labels, output_router_logits=True)
        else:
            out = model(**self._inputs(batch), output_router_logits=True)
            lm = F.cross_entropy(out.logits.float().reshape(-1, out.logits.size(-1)), labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="sum")
        n = (labels != IGNORE_INDEX).sum()
        mask = _rows_mask(batch).to(lm.device)
        probs = sum((torch.softmax(l.float(), dim=-1) * mask[:, None]).sum(dim=0) for l in out.router_logits)
        counts = route_counts([l.detach() for l in out.router_logits], mask, self.experts, self.top_k)
        rows = mask.sum().double() * self.layers
        win_counts, win_rows, win_targets, win_micro = (self._ahead[: self.experts], *self._ahead[self.experts:])
        micro_aux = self.experts * ((counts / rows.clamp(min=1)) * (probs.detach().double() / rows.clamp(min=1))).sum()
        if self.scope == "window":
            f = (win_counts / max(float(win_rows), 1.0)).to(probs.device, probs.dtype)
            aux = self.experts * (f * probs).sum() / max(float(win_rows), 1.0)
        else:
            f_mb = (counts / rows.clamp(min=1)).to(probs.dtype)
            aux = self.experts * (f_mb * probs).sum() / rows.clamp(min=1).to(probs.dtype) / max(float(win_micro), 1.0)
        step = torch.cat([torch.stack([lm.detach().double(), n.double(), rows, micro_aux, torch.ones((), dtype=torch.float64)]),
                          counts, probs.detach().double()])
        self._local = step if self._local is None else self._local + step
        # the loop divides every gradient by the window's N: multiply by it so that coef * aux is what remains
        return lm + self.coef * float(win_targets) * aux, n

    # ---- the window's record -------------------------------------------------------------------
    def close_window(self) -> dict:
        """Sum this window's detached figures over the token ranks (one all-reduce; call on every rank at the
        window's end, after its last micro-batch) and append the record to :attr:`windows`."""
        local = self._local if self._local is not None else \
            torch.zeros(5 + 2 * self.experts, dtype=torch.float64, device=self.accelerator.device)
        total = self.ranks.sum(local).cpu()
        lm, n, rows, micro_aux_sum, micro = total[:5].tolist()
        counts, probs = total[5: 5 + self.experts], total[5 + self.experts:]
        f, p = counts / max(rows, 1.0), probs / max(rows, 1.0)
        share = counts / max(float(counts.sum()), 1.0)
        record = {"lm_loss": lm / max(n, 1.0), "aux_loss_window": float(self.experts * (f * p).sum()),
                  "aux_loss_micro_batch_mean": micro_aux_sum / max(micro, 1.0),
                  "tokens_per_expert": [int(round(c)) for c in counts.tolist()],
                  "expert_balance": float(share.max() * self.experts) if counts.sum() > 0 else float("nan"),
                  "scope": self.scope}
        self.windows.append(record)
        self._local = None
        return record


class RouterWindowRecords:
    """Loop callback that closes :class:`RouterAuxLoss`'s window record at each optimizer step (every rank).

    Args:
        loss: the run's :class:`RouterAuxLoss`.
        log: optional ``log(record, step)`` called on every rank with the window's record (e.g. tracker scalars).
    """

    def __init__(self, loss: RouterAuxLoss, log=None):
        self.loss, self.log = loss, log

    def on_step_end(self, state) -> None:
        record = self.loss.close_window()
        if self.log is not None:
            self.log(record, state.step)
