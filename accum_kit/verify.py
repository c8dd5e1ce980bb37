"""``accum-kit verify``: is the accumulated gradient the gradient of one big batch?

What it checks
--------------
Every process draws the same deterministic set of variable-length examples
(random token ids, lengths uniform in 2..32 tokens, from ``--seed``); the
prepared DataLoader shards them, so each process runs ``K + r`` micro-batches
of ``B`` examples (right-padded per micro-batch, ``labels = -100`` on padding):
one full accumulation window of K micro-batches, then a *partial* window of
``r = ceil(K / 2)`` micro-batches (``--partial_window``, on by default; there
is none when K = 1). The partial window is the last window of an epoch, which
Accelerate closes early at the end of the dataloader (``sync_with_dataloader``)
but still divides by K.

The gradient of each window is taken three ways on the same parameters:

``tokens``
    :func:`accum_kit.train_loop` with ``loss_normalization="tokens"`` (the
    toolkit's exact normalisation, DDP with ``no_sync``).
``mean-of-means``
    :func:`accum_kit.train_loop` with ``loss_normalization="mean"``: each
    micro-batch's token-mean loss, divided by K by ``accelerator.backward``
    and averaged over processes by DDP. For a full window this is the mean of
    the W x K micro-batch means (what transformers' Trainer computed before its
    October 2024 fix); a partial window of r micro-batches is additionally
    scaled by r / K.
``sum``
    a ``reduction="sum"`` loss with a plain ``loss.backward()`` inside
    ``accelerator.accumulate(model)`` (no division by K, no normalisation), so
    the only thing between it and the big-batch summed-loss gradient is DDP.

Capturing the gradient: the optimizer passed through ``accelerator.prepare`` is
:class:`GradientCapture`, a ``torch.optim.Optimizer`` whose ``step()`` copies
the gradients instead of updating the parameters. It therefore sees exactly
what a real optimizer would see at ``optimizer.step()``: after the boundary
all-reduce and after train_loop's window rescale (``WindowNormalizer.finish``),
before ``zero_grad``. The parameters never change, so every window of every
row is evaluated at the initial parameters. Dropout is switched off
(``model.eval()`` at ``on_train_begin``) so the comparison is deterministic;
gradients are computed as usual.

The oracle
----------
On the main process, from the examples the processes actually ran (gathered
with ``gather_object``), a copy of the initial model in float64 runs *one*
forward and backward per window over all processes' examples padded together:
plain PyTorch, no DDP, no Accelerate. It yields the gradient of the summed
token loss ``sum_{r,i} S_{r,i}`` (``sum`` row) and of the token mean
``sum_{r,i} S_{r,i} / N`` with ``N`` the window's target tokens over all
processes (``tokens`` and ``mean-of-means`` rows). Being float64, its own
rounding is negligible next to the float32 tolerance.

Comparison and units
--------------------
Gradients are per parameter tensor, same shapes as the parameters, in nats per
unit parameter. For each row and window: ``max_abs_error = max |g - o|``,
``rel_error = ||g - o||_2 / ||o||_2`` over all parameters, and
``tolerance_used = max |g - o| / (atol + rtol |o|)`` elementwise (the
``torch.allclose`` criterion; <= 1 passes). A row passes when every window
passes and the gradients agree across ranks (their norms within rtol). The
default tolerance (rtol 1e-4, atol 1e-6) is a float32 tolerance: the exact
arithmetic lands around 1e-7 relative here, mean-of-means misses by percent.

DDP semantics: ``DistributedDataParallel`` averages gradients over processes
(the all-reduce sums and divides by the world size; PyTorch DDP docs, "Distributed
Data Parallel" design note, and ``torch.nn.parallel.DistributedDataParallel``).
So the ``sum`` row equals the big-batch sum gradient x 1/W; the report gives
the measured least-squares ratio ``<g, o> / <o, o>``. ``torch.nn.DataParallel``
instead sums the replicas' gradients of one loss, like the single-device big
batch; it is measured only where ``torch.cuda.device_count() >= 2`` (on fewer
devices DataParallel runs the module unchanged and would prove nothing).

Sources: transformers blog "Fixing Gradient Accumulation" (October 2024,
https://huggingface.co/blog/gradient_accumulation); PyTorch DDP notes
(https://pytorch.org/docs/stable/notes/ddp.html) and
``DistributedDataParallel`` docs on gradient averaging; Accelerate's
"Gradient accumulation" guide (``accelerator.backward`` divides by K).

Memory: the main process keeps a float64 copy of the model and float32 CPU
copies of every captured gradient (3 rows x 2 windows); fine for the small
models this check is meant for.

Command line: ``accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m accum_kit verify``
(any number of processes), or ``python -m accum_kit verify`` on one. Exit 0
when the row selected by ``--loss_normalization`` passes, 1 when it does not,
2 on bad input. From Python: :func:`verify_accumulation`.
"""

from __future__ import annotations

import copy
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object
from torch.utils.data import DataLoader

from .cli import ArgumentParser, parse_args
from .errors import AccumKitError, UsageError
from .launch import build_accelerator, resolve_accumulation_steps
from .loop import train_loop
from .loss import causal_lm_loss
from .models import PRESETS, build_model, load_model
from .outputs import atomic_write_json, check_output_dir

DEFAULT_ACCUMULATION_STEPS = 3
DEFAULT_BATCH_SIZE = 2
DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-6
MIN_LENGTH = 2  # tokens per example: at least one target after the shift
MAX_LENGTH = 32  # tokens per example (capped by the model's positions)
TINY_VOCAB = 128  # vocabulary of the default preset model
PAD_ID = 0
IGNORE_INDEX = -100
SELECTABLE = {"tokens": "tokens", "mean": "mean-of-means"}  # --loss_normalization -> row name


# --------------------------------------------------------------------------- data


def make_examples(n: int, seed: int, vocab_size: int, max_length: int = MAX_LENGTH) -> list[dict]:
    """``n`` examples of random token ids with random lengths (uniform in 2..max_length).

    Deterministic from ``seed`` (Python's ``random.Random``), identical on every
    process. ``labels`` equal ``input_ids`` (the shift happens in the loss).
    """
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        length = rng.randint(MIN_LENGTH, max_length)
        ids = [rng.randrange(vocab_size) for _ in range(length)]
        examples.append({"input_ids": ids, "labels": list(ids)})
    return examples


def pad_collate(examples: list[dict], pad_id: int = PAD_ID) -> dict:
    """Right-pad to the longest example: ``input_ids`` pad id, ``attention_mask`` 0, ``labels`` -100.

    Returns int64 tensors of shape (batch, longest length).
    """
    width = max(len(e["input_ids"]) for e in examples)
    ids, mask, labels = [], [], []
    for e in examples:
        n = len(e["input_ids"])
        ids.append(list(e["input_ids"]) + [pad_id] * (width - n))
        mask.append([1] * n + [0] * (width - n))
        labels.append(list(e["labels"]) + [IGNORE_INDEX] * (width - n))
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "attention_mask": torch.tensor(mask, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
    }


def partial_micro_batches(gradient_accumulation_steps: int, partial_window: bool) -> int:
    """Micro-batches per process in the partial window: ``ceil(K / 2)``; 0 when off or K = 1."""
    k = gradient_accumulation_steps
    return (k + 1) // 2 if partial_window and k > 1 else 0


# --------------------------------------------------------------------------- capture


class GradientCapture(torch.optim.Optimizer):
    """A torch optimizer whose ``step()`` records the gradients and leaves the parameters alone.

    Pass it through ``accelerator.prepare`` like any optimizer: it then sees
    exactly what a real optimizer sees at ``optimizer.step()`` (after the
    boundary all-reduce, train_loop's window rescale and clipping; before
    ``zero_grad``). ``captured`` gets one entry per optimizer step: on the
    keeping process a dict ``{parameter name: float32 CPU copy of .grad}``
    (a None grad becomes zeros), elsewhere None; ``norms`` gets the L2 norm of
    the whole gradient on every process (for the cross-rank check).

    Args:
        named_parameters: ``model.named_parameters()`` of the model to watch.
        keep: keep full gradient copies (the main process) or only norms.
    """

    def __init__(self, named_parameters, keep: bool = True):
        named = list(named_parameters)
        self.names = [n for n, _ in named]
        super().__init__([p for _, p in named], defaults={})
        self.keep = keep
        self.captured: list = []
        self.norms: list[float] = []

    def take(self) -> tuple[list, list]:
        """Return ``(captured, norms)`` since the last call and forget them."""
        out = (self.captured, self.norms)
        self.captured, self.norms = [], []
        return out

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        sq, grads = 0.0, {}
        for name, p in zip(self.names, self.param_groups[0]["params"]):
            g = p.grad.detach().float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
            sq += float(g.double().pow(2).sum())
            if self.keep:
                grads[name] = g.to("cpu", copy=True)
        self.captured.append(grads if self.keep else None)
        self.norms.append(math.sqrt(sq))
        return None


class _Recorder:
    """``loss_fn`` and callback of :func:`train_loop`: which examples each window ran on this process."""

    def __init__(self):
        self.window = 0
        self.windows: list[list[dict]] = []

    def on_micro_batch_begin(self, state) -> None:  # called before loss_fn
        self.window = state.step

    def __call__(self, model, batch):
        self.record(self.window, batch)
        return causal_lm_loss(model, batch)

    def record(self, window: int, batch) -> None:
        while len(self.windows) <= window:
            self.windows.append([])
        ids, mask = batch["input_ids"].cpu(), batch["attention_mask"].cpu()
        labels = batch["labels"].cpu()
        for i in range(ids.size(0)):
            n = int(mask[i].sum())  # right padding: the first n positions are the example
            self.windows[window].append({"input_ids": ids[i, :n].tolist(), "labels": labels[i, :n].tolist()})


class _EvalMode:
    """Callback: dropout off for the whole loop (train_loop calls model.train() just before on_train_begin)."""

    def __init__(self, model):
        self.model = model

    def on_train_begin(self, state) -> None:
        self.model.eval()


# --------------------------------------------------------------------------- oracle


def summed_token_loss(model, input_ids, attention_mask, labels):
    """Summed next-token cross-entropy (nats) and target-token count of one padded batch.

    Written independently of :func:`accum_kit.loss.causal_lm_loss` for the
    oracle: logits (batch, seq, vocab) at position t predict labels at t+1;
    labels -100 are ignored.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1, :]
    target = labels[:, 1:]
    summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="sum")
    return summed, int((target != IGNORE_INDEX).sum())


def _grads(model) -> dict:
    return {n: (p.grad.detach().to("cpu", torch.float64, copy=True) if p.grad is not None
                else torch.zeros(p.shape, dtype=torch.float64)) for n, p in model.named_parameters()}


def big_batch_gradient(model64, examples: list[dict], device) -> tuple[dict, int]:
    """Gradient of the summed token loss of ONE forward/backward over all ``examples``.

    Args:
        model64: a float64 copy of the initial model (eval mode), on ``device``.
        examples: every process's examples of one window.

    Returns:
        ``({name: float64 CPU gradient of sum_{r,i} S_{r,i}}, N)`` with ``N``
        the target tokens of the window; the token-mean gradient is that / N.
    """
    batch = {k: v.to(device) for k, v in pad_collate(examples).items()}
    model64.zero_grad(set_to_none=True)
    summed, n = summed_token_loss(model64, **batch)
    summed.backward()
    return _grads(model64), n


def dataparallel_sum_gradient(model, examples: list[dict], device_ids=None) -> dict:
    """Gradient of the summed loss under ``torch.nn.DataParallel`` over all ``examples`` at once.

    DataParallel scatters the batch over ``device_ids`` (default: all GPUs),
    each replica returns its summed loss, the vector is gathered on the first
    device and summed, and backward reduces the replicas' gradients into the
    original parameters by summation. Returns float64 CPU gradients by name.
    Without GPUs DataParallel calls the module directly.
    """
    class _SummedLoss(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, labels):
            return summed_token_loss(self.inner, input_ids, attention_mask, labels)[0].reshape(1)

    inner = copy.deepcopy(model).float().eval()
    device = torch.device("cuda", (device_ids or [0])[0]) if torch.cuda.is_available() else torch.device("cpu")
    inner.to(device)
    dp = torch.nn.DataParallel(_SummedLoss(inner), device_ids=device_ids)
    batch = {k: v.to(device) for k, v in pad_collate(examples).items()}
    dp(**batch).sum().backward()
    return _grads(inner)


# --------------------------------------------------------------------------- comparison


def compare_gradients(got: dict, want: dict, rtol: float, atol: float) -> dict:
    """Errors of ``got`` against ``want`` (dicts of same-shape tensors), in float64.

    Returns ``max_abs_error`` (max |g - o|), ``rel_error`` (||g - o|| / ||o||
    over all parameters), ``tolerance_used`` (max |g - o| / (atol + rtol |o|);
    <= 1 passes), ``dot`` (<g, o>), ``want_sq`` (||o||^2) and ``got_norm``.
    """
    max_abs, used, err_sq, want_sq, got_sq, dot = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    for name, o in want.items():
        g = got[name].double()
        o = o.double()
        d = (g - o).abs()
        max_abs = max(max_abs, float(d.max()) if d.numel() else 0.0)
        used = max(used, float((d / (atol + rtol * o.abs())).max()) if d.numel() else 0.0)
        err_sq += float(d.pow(2).sum())
        want_sq += float(o.pow(2).sum())
        got_sq += float(g.pow(2).sum())
        dot += float((g * o).sum())
    return {
        "max_abs_error": max_abs,
        "rel_error": math.sqrt(err_sq / want_sq) if want_sq > 0 else (0.0 if err_sq == 0 else math.inf),
        "tolerance_used": used,
        "dot": dot,
        "want_sq": want_sq,
        "got_norm": math.sqrt(got_sq),
    }


def _scaled_residual(pairs, ratio: float) -> float:
    """||g - ratio o|| / ||o|| over all (got, want) pairs."""
    num, den = 0.0, 0.0
    for got, want in pairs:
        for name, o in want.items():
            num += float((got[name].double() - ratio * o).pow(2).sum())
            den += float(o.pow(2).sum())
    return math.sqrt(num / den) if den > 0 else math.nan


# --------------------------------------------------------------------------- report


@dataclass
class WindowInfo:
    """One verified accumulation window.

    Attributes:
        index: 1-based window number.
        partial: fewer than K micro-batches per process.
        micro_batches_per_process: micro-batches each process ran in it.
        examples: examples over all processes.
        target_tokens: target tokens (labels != -100 after the shift) over all processes.
        oracle_grad_norm: L2 norm of the big-batch token-mean gradient (float64).
        oracle_sum_grad_norm: L2 norm of the big-batch summed-loss gradient.
        input_ids: the examples' token ids as run (labels are the same ids);
            lets anyone recompute the oracle.
    """

    index: int
    partial: bool
    micro_batches_per_process: int
    examples: int
    target_tokens: int
    oracle_grad_norm: float
    oracle_sum_grad_norm: float
    input_ids: list = field(default_factory=list, repr=False)


@dataclass
class Row:
    """One normalisation compared with the oracle; errors are the worst over windows.

    Attributes:
        name: ``tokens``, ``mean-of-means``, ``sum`` or ``sum (DataParallel)``.
        computed_by: how our gradient was produced.
        compared_with: which oracle gradient (``big-batch token mean`` or ``big-batch sum``).
        max_abs_error: max |g - o| over all elements and windows (gradient units).
        rel_error: max over windows of ||g - o|| / ||o||.
        tolerance_used: max |g - o| / (atol + rtol |o|); <= 1 is within tolerance.
        rank_spread: max relative difference of the gradient norm between ranks
            (0 when all processes hold the same gradient, as DDP guarantees).
        The error fields are None for a skipped row.
        passed: within tolerance in every window and ranks agree.
        windows: per-window ``max_abs_error``, ``rel_error``, ``tolerance_used``, ``grad_norm``.
        skipped: why the row was not measured (None when it was).
    """

    name: str
    computed_by: str
    compared_with: str
    max_abs_error: float | None = None
    rel_error: float | None = None
    tolerance_used: float | None = None
    rank_spread: float | None = None
    passed: bool | None = None
    windows: list = field(default_factory=list)
    skipped: str | None = None


@dataclass
class VerifyReport:
    """Everything ``accum-kit verify`` prints and writes; see the module docstring for definitions."""

    world_size: int
    distributed_type: str
    gradient_accumulation_steps: int
    per_device_train_batch_size: int
    seed: int
    model: dict
    partial_window: bool
    windows: list
    rows: list
    rtol: float
    atol: float
    selected: str  # --loss_normalization value: "tokens" or "mean"
    ddp_sum_ratio: float
    ddp_sum_residual: float
    dataparallel_sum_ratio: float | None = None
    oracle: dict = field(default_factory=dict)
    seconds: float = 0.0

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    @property
    def selected_row(self) -> Row:
        return self.row(SELECTABLE[self.selected])

    @property
    def passed(self) -> bool:
        """The row selected by ``--loss_normalization`` matched the oracle."""
        return bool(self.selected_row.passed)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def ddp_sum_ratio_expected(self) -> float:
        return 1.0 / self.world_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rows"] = {r.name: asdict(r) for r in self.rows}
        d.update(passed=self.passed, exit_code=self.exit_code, selected_row=self.selected_row.name,
                 ddp_sum_ratio_expected=self.ddp_sum_ratio_expected, ddp_semantics=self.ddp_statement())
        return d

    def ddp_statement(self) -> str:
        w, r = self.world_size, self.ddp_sum_ratio
        if w == 1:
            return (f"1 process, no DDP: sum-loss gradient = big-batch sum gradient x 1 "
                    f"(measured ratio {r:.4f}, residual {self.ddp_sum_residual:.1e})")
        return (f"DDP averages: sum-loss gradient = big-batch sum gradient x 1/{w} "
                f"(measured ratio {r:.4f}, residual {self.ddp_sum_residual:.1e})")

    def format(self) -> str:
        """The text report: setup, one table row per normalisation, the DDP statement, the verdict."""
        K, B, W = self.gradient_accumulation_steps, self.per_device_train_batch_size, self.world_size
        m = self.model
        lines = [
            "accum-kit verify: accumulated gradient vs one big batch on one process",
            f"  processes {W} ({self.distributed_type}), gradient_accumulation_steps K={K}, "
            f"per_device_train_batch_size {B}, seed {self.seed}",
            f"  model: {m['description']}, {m['parameters']:,} parameters, float32, dropout off (eval mode)",
            f"  data: {sum(w.examples for w in self.windows)} random token sequences of {MIN_LENGTH}-{m['max_length']} "
            "tokens, right-padded per micro-batch, labels -100 on padding",
        ]
        for w in self.windows:
            kind = (f"partial, {w.micro_batches_per_process} of {K} micro-batches per process "
                    "(the epoch's last window, closed at the end of the dataloader)" if w.partial
                    else f"full, {K} micro-batch{'es' if K > 1 else ''} per process")
            lines.append(f"  window #{w.index}: {kind}; {w.examples} examples, {w.target_tokens} target tokens")
        if not self.partial_window:
            lines.append("  no partial window (--no_partial_window)")
        elif K == 1:
            lines.append("  no partial window: with K=1 every window is full")
        lines += [
            f"  oracle: plain PyTorch, one process, {self.oracle['dtype']} on {self.oracle['device']}: one "
            "forward/backward per window over all processes' examples padded together; gradient of the summed "
            "token loss / the window's target tokens N (token mean), or of the summed loss (sum)",
            f"  tolerance (float32): pass iff |g - g_oracle| <= atol + rtol |g_oracle| for every element, "
            f"rtol {self.rtol:g}, atol {self.atol:g} (x N for sum rows); worst/tol = the largest "
            "|g - g_oracle| / (atol + rtol |g_oracle|)",
            "",
        ]
        head = ["normalisation", "computed by", "compared with", "max abs err",
                *[f"rel err #{w.index}" for w in self.windows], "worst/tol", "result"]
        table = []
        for r in self.rows:
            cells = [r.name, r.computed_by, r.compared_with]
            if r.skipped:
                table.append(cells + [f"skipped: {r.skipped}"])
            else:
                table.append(cells + [f"{r.max_abs_error:.2e}", *[f"{x['rel_error']:.2e}" for x in r.windows],
                                      f"{r.tolerance_used:.3g}", "PASS" if r.passed else "FAIL"])
        widths = [max(len(t[i]) for t in [head, *table] if i < len(t) and not (i == 3 and len(t) == 4))
                  for i in range(len(head))]
        for t in [head, *table]:
            lines.append(("  " + "  ".join(c.ljust(widths[i]) if len(t) > 4 or i < 3 else c
                                           for i, c in enumerate(t))).rstrip())
        measured = [r for r in self.rows if r.rank_spread is not None]  # the DDP rows
        lines += ["", f"  {self.ddp_statement()}"]
        if self.dataparallel_sum_ratio is not None:
            lines.append(f"  DataParallel sums the replicas' gradients: sum-loss gradient = big-batch sum gradient x 1 "
                         f"(measured ratio {self.dataparallel_sum_ratio:.4f})")
        lines.append(f"  ranks agree: gradient norms differ by at most {max(r.rank_spread for r in measured):.1e} "
                     f"(relative) across the {W} process(es)")
        why = ("  why: tokens divides the summed token loss by the window's target tokens over all processes "
               "(exact); mean-of-means weights short sequences more and still divides a partial window by K")
        lines.append(why + (f"; sum is {W}x too small because DDP averages over {W} processes" if W > 1 else ""))
        lines.append(f"  verdict: {self.selected_row.name} (--loss_normalization {self.selected}) "
                     f"{'PASSES' if self.passed else 'FAILS'} -> exit {self.exit_code}   ({self.seconds:.1f} s)")
        return "\n".join(lines)



# --------------------------------------------------------------------------- the check


def _validate(gradient_accumulation_steps, per_device_train_batch_size, rtol, atol, loss_normalization) -> None:
    def positive_int(flag, v):
        if v is None:
            return
        if isinstance(v, bool) or not isinstance(v, int):
            raise UsageError(flag, f"must be an integer (got {v!r})", "pass a positive integer")
        if v < 1:
            raise UsageError(flag, f"must be >= 1 (got {v})", "pass a positive integer")

    positive_int("--gradient_accumulation_steps", gradient_accumulation_steps)
    positive_int("--per_device_train_batch_size", per_device_train_batch_size)
    if not (isinstance(rtol, (int, float)) and math.isfinite(rtol) and rtol > 0):
        raise UsageError("--tolerance", f"must be a finite number > 0 (got {rtol!r})", "pass e.g. 1e-4")
    if not (isinstance(atol, (int, float)) and math.isfinite(atol) and atol >= 0):
        raise UsageError("--atol", f"must be a finite number >= 0 (got {atol!r})", "pass e.g. 1e-6")
    if loss_normalization not in SELECTABLE:
        raise UsageError("--loss_normalization", f"unknown value {loss_normalization!r}",
                         f"use one of {tuple(SELECTABLE)}")


def _build_model(model, model_name_or_path, seed):
    """(float32 model in eval mode, description dict without the parameter count)."""
    if model is not None:
        m, desc = copy.deepcopy(model), f"{type(model).__name__} (given)"
    elif model_name_or_path:
        m, desc = load_model(model_name_or_path), f"{model_name_or_path}"
    else:
        m = build_model("tiny", TINY_VOCAB, MAX_LENGTH, seed=seed)
        p = PRESETS["tiny"]
        desc = (f"preset tiny (GPT-2 style, {p['n_layer']} layers, width {p['n_embd']}, vocab {TINY_VOCAB}, "
                f"random init seed {seed})")
    cfg = getattr(m, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    positions = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or MAX_LENGTH
    if vocab is None:
        raise UsageError("--model_name_or_path", "the model has no config.vocab_size",
                         "pass a transformers causal LM")
    spec = {"description": desc, "vocab_size": int(vocab), "max_length": int(min(MAX_LENGTH, positions)),
            "preset": None if (model is not None or model_name_or_path) else "tiny",
            "n_positions": int(positions), "init_seed": seed, "model_name_or_path": model_name_or_path}
    return m.float().eval(), spec


def _forget_prepared(accelerator, objects) -> None:
    """Drop our prepared objects from the accelerator's lists (a caller's own stay registered)."""
    for attr in ("_models", "_optimizers", "_dataloaders"):
        lst = getattr(accelerator, attr, None)
        if isinstance(lst, list):
            lst[:] = [o for o in lst if not any(o is x for x in objects)]


def verify_accumulation(
    accelerator=None,
    *,
    gradient_accumulation_steps: int | None = None,
    per_device_train_batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    model_name_or_path: str | None = None,
    model=None,
    partial_window: bool = True,
    loss_normalization: str = "tokens",
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    dataparallel: bool | None = None,
) -> VerifyReport:
    """Compare the toolkit's accumulated gradient with a single-process big batch.

    Call it on every process (it runs collectives); every process gets the
    same report. See the module docstring for what is compared and how.

    Args:
        accelerator: an Accelerator built with ``gradient_accumulation_steps=K``;
            None builds one with :func:`accum_kit.build_accelerator`.
        gradient_accumulation_steps: K; None takes the accelerator's, or
            ``accelerate launch --gradient_accumulation_steps``, or 3.
        per_device_train_batch_size: examples per micro-batch per process.
        seed: seeds the examples and the preset model's initialisation.
        model_name_or_path: a local causal LM (``save_pretrained`` directory)
            instead of the ``tiny`` preset.
        model: a causal LM module to verify instead (deep-copied, not modified).
        partial_window: add a partial last window of ``ceil(K / 2)`` micro-batches.
        loss_normalization: which row decides ``passed``: ``"tokens"`` or
            ``"mean"`` (the ``mean-of-means`` row).
        rtol, atol: float32 tolerance, elementwise ``|g - o| <= atol + rtol |o|``.
        dataparallel: measure ``torch.nn.DataParallel``; None: when
            ``torch.cuda.device_count() >= 2``.

    Returns:
        :class:`VerifyReport` (``passed``, ``rows``, ``ddp_sum_ratio``, ``to_dict()``, ``format()``).

    Raises:
        UsageError: bad argument (the message names the flag).
        ProcessCountError: the launcher and the Accelerator disagree on the process count.
    """
    t0 = time.perf_counter()
    _validate(gradient_accumulation_steps, per_device_train_batch_size, rtol, atol, loss_normalization)
    if accelerator is None:
        K = resolve_accumulation_steps(gradient_accumulation_steps, default=DEFAULT_ACCUMULATION_STEPS)
        accelerator = build_accelerator(K)
    else:
        K = accelerator.gradient_accumulation_steps
        if gradient_accumulation_steps is not None and gradient_accumulation_steps != K:
            raise UsageError("gradient_accumulation_steps", f"{gradient_accumulation_steps} differs from the "
                             f"accelerator's {K}", "omit it or build the accelerator with the same K")
    W, B, main = accelerator.num_processes, per_device_train_batch_size, accelerator.is_main_process
    base, spec = _build_model(model, model_name_or_path, seed)
    spec["parameters"] = sum(p.numel() for p in base.parameters())
    oracle_model = copy.deepcopy(base) if main else None  # initial parameters, before prepare
    r = partial_micro_batches(K, partial_window)
    examples = make_examples((K + r) * B * W, seed, spec["vocab_size"], spec["max_length"])
    loader = DataLoader(examples, batch_size=B, shuffle=False, collate_fn=pad_collate)
    capture = GradientCapture(base.named_parameters(), keep=main)
    pmodel, popt, ploader = accelerator.prepare(base, capture, loader)
    runs = {}  # row name -> (captured grads per window (main) / None, norms per window, examples per window)
    try:
        if len(ploader) != K + r:
            raise RuntimeError(f"expected {K + r} micro-batches per process after sharding, got {len(ploader)}")
        for name, mode in (("tokens", "tokens"), ("mean-of-means", "mean")):
            rec = _Recorder()
            train_loop(accelerator, pmodel, popt, ploader, num_train_epochs=1, loss_normalization=mode,
                       loss_fn=rec, callbacks=[rec, _EvalMode(pmodel)], progress=False)
            runs[name] = (*capture.take(), rec.windows)
        # reduction="sum": plain backward inside accumulate; only DDP stands between it and the big batch.
        rec, window = _Recorder(), 0
        pmodel.eval()
        for batch in ploader:
            with accelerator.accumulate(pmodel):
                rec.window = window
                summed, _ = rec(pmodel, batch)
                summed.backward()
                if accelerator.sync_gradients:
                    popt.step()
                    popt.zero_grad()
                    window += 1
        runs["sum"] = (*capture.take(), rec.windows)
    finally:
        _forget_prepared(accelerator, (pmodel, popt, ploader))

    names = list(runs)
    n_windows = 1 + (r > 0)
    for name in names:
        if len(runs[name][1]) != n_windows:
            raise RuntimeError(f"{name}: {len(runs[name][1])} optimizer steps, expected {n_windows}")
    # Examples each process ran, per row and window; gradient norms of every rank.
    ran = gather_object([{name: runs[name][2] for name in names}])
    norms = accelerator.gather(torch.tensor([x for name in names for x in runs[name][1]],
                                            dtype=torch.float64, device=accelerator.device)).cpu().view(W, -1)

    payload = None
    if main:
        try:
            payload = ("ok", _evaluate(accelerator, oracle_model, runs, ran, norms, names, K, B, W, r, seed, spec,
                                       partial_window, loss_normalization, rtol, atol, dataparallel))
        except Exception as exc:  # tell the other processes (they wait in the broadcast), then re-raise
            broadcast_object_list([("error", f"{type(exc).__name__}: {exc}")])
            raise
    status, report = broadcast_object_list([payload])[0]
    if status != "ok":
        raise RuntimeError(f"the main process failed while computing the oracle: {report}")
    report.seconds = time.perf_counter() - t0
    return report


def _evaluate(accelerator, oracle_model, runs, ran, norms, names, K, B, W, r, seed, spec,
              partial_window, loss_normalization, rtol, atol, dataparallel) -> VerifyReport:
    """Main process: oracle per window, row comparisons, ratios."""
    device = accelerator.device
    oracle_model = oracle_model.double().to(device).eval()
    n_windows = norms.shape[1] // len(names)
    oracle_cache: dict = {}

    def window_examples(name, w):
        # rank order, then micro-batch order: the order does not matter for the sum
        return [e for per_rank in ran for e in per_rank[name][w]]

    def oracle(examples):
        key = tuple(tuple(e["input_ids"]) for e in examples)
        if key not in oracle_cache:
            oracle_cache[key] = big_batch_gradient(oracle_model, examples, device)
        return oracle_cache[key]

    windows = []
    for w in range(n_windows):
        ex = window_examples("tokens", w)
        sum_grad, n_tok = oracle(ex)
        mean_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in sum_grad.values())) / max(n_tok, 1)
        windows.append(WindowInfo(
            index=w + 1, partial=w == 1, micro_batches_per_process=K if w == 0 else r, examples=len(ex),
            target_tokens=n_tok, oracle_grad_norm=mean_norm, oracle_sum_grad_norm=mean_norm * n_tok,
            input_ids=[e["input_ids"] for e in ex]))

    how = {
        "tokens": ('train_loop(loss_normalization="tokens")', "big-batch token mean"),
        "mean-of-means": ('train_loop(loss_normalization="mean")', "big-batch token mean"),
        "sum": ("reduction=sum loss, loss.backward() in accumulate", "big-batch sum"),
    }
    rows, sum_pairs = [], []
    for j, name in enumerate(names):
        grads = runs[name][0]
        row = Row(name, *how[name])
        per_rank = norms[:, j * n_windows:(j + 1) * n_windows]
        row.rank_spread = float(((per_rank - per_rank[0]).abs() / per_rank[0].clamp(min=1e-30)).max())
        for w in range(n_windows):
            sum_grad, n_tok = oracle(window_examples(name, w))
            if name == "sum":  # atol is stated for token-mean gradients; the sum gradient is N times larger
                want, row_atol = sum_grad, atol * n_tok
            else:
                want, row_atol = {k: v / max(n_tok, 1) for k, v in sum_grad.items()}, atol
            c = compare_gradients(grads[w], want, rtol, row_atol)
            if name == "sum":
                sum_pairs.append((grads[w], want, c))
            row.windows.append({"window": w + 1, "max_abs_error": c["max_abs_error"], "rel_error": c["rel_error"],
                                "tolerance_used": c["tolerance_used"], "grad_norm": c["got_norm"]})
        row.max_abs_error = max(x["max_abs_error"] for x in row.windows)
        row.rel_error = max(x["rel_error"] for x in row.windows)
        row.tolerance_used = max(x["tolerance_used"] for x in row.windows)
        row.passed = row.tolerance_used <= 1.0 and row.rank_spread <= rtol
        rows.append(row)

    ratio = sum(c["dot"] for *_, c in sum_pairs) / sum(c["want_sq"] for *_, c in sum_pairs)
    residual = _scaled_residual([(g, o) for g, o, _ in sum_pairs], ratio)

    n_gpu = torch.cuda.device_count()
    dp_row = Row("sum (DataParallel)", "reduction=sum loss, nn.DataParallel, one process", "big-batch sum")
    dp_ratio = None
    if dataparallel is None:
        dataparallel = n_gpu >= 2
    if dataparallel:
        dots, sqs = 0.0, 0.0
        for w in range(n_windows):
            ex = window_examples("tokens", w)
            want, n_tok = oracle(ex)
            c = compare_gradients(dataparallel_sum_gradient(oracle_model, ex), want, rtol, atol * n_tok)
            dots, sqs = dots + c["dot"], sqs + c["want_sq"]
            dp_row.windows.append({"window": w + 1, "max_abs_error": c["max_abs_error"], "rel_error": c["rel_error"],
                                   "tolerance_used": c["tolerance_used"], "grad_norm": c["got_norm"]})
        dp_row.max_abs_error = max(x["max_abs_error"] for x in dp_row.windows)
        dp_row.rel_error = max(x["rel_error"] for x in dp_row.windows)
        dp_row.tolerance_used = max(x["tolerance_used"] for x in dp_row.windows)
        dp_row.passed = dp_row.tolerance_used <= 1.0
        dp_ratio = dots / sqs
    else:
        dp_row.skipped = (f"needs >= 2 CUDA GPUs, found {n_gpu} (on fewer, DataParallel runs the module "
                          "unchanged, so it would measure nothing)")
    rows.append(dp_row)

    return VerifyReport(
        world_size=W, distributed_type=str(accelerator.distributed_type).split(".")[-1],
        gradient_accumulation_steps=K, per_device_train_batch_size=B, seed=seed, model=spec,
        partial_window=partial_window, windows=windows, rows=rows, rtol=rtol, atol=atol,
        selected=loss_normalization, ddp_sum_ratio=ratio, ddp_sum_residual=residual,
        dataparallel_sum_ratio=dp_ratio,
        oracle={"dtype": "float64", "device": str(device),
                "grad_norm": [w.oracle_grad_norm for w in windows],
                "sum_grad_norm": [w.oracle_sum_grad_norm for w in windows]},
    )


# --------------------------------------------------------------------------- command line


def build_parser(prog: str = "accum-kit verify") -> ArgumentParser:
    """The argparse parser of ``accum-kit verify``."""
    p = ArgumentParser(prog=prog, description=(
        "Check that the accumulated gradient (K micro-batches per process, all processes, a full and a partial "
        "window) equals the gradient of one big batch on one process; report mean-of-means and the DDP "
        "semantics of a sum loss. Run under accelerate launch on any number of processes."))
    p.add_argument("--gradient_accumulation_steps", type=int, default=None,
                   help=f"micro-batches per window, K (default: $ACCELERATE_GRADIENT_ACCUMULATION_STEPS or {DEFAULT_ACCUMULATION_STEPS})")
    p.add_argument("--per_device_train_batch_size", type=int, default=DEFAULT_BATCH_SIZE,
                   help=f"examples per micro-batch per process (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--seed", type=int, default=0, help="seed of the examples and of the preset model (default 0)")
    p.add_argument("--model_name_or_path", default=None,
                   help="local causal LM (save_pretrained directory) instead of the tiny GPT-2 preset")
    p.add_argument("--loss_normalization", choices=tuple(SELECTABLE), default="tokens",
                   help="the row that decides the exit code: tokens (default) or mean (mean-of-means)")
    pw = p.add_mutually_exclusive_group()
    pw.add_argument("--partial_window", dest="partial_window", action="store_true", default=True,
                    help="also verify a partial last window of ceil(K/2) micro-batches per process (the default)")
    pw.add_argument("--no_partial_window", dest="partial_window", action="store_false",
                    help="verify one full window only")
    p.add_argument("--tolerance", type=float, default=DEFAULT_RTOL,
                   help=f"relative tolerance rtol, float32 (default {DEFAULT_RTOL:g})")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                   help=f"absolute tolerance, gradient units (default {DEFAULT_ATOL:g})")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the report as JSON to PATH (main process, atomically)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``accum-kit verify``: 0 when the selected row passes, 1 when it fails, 2 on bad input."""
    args = parse_args(build_parser(), argv)
    if args is None:
        return 2
    try:
        if args.json is not None:
            if os.path.isdir(args.json):
                raise UsageError("--json", f"{args.json} is a directory", "pass a file path, e.g. verify.json")
            check_output_dir(os.path.dirname(os.path.abspath(args.json)), flag="--json")
        report = verify_accumulation(
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            per_device_train_batch_size=args.per_device_train_batch_size,
            seed=args.seed,
            model_name_or_path=args.model_name_or_path,
            partial_window=args.partial_window,
            loss_normalization=args.loss_normalization,
            rtol=args.tolerance,
            atol=args.atol,
        )
    except AccumKitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if PartialState().is_main_process:
        print(report.format(), flush=True)
        if args.json is not None:
            atomic_write_json(args.json, report.to_dict())
    PartialState().wait_for_everyone()
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
