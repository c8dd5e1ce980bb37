"""The check: run three normalisations through an Accelerator, then compare each window with the oracle.

:func:`verify_accumulation` prepares throw-away copies (model, a
:class:`~accum_kit.verify.capture.GradientCapture` optimizer, the examples'
DataLoader) inside the given Accelerator, runs each row over the same windows,
optionally runs transformers' Trainer on another copy (the informational
``trainer`` row, :mod:`accum_kit.verify.trainer`), gathers what every process
ran and saw, and lets the main process compute the oracle and the report,
which it broadcasts to every process.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
from accelerate.utils import broadcast_object_list, gather_object
from torch.utils.data import DataLoader

from .. import checks
from ..compat import forget_prepared
from ..errors import UsageError
from ..launch import build_accelerator, resolve_accumulation_steps
from ..sharding import policy_name
from ..loop import train_loop
from ..models import LLAMA_PRESETS, PRESETS, build_llama_model, build_model, load_model
from .capture import EvalMode, ExampleRecorder, GradientCapture
from .compare import (DEFAULT_ATOL, DEFAULT_RTOL, MIXED_PRECISIONS, compare_gradients, mixed_precision_rtol,
                      scaled_residual)
from .data import MAX_LENGTH, make_examples, pad_collate, partial_micro_batches
from .oracle import big_batch_gradient, dataparallel_sum_gradient
from .report import SELECTABLE, Row, VerifyReport, WindowInfo
from .trainer import capture_trainer, trainer_summary

DEFAULT_BATCH_SIZE = 2  # examples per micro-batch per process
TINY_VOCAB = 128  # vocabulary of the preset models
#: ``--model_preset`` choices: the GPT-2 style ``tiny`` and the Llama-family ``llama_tiny``.
MODEL_PRESETS = ("tiny", *LLAMA_PRESETS)

#: row name -> (how our gradient is computed, which oracle gradient it is compared with)
HOW = {
    "tokens": ('train_loop(loss_normalization="tokens")', "big-batch token mean"),
    "mean-of-means": ('train_loop(loss_normalization="mean")', "big-batch token mean"),
    "sum": ("reduction=sum loss, loss.backward() in accumulate", "big-batch sum"),
}


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
    accumulation_policy: str = "no_sync"  # the Accelerator's (accum_kit.policies)

    @property
    def windows(self) -> int:
        return 1 + (self.partial_micro_batches > 0)


@dataclass
class Captured:
    """What the rows produced, as collected on the main process.

    Attributes:
        grads: row name -> per window ``{parameter name: float32 gradient}``
            (the main process's copies; None elsewhere).
        examples: per rank, ``{row name: per window [examples that rank ran]}``.
        norms: float64 tensor (world size, rows x windows): every rank's
            gradient L2 norm, row-major by row then window.
    """

    grads: dict
    examples: list
    norms: torch.Tensor
    trainer: dict | None = None  # capture_trainer's result (main process) with "examples" of every rank

    @property
    def names(self) -> list[str]:
        return list(self.grads)

    def window_examples(self, name: str, w: int) -> list[dict]:
        """All processes' examples of row ``name``, window ``w`` (0-based): rank order, then micro-batch order."""
        return [e for per_rank in self.examples for e in per_rank[name][w]]


def _build_model(model, model_name_or_path, seed, model_preset="tiny"):
    """(float32 model in eval mode, description dict without the parameter count)."""
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
    cfg = getattr(m, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    positions = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or MAX_LENGTH
    if vocab is None:
        raise UsageError("--model_name_or_path", "the model has no config.vocab_size",
                         "pass a transformers causal LM")
    spec = {"description": desc, "vocab_size": int(vocab), "max_length": int(min(MAX_LENGTH, positions)),
            "preset": None if (model is not None or model_name_or_path) else model_preset,
            "class": type(m).__name__,
            "n_positions": int(positions), "init_seed": seed, "model_name_or_path": model_name_or_path}
    return m.float().eval(), spec


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
    accumulation_policy: str | None = None,
) -> VerifyReport:
    """Compare the toolkit's accumulated gradient with a single-process big batch.

    Call it on every process (it runs collectives); every process gets the
    same report. See :mod:`accum_kit.verify` for what is compared and how.
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
        accumulation_policy: the policy of the Accelerator this builds
            (:mod:`accum_kit.policies`; None: ``no_sync``); with ``accelerator``
            given, its own (a different value is an error). Launched with an
            FSDP2 config, the rows run on sharded copies of the model.

    Returns:
        :class:`VerifyReport` (``passed``, ``rows``, ``ddp_sum_ratio``, ``to_dict()``, ``format()``).

    Raises:
        UsageError: bad argument (the message names the flag).
        ProcessCountError: the launcher and the Accelerator disagree on the process count.
    """
    t0 = time.perf_counter()
    validate(gradient_accumulation_steps, per_device_train_batch_size, rtol, atol, loss_normalization,
             mixed_precision, model_preset, model_name_or_path)
    if accelerator is None:
        K = resolve_accumulation_steps(gradient_accumulation_steps)
        accelerator = build_accelerator(K, mixed_precision=mixed_precision or "no",
                                        accumulation_policy=accumulation_policy)
    else:
        if mixed_precision is not None and mixed_precision != accelerator.mixed_precision:
            raise UsageError("mixed_precision", f"{mixed_precision} differs from the accelerator's "
                             f"{accelerator.mixed_precision}", "omit it or build the accelerator with it")
        own = getattr(getattr(accelerator, "accumulation_policy", None), "name", "no_sync")
        if accumulation_policy is not None and accumulation_policy != own:
            raise UsageError("accumulation_policy", f"{accumulation_policy} differs from the accelerator's {own}",
                             "omit it or build the accelerator with it")
        K = accelerator.gradient_accumulation_steps
        if gradient_accumulation_steps is not None and gradient_accumulation_steps != K:
            raise UsageError("gradient_accumulation_steps", f"{gradient_accumulation_steps} differs from the "
                             f"accelerator's {K}", "omit it or build the accelerator with the same K")
    precision = accelerator.mixed_precision
    normwise = precision != "no"  # autocast: normwise criterion, sqrt(m) u
    rtol = rtol if rtol is not None else (mixed_precision_rtol(precision) if normwise else DEFAULT_RTOL)
    atol = atol if atol is not None else (0.0 if normwise else DEFAULT_ATOL)
    main = accelerator.is_main_process
    with torch.random.fork_rng(devices=[]):  # a preset seeds torch before initialising its weights
        base, spec = _build_model(model, model_name_or_path, seed, model_preset)
    spec["parameters"] = sum(p.numel() for p in base.parameters())
    oracle_model = copy.deepcopy(base) if main else None  # initial parameters, before prepare
    trainer_model = copy.deepcopy(base) if trainer_row else None  # Trainer wraps its own copy
    settings = RunSettings(
        gradient_accumulation_steps=K, per_device_train_batch_size=per_device_train_batch_size,
        world_size=accelerator.num_processes, partial_micro_batches=partial_micro_batches(K, partial_window),
        seed=seed, model=spec, partial_window=partial_window, trainer_row=trainer_row,
        loss_normalization=loss_normalization,
        rtol=rtol, atol=atol, dataparallel=dataparallel, device=str(accelerator.device),
        distributed_type=str(accelerator.distributed_type).split(".")[-1], mixed_precision=precision,
        normwise=normwise, autocast=bool(getattr(accelerator, "native_amp", False)),
        accumulation_policy=policy_name(accelerator))
    # Leave the caller's random state as it was: every DataLoader iteration draws a seed from torch's global
    # generator (torch.utils.data.DataLoader), which would shift e.g. the shuffling of a training DataLoader
    # the caller prepares afterwards. Nothing verify computes depends on it (no dropout, seeded examples).
    with torch.random.fork_rng(devices=[]):
        captured = _capture(accelerator, base, settings)
        if trainer_model is not None:
            captured.trainer = _capture_trainer(accelerator, trainer_model, settings)

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


def _examples(s: RunSettings) -> list[dict]:
    """The run's examples, the same on every process: (K + r) micro-batches x B examples x W processes."""
    n = (s.gradient_accumulation_steps + s.partial_micro_batches) * s.per_device_train_batch_size * s.world_size
    return make_examples(n, s.seed, s.model["vocab_size"], s.model["max_length"])


def _capture_trainer(accelerator, model, s: RunSettings) -> dict:
    """Every process: the Trainer row's run; the main process gets every rank's examples and gradient norms.

    A failure inside Trainer (e.g. settings its own Accelerator cannot share
    with the caller's) skips the row instead of failing the check, on every process.
    """
    try:
        run = capture_trainer(accelerator, model, _examples(s), s.gradient_accumulation_steps,
                              s.per_device_train_batch_size, s.seed)
        error = None
    except Exception as exc:  # informational row: report, do not fail
        run, error = {"examples": [], "norms": []}, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    errors = gather_object([error])
    if any(errors):
        return {"skipped": next(e for e in errors if e)}
    run["examples"] = gather_object([run["examples"]])
    run["norms"] = accelerator.gather(torch.tensor(run["norms"], dtype=torch.float64,
                                                   device=accelerator.device)).cpu().view(s.world_size, -1)
    return run


def _capture(accelerator, base, s: RunSettings) -> Captured:
    """Every process: run the three rows on prepared copies; gather examples and gradient norms."""
    K, B, W, r = s.gradient_accumulation_steps, s.per_device_train_batch_size, s.world_size, s.partial_micro_batches
    examples = _examples(s)
    loader = DataLoader(examples, batch_size=B, shuffle=False, collate_fn=pad_collate)
    capture = GradientCapture(base.named_parameters(), keep=accelerator.is_main_process)
    pmodel, popt, ploader = accelerator.prepare(base, capture, loader)
    runs = {}  # row name -> (captured grads per window (main) / None, norms per window, examples per window)
    try:
        if len(ploader) != K + r:
            raise RuntimeError(f"expected {K + r} micro-batches per process after sharding, got {len(ploader)}")
        for name, mode in (("tokens", "tokens"), ("mean-of-means", "mean")):
            rec = ExampleRecorder()
            train_loop(accelerator, pmodel, popt, ploader, num_train_epochs=1, loss_normalization=mode,
                       loss_fn=rec, callbacks=[rec, EvalMode(pmodel)], progress=False)
            runs[name] = (*capture.take(), rec.windows)
        # reduction="sum": plain backward inside accumulate; only DDP stands between it and the big batch.
        rec, window = ExampleRecorder(), 0
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
        forget_prepared(accelerator, (pmodel, popt, ploader))

    for name, (_, norms, _) in runs.items():
        if len(norms) != s.windows:
            raise RuntimeError(f"{name}: {len(norms)} optimizer steps, expected {s.windows}")
    # Examples each process ran, per row and window; gradient norms of every rank.
    ran = gather_object([{name: run[2] for name, run in runs.items()}])
    norms = accelerator.gather(torch.tensor([x for run in runs.values() for x in run[1]],
                                            dtype=torch.float64, device=accelerator.device)).cpu().view(W, -1)
    return Captured(grads={name: run[0] for name, run in runs.items()}, examples=ran, norms=norms)


def _evaluate(s: RunSettings, cap: Captured, oracle_model) -> VerifyReport:
    """Main process: oracle per window, row comparisons, ratios."""
    device = s.device
    oracle_model = oracle_model.double().to(device).eval()
    K, r, n_windows = s.gradient_accumulation_steps, s.partial_micro_batches, s.windows
    oracle_cache: dict = {}

    def oracle(examples):
        key = tuple(tuple(e["input_ids"]) for e in examples)
        if key not in oracle_cache:
            oracle_cache[key] = big_batch_gradient(oracle_model, examples, device)
        return oracle_cache[key]

    windows = []
    for w in range(n_windows):
        ex = cap.window_examples("tokens", w)
        sum_grad, n_tok = oracle(ex)
        mean_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in sum_grad.values())) / max(n_tok, 1)
        windows.append(WindowInfo(
            index=w + 1, partial=w == 1, micro_batches_per_process=K if w == 0 else r, examples=len(ex),
            target_tokens=n_tok, oracle_grad_norm=mean_norm, oracle_sum_grad_norm=mean_norm * n_tok,
            input_ids=[e["input_ids"] for e in ex]))

    rows, sum_pairs = [], []
    for j, name in enumerate(cap.names):
        row = Row(name, *HOW[name])
        per_rank = cap.norms[:, j * n_windows:(j + 1) * n_windows]
        row.rank_spread = float(((per_rank - per_rank[0]).abs() / per_rank[0].clamp(min=1e-30)).max())
        for w in range(n_windows):
            sum_grad, n_tok = oracle(cap.window_examples(name, w))
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
            ex = cap.window_examples("tokens", w)
            want, n_tok = oracle(ex)
            c = compare_gradients(dataparallel_sum_gradient(oracle_model, ex), want, s.rtol, s.atol * n_tok,
                                  s.normwise)
            dots, sqs = dots + c["dot"], sqs + c["want_sq"]
            dp_row.add_window(w + 1, c)
        dp_row.conclude()
        dp_ratio = dots / sqs
    else:
        dp_row.skipped = (f"needs >= 2 CUDA GPUs, found {n_gpu} (on fewer, DataParallel runs the module "
                          "unchanged, so it would measure nothing)")
    rows.append(dp_row)
    if cap.trainer is not None:
        rows.append(_trainer_row(s, cap, oracle))

    return VerifyReport(
        world_size=s.world_size, distributed_type=s.distributed_type, gradient_accumulation_steps=K,
        per_device_train_batch_size=s.per_device_train_batch_size, seed=s.seed, model=s.model,
        partial_window=s.partial_window, windows=windows, rows=rows, rtol=s.rtol, atol=s.atol,
        selected=s.loss_normalization, ddp_sum_ratio=ratio, ddp_sum_residual=residual,
        dataparallel_sum_ratio=dp_ratio, mixed_precision=s.mixed_precision, normwise=s.normwise,
        autocast=s.autocast, accumulation_policy=s.accumulation_policy,
        oracle={"dtype": "float64", "device": str(device),
                "grad_norm": [w.oracle_grad_norm for w in windows],
                "sum_grad_norm": [w.oracle_sum_grad_norm for w in windows]},
    )


def _trainer_row(s: RunSettings, cap: Captured, oracle) -> Row:
    """The informational ``trainer`` row from :func:`_capture_trainer`'s result (main process)."""
    run = cap.trainer
    row = Row("trainer", f"transformers {run.get('transformers', '')} Trainer, average_tokens_across_devices, "
              "max_grad_norm=0".replace("  ", " "), "big-batch token mean", informational=True)
    if "skipped" in run:
        row.skipped = f"Trainer failed: {run['skipped']}"
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
