"""The ``trainer`` row of ``accum-kit verify``: transformers' Trainer on the same windows, compared with the oracle.

:func:`capture_trainer` runs ``transformers.Trainer`` (``average_tokens_across_devices=True``,
unclipped: ``max_grad_norm=0``) on a copy of the model, over the same examples
and the same sharding as the other rows (sequential sampler, the same
micro-batch size, K, one epoch, so the partial window is the epoch's last
one). Its optimizer is a :class:`~accum_kit.verify.capture.GradientCapture`
passed as ``optimizers=(capture, None)``: it records what Trainer hands to
``optimizer.step()`` (after the boundary all-reduce) and never changes the
parameters, so every window is evaluated at the initial parameters like the
other rows. The examples each window really ran are recorded by a forward
pre-hook on the model.

:func:`trainer_summary` compares each window's captured gradient with the
big-batch token-mean gradient by direction (cosine) and size (norm ratio
``||g|| / ||o||`` and the least-squares factor ``<g, o> / <o, o>``), not by
clipping-sensitive elementwise tolerance alone, and explains a scale error it
recognises. The row is informational: ``passed`` and the exit code never
depend on it.

What Trainer does (transformers 5.x, ``Trainer._inner_training_loop`` and
``_get_num_items_in_batch``): it prefetches the window's micro-batches, counts
the labels that are not -100 (gathered over processes with
``average_tokens_across_devices``), passes that count to the model as
``num_items_in_batch`` and multiplies each micro-batch's loss by the number of
processes before DDP averages. The count is taken over ``labels[..., 1:]``
only when the model's ``loss_type`` maps to the causal-LM loss
(``Trainer._loss_shifts_labels``); otherwise every example's first label,
which the shifted loss never predicts, is counted too and the update comes out
``N / (N + examples)`` of the exact one (GPT-2's ``loss_type`` is None).
The epoch's last window is closed after its own micro-batches and divided by
its own count. Dropout is switched off in the copy (``p = 0``) because
Trainer puts the model in training mode.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import tempfile

import torch

from ..compat import keep_gradient_plugin
from .capture import ExampleRecorder, GradientCapture
from .compare import compare_gradients
from .data import IGNORE_INDEX, pad_collate

#: How close (relative) a measured factor must be to a predicted one to name the cause.
MATCH_RTOL = 1e-5


def _dropout_off(model) -> None:
    """Set every dropout probability of ``model`` to 0 (Trainer calls ``model.train()`` on every micro-batch)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in ("attention_dropout", "dropout"):  # attention modules that pass a float to SDPA
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)


@contextlib.contextmanager
def _random_state_kept():
    """Restore Python's and NumPy's global random state (Trainer seeds them) and torch's CPU one."""
    py = random.getstate()
    try:
        import numpy as np

        npst = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with transformers
        np, npst = None, None
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py)
    if np is not None:
        np.random.set_state(npst)


def capture_trainer(accelerator, base, examples: list[dict], K: int, B: int, seed: int) -> dict:
    """Every process: run ``transformers.Trainer`` over ``examples``; return what it handed to its optimizer.

    Args:
        accelerator: the caller's Accelerator (its gradient-accumulation settings,
            which Trainer's own Accelerator overwrites in Accelerate's shared
            state, are restored afterwards).
        base: the unprepared model (deep-copied here, not modified).
        examples: every process's examples (the same list on every process).
        K: gradient accumulation steps; B: examples per micro-batch per process.
        seed: ``TrainingArguments.seed``.

    Returns:
        ``grads`` (per window ``{name: float32 CPU gradient}`` on the main
        process, None elsewhere), ``norms`` (per window, this process),
        ``examples`` (per window, the examples this process ran),
        ``loss_shifts_labels`` (Trainer's own flag, None if absent), ``model_class``,
        ``loss_type`` and ``transformers`` (version).
    """
    import transformers
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    model = copy.deepcopy(base).float()
    _dropout_off(model)
    capture = GradientCapture(model.named_parameters(), keep=accelerator.is_main_process)
    rec = ExampleRecorder()

    def record(module, args, kwargs):  # the window is the number of optimizer steps captured so far
        rec.record(len(capture.norms), {k: kwargs[k] for k in ("input_ids", "attention_mask", "labels")})

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    with tempfile.TemporaryDirectory() as out, keep_gradient_plugin(accelerator), _random_state_kept():
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=B, gradient_accumulation_steps=K, num_train_epochs=1,
            learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=0.0, average_tokens_across_devices=True,
            train_sampling_strategy="sequential", remove_unused_columns=False, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            dataloader_pin_memory=False, seed=seed, ddp_find_unused_parameters=False,
            use_cpu=accelerator.device.type == "cpu")
        trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=pad_collate,
                          optimizers=(capture, None))
        trainer.remove_callback(PrinterCallback)
        try:
            trainer.train()
        finally:
            handle.remove()
            trainer.accelerator.free_memory()
    grads, norms = capture.take()
    return {"grads": grads, "norms": norms, "examples": rec.windows,
            "loss_shifts_labels": getattr(trainer, "_loss_shifts_labels", None),
            "model_class": type(base).__name__, "loss_type": getattr(base, "loss_type", None),
            "transformers": transformers.__version__}


def label_counts(examples: list[dict]) -> tuple[int, int]:
    """``(N, L)``: target tokens after the shift (``labels[1:] != -100``) and labels before it, over ``examples``."""
    n = sum(sum(1 for x in e["labels"][1:] if x != IGNORE_INDEX) for e in examples)
    all_labels = sum(sum(1 for x in e["labels"] if x != IGNORE_INDEX) for e in examples)
    return n, all_labels


def trainer_summary(run: dict, window_examples: list, oracle) -> tuple[list[dict], dict]:
    """Per-window comparisons and the row's conclusion.

    Args:
        run: :func:`capture_trainer`'s result on the main process.
        window_examples: per window, all processes' examples as Trainer ran them.
        oracle: ``examples -> ({name: float64 summed-loss gradient}, N)``.

    Returns:
        ``(comparisons, summary)``: one :func:`compare_gradients` dict per window
        with ``cosine``, ``norm_ratio``, ``factor`` (``<g, o> / <o, o>``),
        ``target_tokens`` (N), ``labels_counted_before_shift`` (N + examples)
        and ``predicted_if_unshifted`` (N / (N + examples)) added; the summary
        holds ``factor`` (over all windows), ``cosine`` (worst), ``cause`` (one line).
    """
    comps = []
    for w, ex in enumerate(window_examples):
        sum_grad, n_tok = oracle(ex)
        want = {k: v / max(n_tok, 1) for k, v in sum_grad.items()}
        c = compare_gradients(run["grads"][w], want, 1e-4, 1e-6)
        want_norm = math.sqrt(c["want_sq"])
        n, counted = label_counts(ex)
        c.update(cosine=c["dot"] / (c["got_norm"] * want_norm) if c["got_norm"] and want_norm else float("nan"),
                 norm_ratio=c["got_norm"] / want_norm if want_norm else float("nan"),
                 factor=c["dot"] / c["want_sq"] if c["want_sq"] else float("nan"),
                 target_tokens=n, labels_counted_before_shift=counted, predicted_if_unshifted=n / counted)
        comps.append(c)
    factor = sum(c["dot"] for c in comps) / sum(c["want_sq"] for c in comps)
    cosine = min(c["cosine"] for c in comps)
    exact = all(abs(c["factor"] - 1.0) <= MATCH_RTOL for c in comps)
    unshifted = all(abs(c["factor"] - c["predicted_if_unshifted"]) <= MATCH_RTOL * c["predicted_if_unshifted"]
                    for c in comps)
    model, lt = run["model_class"], run["loss_type"]
    if exact:
        cause = (f"exact: {model}'s loss_type is {lt!r}, so Trainer counts labels after the shift "
                 "(labels[..., 1:]) and divides each window by its true target count N")
    elif unshifted:
        cause = (f"{model}'s loss_type is {lt!r}, so Trainer's _loss_shifts_labels is "
                 f"{run['loss_shifts_labels']}: it counts every label before the shift, N + examples, "
                 "so the update is N / (N + examples) of the exact one")
    else:
        cause = "differs from the oracle for a reason this check does not recognise"
    ordered = sorted(comps, key=lambda c: c["factor"])
    return comps, {"factor": factor, "cosine": cosine, "exact": exact, "labels_counted_before_shift": unshifted,
                   "cause": cause, "smallest_window_factor": ordered[0]["factor"],
                   "largest_window_factor": ordered[-1]["factor"]}
