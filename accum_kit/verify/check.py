"""The check: run three normalisations through an Accelerator, then compare each window with the oracle.

:func:`verify_accumulation` prepares throw-away copies (model, a
:class:`~accum_kit.verify.capture.GradientCapture` optimizer, the examples'
DataLoader) inside the given Accelerator, runs each row over the same windows
(verify's own token data, or the user's model, loss and data:
:mod:`accum_kit.verify.workload`), measures BatchNorm in training mode when the
model has such layers (:mod:`accum_kit.verify.batchnorm`), optionally runs
transformers' Trainer on another copy (the informational ``trainer`` row,
:mod:`accum_kit.verify.trainer`), gathers what every process ran and saw, and
lets the main process compute the oracle and the report, which it broadcasts
to every process.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import dataclass

import torch
from accelerate.utils import broadcast_object_list, gather_object

from .. import checks
from ..batchnorm import BatchNormAccumulationWarning
from ..compat import forget_prepared
from ..errors import UsageError
from ..launch import build_accelerator, resolve_accumulation_steps
from ..loop import train_loop
from ..loss import causal_lm_loss
from ..models import LLAMA_PRESETS, PRESETS, build_llama_model, build_model, load_model
from . import batchnorm
from .capture import EvalMode, GradientCapture
from .compare import (DEFAULT_ATOL, DEFAULT_RTOL, MIXED_PRECISIONS, compare_gradients, mixed_precision_rtol,
                      scaled_residual)
from .data import MAX_LENGTH, partial_micro_batches
from .oracle import big_batch_gradient, dataparallel_sum_gradient
from .report import SELECTABLE, Row, VerifyReport, WindowInfo
from .trainer import capture_trainer, trainer_summary
from .workload import IndexRecorder, Workload, token_workload, user_workload

DEFAULT_BATCH_SIZE = 2  # examples per micro-batch per process
TINY_VOCAB = 128  # vocabulary of the preset models
#: ``--model_preset`` choices: the GPT-2 style ``tiny`` and the Llama-family ``llama_tiny``.
MODEL_PRESETS = ("tiny", *LLAMA_PRESETS)

#: row name -> (how our gradient is computed, which oracle gradient it is compared with)
HOW = {
    "tokens": ('train_loop(loss_normalization="tokens")', "big-batch token mean"),
    "mean-of-means": ('train_loop(loss_normalization="mean")', "big-batch token mean"),
    "sum": ("reduction=sum loss, loss.backward() in accumulate", "big-batch sum"),
    "batchnorm (train mode)": ('train_loop(loss_normalization="tokens"), BatchNorm in training mode',
                               "big batch, BatchNorm in training mode"),
}
BATCHNORM_ROW = "batchnorm (train mode)"


def validate(gradient_accumulation_steps, per_device_train_batch_size, rtol, atol, loss_normalization,
             mixed_precision=None, model_preset: str = "tiny", model_name_or_path: str | None = None) -> None:
    """Range and choice checks of verify's settings (command line and Python API alike).

    Raises:
        UsageError: naming the flag (``--gradient_accumulation_steps``,
            ``--per_device_train_batch_size``, ``--rtol``, ``--atol``, ``--loss_normalization``,
            ``--mixed_precision``, ``--model_preset``).
    """
    checks.one_of("--model_preset", model_preset, MODEL_PRESETS)
    if model_name_or_path and model_preset != "tiny":
        raise UsageError("--model_preset", f"{model_preset} given together with --model_name_or_path",
                         "pass one of them")
    if gradient_accumulation_steps is not None:
        checks.at_least("--gradient_accumulation_steps", gradient_accumulation_steps)
    checks.at_least("--per_device_train_batch_size", per_device_train_batch_size)
    if rtol is not None:  # None: the tolerance of the precision (compare.mixed_precision_rtol)
        checks.positive("--rtol", rtol, fix=f"pass e.g. {DEFAULT_RTOL:g}")
    if atol is not None:
        checks.non_negative("--atol", atol, fix=f"pass e.g. {DEFAULT_ATOL:g}")
    checks.one_of("--loss_normalization", loss_normalization, SELECTABLE)
    if mixed_precision is not None:
        checks.one_of("--mixed_precision", mixed_precision, MIXED_PRECISIONS)


@dataclass
class RunSettings:
    """The resolved settings of one verification (what the report states)."""

    gradient_accumulation_steps: int  # K, micro-batches per full window
    per_device_train_batch_size: int  # B, examples per micro-batch per process
    world_size: int  # W, processes
    partial_micro_batches: int  # r, micro-batches per process in the partial window (0: none)
    seed: int
    model: dict  # description, vocab_size, max_length (tokens), parameters, ...
    partial_window: bool
    trainer_row: bool  # also run transformers' Trainer (informational row)
    loss_normalization: str  # "tokens" or "mean": the row that decides the verdict
    rtol: float
    atol: float  # gradient units of a token-mean gradient
    dataparallel: bool | None  # None: when >= 2 CUDA GPUs
    device: str
    distributed_type: str
    mixed_precision: str = "no"  # the Accelerator's: "no", "bf16" or "fp16"
    normwise: bool = False  # tolerance criterion: normwise rel_error <= rtol (autocast) or elementwise
    autocast: bool = False  # the Accelerator really autocasts (no fp16 autocast on CPU)
    workload: Workload | None = None  # the examples, collate, loss and oracle loss
    batchnorm_layers: tuple = ()  # BatchNorm layers in training mode in the given model (the finding runs if any)

    @property
    def windows(self) -> int:
        return 1 + (self.partial_micro_batches > 0)


@dataclass
class Captured:
    """What the rows produced, as collected on the main process.

    Attributes:
        grads: row name -> per window ``{parameter name: float32 gradient}``
            (the main process's copies; None elsewhere).
        examples: per rank, ``{row name: per window [indices of the examples that rank ran]}``.
        norms: float64 tensor (world size, rows x windows): every rank's
            gradient L2 norm, row-major by row then window.
    """

    grads: dict
    examples: list
    norms: torch.Tensor
    trainer: dict | None = None  # capture_trainer's result (main process) with "examples" of every rank
    workload: Workload | None = None

    @property
    def names(self) -> list[str]:
        return list(self.grads)

    def window_indices(self, name: str, w: int) -> list[int]:
        """All processes' example indices of row ``name``, window ``w`` (0-based): rank order, then micro-batch order."""
        return [i for per_rank in self.examples for i in per_rank[name][w]]

    def window_examples(self, name: str, w: int) -> list:
        """The examples of :meth:`window_indices`."""
        return self.workload.window(self.window_indices(name, w))


def _build_model(model, model_name_or_path, seed, model_preset="tiny", token_data=True):
    """(float32 model in eval mode, description dict without the parameter count, training BatchNorm layers).

    ``token_data``: verify generates token sequences for it, so it needs ``config.vocab_size``.
    """
    if model is not None:
        m, desc = copy.deepcopy(model), f"{type(model).__name__} (given)"
    elif model_name_or_path:
        m, desc = load_model(model_name_or_path), f"{model_name_or_path}"
    elif model_preset in LLAMA_PRESETS:
        m = build_llama_model(model_preset, TINY_VOCAB, MAX_LENGTH, seed=seed)
        p = LLAMA_PRESETS[model_preset]
        desc = (f"preset {model_preset} (LlamaForCausalLM, {p['num_hidden_layers']} layers, width {p['hidden_size']}, "
                f"vocab {TINY_VOCAB}, random init seed {seed})")
    else:
        m = build_model("tiny", TINY_VOCAB, MAX_LENGTH, seed=seed)
        p = PRESETS["tiny"]
        desc = (f"preset tiny (GPT-2 style, {p['n_layer']} layers, width {p['n_embd']}, vocab {TINY_VOCAB}, "
                f"random init seed {seed})")
    layers = tuple(batchnorm.training_batchnorm_layers(m))  # before eval(): the modes the model was given in
    spec = {"description": desc, "preset": None if (model is not None or model_name_or_path) else model_preset,
            "class": type(m).__name__, "init_seed": seed, "model_name_or_path": model_name_or_path}
    if token_data:
        cfg = getattr(m, "config", None)
        vocab = getattr(cfg, "vocab_size", None)
        positions = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or MAX_LENGTH
        if vocab is None:
            raise UsageError("model" if model is not None else "--model_name_or_path",
                             "the model has no config.vocab_size, so verify cannot make token data for it",
                             "pass a transformers causal LM, or your own dataset= and loss_fn=")
        spec.update(vocab_size=int(vocab), max_length=int(min(MAX_LENGTH, positions)), n_positions=int(positions))
    return m.float().eval(), spec, layers


def verify_accumulation(
    accelerator=None,
    *,
    gradient_accumulation_steps: int | None = None,
    per_device_train_batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    model_name_or_path: str | None = None,
    model=None,
    model_preset: str = "tiny",
    partial_window: bool = True,
    trainer_row: bool = True,
    loss_normalization: str = "tokens",
    rtol: float | None = None,
    atol: float | None = None,
    dataparallel: bool | None = None,
    mixed_precision: str | None = None,
    loss_fn=None,
    dataset=None,
    collate_fn=None,
) -> VerifyReport:
    """Compare the toolkit's accumulated gradient with a single-process big batch.

    Call it on every process (it runs collectives); every process gets the
    same report. See :mod:`accum_kit.verify` for what is compared and how.
    Any model, loss and data: pass ``model``, ``loss_fn`` and ``dataset``
    (and ``collate_fn``), e.g. a classifier with
    :func:`accum_kit.classification_loss` (items = examples) or an
    encoder-decoder with :func:`accum_kit.seq2seq_loss`. Without ``dataset``
    it runs verify's own random token sequences through a causal LM.
    Pass ``model`` unprepared (call this before ``accelerator.prepare`` of
    your training objects, or pass ``accelerator.unwrap_model(model)``): it is
    deep-copied, and the copies prepared inside ``accelerator`` are
    unregistered again afterwards (your own stay registered). It ends on a
    window boundary: its last window closes at the end of its dataloader,
    which resets Accelerate's micro-batch counter. torch's global (CPU)
    random state is restored, so a script's training after it runs as it
    would without it.

    Args:
        accelerator: an Accelerator built with ``gradient_accumulation_steps=K``;
            None builds one with :func:`accum_kit.build_accelerator`.
        gradient_accumulation_steps: K; None takes the accelerator's, or
            :func:`accum_kit.launch.resolve_accumulation_steps` (the flag, else
            ``$ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, else 4).
        per_device_train_batch_size: examples per micro-batch per process.
        seed: seeds the examples and the preset model's initialisation.
        model_name_or_path: a local causal LM (``save_pretrained`` directory)
            instead of a preset.
        model: an unprepared causal LM module to verify instead (deep-copied, not modified).
        model_preset: ``"tiny"`` (GPT-2 style) or ``"llama_tiny"`` (LlamaForCausalLM), both
            randomly initialised from ``seed``; ignored when ``model`` is given.
        partial_window: add a partial last window of ``ceil(K / 2)`` micro-batches.
        trainer_row: also run transformers' Trainer on the same windows (the
            informational ``trainer`` row, :mod:`accum_kit.verify.trainer`; it
            never decides ``passed``).
        loss_normalization: which row decides ``passed``: ``"tokens"`` or
            ``"mean"`` (the ``mean-of-means`` row).
        rtol, atol: tolerance; None takes the precision's: float32 elementwise
            ``|g - o| <= atol + rtol |o|`` (rtol 1e-4, atol 1e-6), or under
            bf16 / fp16 normwise ``||g - o|| / ||o|| <= rtol`` with ``rtol =
            sqrt(m) u`` (:func:`~accum_kit.verify.compare.mixed_precision_rtol`; atol unused).
        dataparallel: measure ``torch.nn.DataParallel``; None: when
            ``torch.cuda.device_count() >= 2``.
        mixed_precision: ``"no"``, ``"bf16"`` or ``"fp16"`` for the Accelerator
            this builds (None: ``"no"``); with ``accelerator`` given, its own
            (a different value is an error).
        loss_fn: ``loss_fn(model, batch) -> (summed_loss, num_items)``, the
            contract of :func:`accum_kit.train_loop`; the rows train with it
            and, on a user ``dataset``, the oracle applies it to the whole
            window as one batch. None: :func:`accum_kit.causal_lm_loss`.
        dataset: your examples (a list or map-style dataset; the first
            ``(K + r) x B x W`` are used, in order, every process the same);
            None: verify's random token sequences (the model must then be a
            causal LM with ``config.vocab_size``).
        collate_fn: list of examples -> batch for ``dataset`` (None:
            ``torch.utils.data.default_collate``); the oracle collates a whole
            window with it, so padding must be ignored by the loss.

    With a ``dataset`` or ``loss_fn`` the ``trainer`` row is skipped (it runs
    transformers' causal-LM Trainer on verify's token data). When ``model``
    has BatchNorm layers in training mode (a freshly built module is in
    training mode), a further pass measures how far they take the update from
    the big batch: an informational row and ``report.batchnorm``
    (:mod:`accum_kit.verify.batchnorm`); it never changes ``passed``.

    Returns:
        :class:`VerifyReport` (``passed``, ``rows``, ``ddp_sum_ratio``, ``batchnorm``, ``to_dict()``, ``format()``).

    Raises:
        UsageError: bad argument (the message names the flag or argument),
            e.g. a ``dataset`` with too few examples.
        ProcessCountError: the launcher and the Accelerator disagree on the process count.
    """
    t0 = time.perf_counter()
    validate(gradient_accumulation_steps, per_device_train_batch_size, rtol, atol, loss_normalization,
             mixed_precision, model_preset, model_name_or_path)
    if accelerator is None:
        K = resolve_accumulation_steps(gradient_accumulation_steps)
        accelerator = build_accelerator(K, mixed_precision=mixed_precision or "no")
    else:
        if mixed_precision is not None and mixed_precision != accelerator.mixed_precision:
            raise UsageError("mixed_precision", f"{mixed_precision} differs from the accelerator's "
                             f"{accelerator.mixed_precision}", "omit it or build the accelerator with it")
        K = accelerator.gradient_accumulation_steps
        if gradient_accumulation_steps is not None and gradient_accumulation_steps != K:
            raise UsageError("gradient_accumulation_steps", f"{gradient_accumulation_steps} differs from the "
                             f"accelerator's {K}", "omit it or build the accelerator with the same K")
    precision = accelerator.mixed_precision
    normwise = precision != "no"  # autocast: normwise criterion, sqrt(m) u
    rtol = rtol if rtol is not None else (mixed_precision_rtol(precision) if normwise else DEFAULT_RTOL)
    atol = atol if atol is not None else (0.0 if normwise else DEFAULT_ATOL)
    main = accelerator.is_main_process
    token_data = dataset is None
    with torch.random.fork_rng(devices=[]):  # a preset seeds torch before initialising its weights
        base, spec, bn_layers = _build_model(model, model_name_or_path, seed, model_preset, token_data)
    spec["parameters"] = sum(p.numel() for p in base.parameters())
    r = partial_micro_batches(K, partial_window)
    n = (K + r) * per_device_train_batch_size * accelerator.num_processes
    workload = (token_workload(n, seed, spec["vocab_size"], spec["max_length"], loss_fn) if token_data
                else user_workload(dataset, n, collate_fn, loss_fn or causal_lm_loss))
    trainer_skip = None
    if trainer_row and (loss_fn is not None or not token_data):
        trainer_row, trainer_skip = False, ("it runs transformers' causal-LM Trainer on verify's own token data; "
                                            "a loss_fn or dataset was given")
    oracle_model = copy.deepcopy(base) if main else None  # initial parameters, before prepare
    trainer_model = copy.deepcopy(base) if trainer_row else None  # Trainer wraps its own copy
    settings = RunSettings(
        gradient_accumulation_steps=K, per_device_train_batch_size=per_device_train_batch_size,
        world_size=accelerator.num_processes, partial_micro_batches=r,
        seed=seed, model=spec, partial_window=partial_window, trainer_row=trainer_row,
        loss_normalization=loss_normalization,
        rtol=rtol, atol=atol, dataparallel=dataparallel, device=str(accelerator.device),
        distributed_type=str(accelerator.distributed_type).split(".")[-1], mixed_precision=precision,
        normwise=normwise, autocast=bool(getattr(accelerator, "native_amp", False)), workload=workload,
        batchnorm_layers=bn_layers)
    # Leave the caller's random state as it was: every DataLoader iteration draws a seed from torch's global
    # generator (torch.utils.data.DataLoader), which would shift e.g. the shuffling of a training DataLoader
    # the caller prepares afterwards. Nothing verify computes depends on it (no dropout, seeded examples).
    with torch.random.fork_rng(devices=[]):
        captured = _capture(accelerator, base, settings)
        if trainer_model is not None:
            captured.trainer = _capture_trainer(accelerator, trainer_model, settings)
        elif trainer_skip is not None:
            captured.trainer = {"skipped": trainer_skip}

    payload = None
    if main:
        try:
            payload = ("ok", _evaluate(settings, captured, oracle_model))
        except Exception as exc:  # tell the other processes (they wait in the broadcast), then re-raise
            broadcast_object_list([("error", f"{type(exc).__name__}: {exc}")])
            raise
    status, report = broadcast_object_list([payload])[0]
    if status != "ok":
        raise RuntimeError(f"the main process failed while computing the oracle: {report}")
    report.seconds = time.perf_counter() - t0
    return report


def _capture_trainer(accelerator, model, s: RunSettings) -> dict:
    """Every process: the Trainer row's run; the main process gets every rank's examples and gradient norms.

    A failure inside Trainer (e.g. settings its own Accelerator cannot share
    with the caller's) skips the row instead of failing the check, on every process.
    """
    try:
        run = capture_trainer(accelerator, model, s.workload.examples, s.gradient_accumulation_steps,
                              s.per_device_train_batch_size, s.seed)
        error = None
    except Exception as exc:  # informational row: report, do not fail
        run, error = {"examples": [], "norms": []}, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    errors = gather_object([error])
    if any(errors):
        return {"skipped": f"Trainer failed: {next(e for e in errors if e)}"}
    run["examples"] = gather_object([run["examples"]])
    run["norms"] = accelerator.gather(torch.tensor(run["norms"], dtype=torch.float64,
                                                   device=accelerator.device)).cpu().view(s.world_size, -1)
    return run


def _capture(accelerator, base, s: RunSettings) -> Captured:
    """Every process: run the rows on prepared copies; gather example indices and gradient norms."""
    K, B, W, r = s.gradient_accumulation_steps, s.per_device_train_batch_size, s.world_size, s.partial_micro_batches
    wl = s.workload
    capture = GradientCapture(base.named_parameters(), keep=accelerator.is_main_process)
    pmodel, popt, ploader = accelerator.prepare(base, capture, wl.loader(B))
    runs = {}  # row name -> (captured grads per window (main) / None, norms per window, indices per window)
    passes = [("tokens", "tokens", EvalMode(pmodel)), ("mean-of-means", "mean", EvalMode(pmodel))]
    if s.batchnorm_layers:  # last: training mode moves the BatchNorm running statistics of this copy
        passes.append((BATCHNORM_ROW, "tokens", batchnorm.BatchNormTrainMode(pmodel)))
    try:
        if len(ploader) != K + r:
            raise RuntimeError(f"expected {K + r} micro-batches per process after sharding, got {len(ploader)}")
        for name, mode, modes in passes[:2]:
            runs[name] = _loop_pass(accelerator, pmodel, popt, ploader, capture, wl, mode, modes)
        # reduction="sum": plain backward inside accumulate; only DDP stands between it and the big batch.
        rec, window = IndexRecorder(wl.loss_fn), 0
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
        for name, mode, modes in passes[2:]:
            runs[name] = _loop_pass(accelerator, pmodel, popt, ploader, capture, wl, mode, modes)
    finally:
        forget_prepared(accelerator, (pmodel, popt, ploader))

    for name, (_, norms, _) in runs.items():
        if len(norms) != s.windows:
            raise RuntimeError(f"{name}: {len(norms)} optimizer steps, expected {s.windows}")
    # Examples each process ran, per row and window; gradient norms of every rank.
    ran = gather_object([{name: run[2] for name, run in runs.items()}])
    norms = accelerator.gather(torch.tensor([x for run in runs.values() for x in run[1]],
                                            dtype=torch.float64, device=accelerator.device)).cpu().view(W, -1)
    return Captured(grads={name: run[0] for name, run in runs.items()}, examples=ran, norms=norms, workload=wl)


def _loop_pass(accelerator, pmodel, popt, ploader, capture, wl: Workload, mode: str, modes) -> tuple:
    """One epoch of train_loop over the windows; ``modes`` is the callback that sets the modules' modes."""
    rec = IndexRecorder(wl.loss_fn)
    with warnings.catch_warnings():  # the BatchNorm pass is measured on purpose: the report says it
        warnings.simplefilter("ignore", BatchNormAccumulationWarning)
        train_loop(accelerator, pmodel, popt, ploader, num_train_epochs=1, loss_normalization=mode,
                   loss_fn=rec, callbacks=[rec, modes], progress=False)
    return (*capture.take(), rec.windows)


def _evaluate(s: RunSettings, cap: Captured, oracle_model) -> VerifyReport:
    """Main process: oracle per window, row comparisons, ratios."""
    device, wl = s.device, s.workload
    oracle_model = oracle_model.double().to(device).eval()
    K, r, n_windows = s.gradient_accumulation_steps, s.partial_micro_batches, s.windows
    oracle_cache: dict = {}

    def oracle(indices):
        key = tuple(indices)
        if key not in oracle_cache:
            oracle_cache[key] = big_batch_gradient(oracle_model, wl.window(indices), device, wl.collate_fn,
                                                   wl.oracle_loss)
        return oracle_cache[key]

    windows = []
    for w in range(n_windows):
        idx = cap.window_indices("tokens", w)
        sum_grad, n_tok = oracle(idx)
        mean_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in sum_grad.values())) / max(n_tok, 1)
        windows.append(WindowInfo(
            index=w + 1, partial=w == 1, micro_batches_per_process=K if w == 0 else r, examples=len(idx),
            target_tokens=n_tok, oracle_grad_norm=mean_norm, oracle_sum_grad_norm=mean_norm * n_tok,
            input_ids=[e["input_ids"] for e in wl.window(idx)] if wl.token_data else [], indices=idx))

    rows, sum_pairs = [], []
    for j, name in enumerate(cap.names):
        if name == BATCHNORM_ROW:
            continue
        how, compared = HOW[name]
        row = Row(name, how, compared if wl.token_data else compared.replace("token mean", "item mean"))
        row.rank_spread = _rank_spread(cap, j, n_windows)
        for w in range(n_windows):
            sum_grad, n_tok = oracle(cap.window_indices(name, w))
            if name == "sum":  # atol is stated for token-mean gradients; the sum gradient is N times larger
                want, row_atol = sum_grad, s.atol * n_tok
            else:
                want, row_atol = {k: v / max(n_tok, 1) for k, v in sum_grad.items()}, s.atol
            c = compare_gradients(cap.grads[name][w], want, s.rtol, row_atol, s.normwise)
            if name == "sum":
                sum_pairs.append((cap.grads[name][w], want, c))
            row.add_window(w + 1, c)
        row.conclude(s.rtol)
        rows.append(row)

    ratio = sum(c["dot"] for *_, c in sum_pairs) / sum(c["want_sq"] for *_, c in sum_pairs)
    residual = scaled_residual([(g, o) for g, o, _ in sum_pairs], ratio)

    n_gpu = torch.cuda.device_count()
    dp_row = Row("sum (DataParallel)", "reduction=sum loss, nn.DataParallel, one process", "big-batch sum")
    dp_ratio = None
    use_dataparallel = s.dataparallel if s.dataparallel is not None else n_gpu >= 2
    if use_dataparallel:
        dots, sqs = 0.0, 0.0
        for w in range(n_windows):
            idx = cap.window_indices("tokens", w)
            want, n_tok = oracle(idx)
            got = dataparallel_sum_gradient(oracle_model, wl.window(idx), collate_fn=wl.collate_fn,
                                            loss_fn=wl.oracle_loss)
            c = compare_gradients(got, want, s.rtol, s.atol * n_tok, s.normwise)
            dots, sqs = dots + c["dot"], sqs + c["want_sq"]
            dp_row.add_window(w + 1, c)
        dp_row.conclude()
        dp_ratio = dots / sqs
    else:
        dp_row.skipped = (f"needs >= 2 CUDA GPUs, found {n_gpu} (on fewer, DataParallel runs the module "
                          "unchanged, so it would measure nothing)")
    rows.append(dp_row)
    if cap.trainer is not None:
        rows.append(_trainer_row(s, cap, _examples_oracle(oracle_model, wl, device)))
    finding = None
    if BATCHNORM_ROW in cap.grads:
        bn_row, finding = _batchnorm_row(s, cap, oracle_model)
        rows.append(bn_row)

    return VerifyReport(
        world_size=s.world_size, distributed_type=s.distributed_type, gradient_accumulation_steps=K,
        per_device_train_batch_size=s.per_device_train_batch_size, seed=s.seed, model=s.model,
        partial_window=s.partial_window, windows=windows, rows=rows, rtol=s.rtol, atol=s.atol,
        selected=s.loss_normalization, ddp_sum_ratio=ratio, ddp_sum_residual=residual,
        dataparallel_sum_ratio=dp_ratio, mixed_precision=s.mixed_precision, normwise=s.normwise,
        autocast=s.autocast, data={"description": wl.description, "items": wl.items, "token_data": wl.token_data},
        batchnorm=finding,
        oracle={"dtype": "float64", "device": str(device),
                "grad_norm": [w.oracle_grad_norm for w in windows],
                "sum_grad_norm": [w.oracle_sum_grad_norm for w in windows]},
    )


def _rank_spread(cap: Captured, j: int, n_windows: int) -> float:
    """Largest relative difference of row ``j``'s gradient norms between ranks (0: all ranks hold the same)."""
    per_rank = cap.norms[:, j * n_windows:(j + 1) * n_windows]
    return float(((per_rank - per_rank[0]).abs() / per_rank[0].clamp(min=1e-30)).max())


def _examples_oracle(oracle_model, wl: Workload, device):
    """``examples -> (summed-loss gradient, N)`` for the trainer row (it records examples, not indices)."""
    cache: dict = {}

    def oracle(examples):
        key = tuple(tuple(e["input_ids"]) for e in examples)
        if key not in cache:
            cache[key] = big_batch_gradient(oracle_model, examples, device, wl.collate_fn, wl.oracle_loss)
        return cache[key]

    return oracle


def _batchnorm_row(s: RunSettings, cap: Captured, oracle_model) -> tuple[Row, dict]:
    """The informational BatchNorm row and finding: train-mode update against the train-mode big batch."""
    wl, n_windows = s.workload, s.windows
    j = cap.names.index(BATCHNORM_ROW)
    row = Row(BATCHNORM_ROW, *HOW[BATCHNORM_ROW], informational=True)
    row.rank_spread = _rank_spread(cap, j, n_windows)
    comps = []
    with batchnorm.big_batch_statistics(oracle_model):
        for w in range(n_windows):
            sum_grad, n = big_batch_gradient(oracle_model, wl.window(cap.window_indices(BATCHNORM_ROW, w)),
                                             s.device, wl.collate_fn, wl.oracle_loss)
            c = compare_gradients(cap.grads[BATCHNORM_ROW][w], {k: v / max(n, 1) for k, v in sum_grad.items()},
                                  s.rtol, s.atol, s.normwise)
            row.add_window(w + 1, c)
            comps.append(c)
    row.conclude(s.rtol)
    return row, batchnorm.summarize(list(s.batchnorm_layers), comps)


def _trainer_row(s: RunSettings, cap: Captured, oracle) -> Row:
    """The informational ``trainer`` row from :func:`_capture_trainer`'s result (main process)."""
    run = cap.trainer
    row = Row("trainer", f"transformers {run.get('transformers', '')} Trainer, average_tokens_across_devices, "
              "max_grad_norm=0".replace("  ", " "), "big-batch token mean", informational=True)
    if "skipped" in run:
        row.skipped = run["skipped"]
        return row
    n_windows = len(run["grads"])
    if n_windows != s.windows:
        row.skipped = f"Trainer made {n_windows} optimizer steps, expected {s.windows}"
        return row
    windows = [[e for per_rank in run["examples"] for e in per_rank[w]] for w in range(n_windows)]
    comps, summary = trainer_summary(run, windows, oracle)
    for w, c in enumerate(comps):
        row.add_window(w + 1, c)
    per_rank = run["norms"]
    row.rank_spread = float(((per_rank - per_rank[0]).abs() / per_rank[0].clamp(min=1e-30)).max())
    row.conclude(s.rtol)
    summary.update(same_examples_as_tokens_row=all(
        windows[w] == cap.window_examples("tokens", w) for w in range(n_windows)),
        loss_type=run["loss_type"], loss_shifts_labels=run["loss_shifts_labels"], model_class=run["model_class"])
    row.summary = summary
    return row
