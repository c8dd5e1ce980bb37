"""The check: run three normalisations through an Accelerator, then compare each window with the oracle.

:func:`verify_accumulation` prepares throw-away copies (model, a
:class:`~accum_kit.verify.capture.GradientCapture` optimizer, the examples'
DataLoader) inside the given Accelerator, runs each row over the same windows
(verify's own token data, or the user's model, loss and data:
:mod:`accum_kit.verify.workload`), measures BatchNorm in training mode when the
model has BatchNorm layers (:mod:`accum_kit.verify.batchnorm`), optionally runs
transformers' Trainer on another copy (the informational ``trainer`` row,
:mod:`accum_kit.verify.trainer`), gathers what every process ran and saw, and
lets the main process compute the oracle and the report (:mod:`accum_kit.verify.rows`),
which it broadcasts to every process. Settings and the model copy: :mod:`accum_kit.verify.settings`.
"""

from __future__ import annotations

import copy
import time
import warnings

import torch
from accelerate.utils import broadcast_object_list, gather_object

from ..core.batchnorm import BatchNormAccumulationWarning
from ..compat import forget_prepared
from ..core.loop import train_loop
from ..core.loss import causal_lm_loss
from ..core.run_plan import run_plan_of
from . import batchnorm
from .accelerator import CompileRecord, resolve_accelerator, resolve_tolerances
from .capture import EvalMode, GradientCapture
from .data import partial_micro_batches
from .mesh import mesh_plan, one_per_data_parallel_rank
from .report import VerifyReport
from .rows import BATCHNORM_ROW, evaluate
from .settings import DEFAULT_BATCH_SIZE, Captured, RunSettings, model_copy, validate
from .trainer import capture_trainer
from .workload import IndexRecorder, Workload, token_workload, user_workload

__all__ = ["verify_accumulation"]


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
    accumulation_policy: str | None = None,
    torch_compile: bool = False,
    torch_compile_backend: str | None = None,
    torch_compile_mode: str | None = None,
    gradient_checkpointing: bool = False,
    gradient_checkpointing_kwargs: dict | str | None = None,
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
            ``(K + r) x B x W`` are used, in order, every process the same; W the data-parallel ranks, which
            under tp / cp are fewer than the processes);
            None: verify's random token sequences (the model must then be a
            causal LM with ``config.vocab_size``).
        collate_fn: list of examples -> batch for ``dataset`` (None:
            ``torch.utils.data.default_collate``); the oracle collates a whole
            window with it, so padding must be ignored by the loss.
        accumulation_policy: the policy of the Accelerator this builds
            (:mod:`accum_kit.engines.policies`; None: ``no_sync``); with ``accelerator``
            given, its own (a different value is an error). Launched with an
            FSDP2 config, the rows run on sharded copies of the model.
        torch_compile, torch_compile_backend, torch_compile_mode: compile the
            rows' model copy in ``prepare`` (transformers' names, as the train
            job's ``--torch_compile*``; a backend or a mode implies
            ``torch_compile``; docs/compile.md): the whole model under DDP,
            per block under FSDP2, shapes symbolic from the first call. The
            oracle stays eager (float64). With ``accelerator`` given, its own
            dynamo plugin decides and these must agree with it. The report's
            ``compile`` holds the settings and this process's compile counts.
        gradient_checkpointing, gradient_checkpointing_kwargs: activation checkpointing of the rows' model
            copy, applied in ``prepare`` (:func:`accum_kit.build_accelerator`'s; docs/memory.md); the oracle
            keeps every activation. With ``accelerator`` given, its run plan's setting decides and these must
            agree with it.

    With a ``dataset`` or ``loss_fn`` the ``trainer`` row is skipped (it runs
    transformers' causal-LM Trainer on verify's token data). When ``model``
    has BatchNorm layers (in any mode: ``train_loop`` calls ``model.train()``),
    a further pass measures how far they take the update from the big batch in
    training mode: an informational row and ``report.batchnorm``
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
    accelerator, K = resolve_accelerator(accelerator, gradient_accumulation_steps, mixed_precision,
                                         accumulation_policy, torch_compile, torch_compile_backend,
                                         torch_compile_mode, gradient_checkpointing, gradient_checkpointing_kwargs)
    settings, base, trainer_skip = _plan(
        accelerator, K, model=model, model_name_or_path=model_name_or_path, model_preset=model_preset, seed=seed,
        dataset=dataset, collate_fn=collate_fn, loss_fn=loss_fn, per_device_train_batch_size=per_device_train_batch_size,
        partial_window=partial_window, trainer_row=trainer_row, loss_normalization=loss_normalization,
        rtol=rtol, atol=atol, dataparallel=dataparallel)
    oracle_model = copy.deepcopy(base) if accelerator.is_main_process else None  # initial parameters, before prepare
    trainer_model = copy.deepcopy(base) if settings.trainer_row else None  # Trainer wraps its own copy
    # Leave the caller's random state as it was: every DataLoader iteration draws a seed from torch's global
    # generator (torch.utils.data.DataLoader), which would shift e.g. the shuffling of a training DataLoader
    # the caller prepares afterwards. Nothing verify computes depends on it (no dropout, seeded examples).
    with torch.random.fork_rng(devices=[]):
        compiled = CompileRecord(accelerator)  # before the first compiled forward
        captured = _capture(accelerator, base, settings)
        compile_info = compiled.finish()  # the rows' compiles only, not the informational Trainer row's
        if trainer_model is not None:
            captured.trainer = _capture_trainer(accelerator, trainer_model, settings)
        elif trainer_skip is not None:
            captured.trainer = {"skipped": trainer_skip}
    report = _main_process_report(accelerator, settings, captured, oracle_model)
    report.compile = compile_info
    report.seconds = time.perf_counter() - t0
    return report


def _plan(accelerator, K: int, *, model, model_name_or_path, model_preset, seed, dataset, collate_fn, loss_fn,
          per_device_train_batch_size, partial_window, trainer_row, loss_normalization, rtol, atol,
          dataparallel) -> tuple[RunSettings, torch.nn.Module, str | None]:
    """``(settings, float32 model copy, why the Trainer row is skipped or None)`` for one verification.

    The arguments are :func:`verify_accumulation`'s; the copy is taken with
    torch's random state restored (a preset seeds torch to initialise it).

    Raises:
        UsageError: a model verify cannot make token data for, or too few examples in ``dataset``.
    """
    token_data = dataset is None
    with torch.random.fork_rng(devices=[]):
        base, spec, bn_layers = model_copy(model, model_name_or_path, seed, model_preset, token_data)
    spec["parameters"] = sum(p.numel() for p in base.parameters())
    r = partial_micro_batches(K, partial_window)
    plan = run_plan_of(accelerator)
    engine = plan.engine
    parallel = mesh_plan(accelerator, engine)  # tp / cp ranks read their data-parallel rank's examples
    n = (K + r) * per_device_train_batch_size * parallel.data_parallel_size
    workload = (token_workload(n, seed, spec["vocab_size"], spec["max_length"], loss_fn) if token_data
                else user_workload(dataset, n, collate_fn, loss_fn or causal_lm_loss))
    trainer_skip = None
    if trainer_row and engine.owns_backward():
        trainer_row, trainer_skip = False, ("under DeepSpeed Trainer would build its own engine from the "
                                            "launch's config; run it under DDP")
    if trainer_row and (loss_fn is not None or not token_data):
        trainer_row, trainer_skip = False, ("it runs transformers' causal-LM Trainer on verify's own token data; "
                                            "a loss_fn or dataset was given")
    if trainer_row and parallel.model_parallel:
        trainer_row, trainer_skip = False, ("the tp / cp ranks of this mesh share their data-parallel rank's "
                                            "examples, and Trainer would build its own Accelerator and split the "
                                            "model its own way; run it without tp / cp")
    precision = engine.compute_precision(accelerator)
    rtol, atol, normwise = resolve_tolerances(precision, rtol, atol)
    settings = RunSettings(
        gradient_accumulation_steps=K, per_device_train_batch_size=per_device_train_batch_size,
        world_size=accelerator.num_processes, partial_micro_batches=r,
        seed=seed, model=spec, partial_window=partial_window, trainer_row=trainer_row,
        loss_normalization=loss_normalization,
        rtol=rtol, atol=atol, dataparallel=dataparallel, device=str(accelerator.device),
        distributed_type=str(accelerator.distributed_type).split(".")[-1], mixed_precision=precision,
        normwise=normwise, workload=workload,
        # an engine that casts the model (not Accelerate's autocast) computes in low precision too
        autocast=bool(getattr(accelerator, "native_amp", False)) or precision != accelerator.mixed_precision,
        batchnorm_layers=bn_layers, accumulation_policy=plan.policy.name, engine=engine.name,
        casts_model=engine.casts_model(), parallel=parallel)
    return settings, base, trainer_skip


def _main_process_report(accelerator, settings: RunSettings, captured: Captured, oracle_model) -> VerifyReport:
    """The main process computes the oracle and the report and broadcasts it; every process returns it.

    Raises:
        RuntimeError: on the other processes, when the main process failed (it re-raises its own error).
    """
    payload = None
    if accelerator.is_main_process:
        try:
            payload = ("ok", evaluate(settings, captured, oracle_model))
        except Exception as exc:  # tell the other processes (they wait in the broadcast), then re-raise
            broadcast_object_list([("error", f"{type(exc).__name__}: {exc}")])
            raise
    status, report = broadcast_object_list([payload])[0]
    if status != "ok":
        raise RuntimeError(f"the main process failed while computing the oracle: {report}")
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
    wl, mp = s.workload, s.parallel
    capture = GradientCapture(base.named_parameters(), keep=accelerator.is_main_process)
    pmodel, popt, ploader = accelerator.prepare(base, capture, wl.loader(B))
    engine = run_plan_of(accelerator).engine
    prepared = engine.prepared_engine(pmodel)
    if prepared is not None:  # an engine object's optimizer (ZeRO's) hands the capture flat partitions
        capture.attach_engine(prepared)
    runs = {}  # row name -> (captured grads per window (main) / None, norms per window, indices per window)
    passes = [("tokens", "tokens", EvalMode(pmodel)), ("mean-of-means", "mean", EvalMode(pmodel))]
    if s.batchnorm_layers and K * W > 1:  # (K = W = 1: each window is one forward, the big batch itself)
        # last: training mode moves the BatchNorm running statistics of this copy
        passes.append((BATCHNORM_ROW, "tokens", batchnorm.BatchNormTrainMode(pmodel)))
    try:
        if len(ploader) != K + r:
            raise RuntimeError(f"expected {K + r} micro-batches per process after sharding, got {len(ploader)}")
        for name, mode, modes in passes[:2]:
            runs[name] = _loop_pass(accelerator, pmodel, popt, ploader, capture, wl, mode, modes,
                                    mp.normalizer(accelerator, mode))
        if not engine.owns_backward():  # a plain loss.backward() goes through the engine's reduction
            runs["sum"] = _sum_pass(accelerator, pmodel, popt, ploader, capture, wl, mp.part)
        for name, ranks in mp.miscounts.items():  # tp / cp: the public miscounts, run for real (informational)
            runs[name] = _loop_pass(accelerator, pmodel, popt, ploader, capture, wl, "tokens", EvalMode(pmodel),
                                    mp.normalizer(accelerator, "tokens", ranks))
        for name, mode, modes in passes[2:]:
            runs[name] = _loop_pass(accelerator, pmodel, popt, ploader, capture, wl, mode, modes,
                                    mp.normalizer(accelerator, mode))
    finally:
        forget_prepared(accelerator, (pmodel, popt, ploader))

    for name, (_, norms, _) in runs.items():
        if len(norms) != s.windows:
            raise RuntimeError(f"{name}: {len(norms)} optimizer steps, expected {s.windows}")
    # Examples each data-parallel rank ran (its tp / cp peers ran the same), per row and window; every rank's norms.
    ran = one_per_data_parallel_rank(gather_object([{name: run[2] for name, run in runs.items()}]),
                                     mp.data_parallel_size)
    norms = accelerator.gather(torch.tensor([x for run in runs.values() for x in run[1]],
                                            dtype=torch.float64, device=accelerator.device)).cpu().view(W, -1)
    return Captured(grads={name: run[0] for name, run in runs.items()}, examples=ran, norms=norms, workload=wl)


def _sum_pass(accelerator, pmodel, popt, ploader, capture, wl: Workload, part) -> tuple:
    """The ``sum`` row (not where the engine owns the backward, :meth:`~accum_kit.engines.base.Engine.owns_backward`:
    DeepSpeed's must go through its engine); ``part`` cuts a micro-batch to this process's slice (cp)."""
    # reduction="sum": plain backward inside accumulate; only DDP stands between it and the big batch.
    rec, window = IndexRecorder(wl.loss_fn), 0
    pmodel.eval()
    for batch in ploader:
        with accelerator.accumulate(pmodel):
            rec.window = window
            summed, _ = rec(pmodel, part(batch))
            summed.backward()
            if accelerator.sync_gradients:
                popt.step()
                popt.zero_grad()
                window += 1
    return (*capture.take(), rec.windows)


def _loop_pass(accelerator, pmodel, popt, ploader, capture, wl: Workload, mode: str, modes, normalizer=None) -> tuple:
    """One epoch of train_loop over the windows; ``modes`` is the callback that sets the modules' modes;
    ``normalizer``: the loop's, None for the engine's own."""
    rec = IndexRecorder(wl.loss_fn)
    with warnings.catch_warnings():  # the BatchNorm pass is measured on purpose: the report says it
        warnings.simplefilter("ignore", BatchNormAccumulationWarning)
        train_loop(accelerator, pmodel, popt, ploader, num_train_epochs=1, loss_normalization=mode,
                   loss_fn=rec, callbacks=[rec, modes], progress=False, normalizer=normalizer)
    return (*capture.take(), rec.windows)
