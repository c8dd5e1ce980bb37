"""``accum-kit verify``: is the accumulated gradient the gradient of one big batch?

Every process runs the same deterministic examples, sharded by the prepared
DataLoader, as one full accumulation window of K micro-batches and (by
default) a partial last window of ``ceil(K / 2)``
(:mod:`accum_kit.verify.data`). The gradient of each window is taken three
ways on the same parameters:

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

``trainer`` (informational)
    transformers' ``Trainer`` with ``average_tokens_across_devices=True`` and
    no clipping, on a copy of the model and the same windows
    (:mod:`accum_kit.verify.trainer`): the size (norm ratio, least-squares
    factor) and direction (cosine) of its update against the oracle, with the
    cause of a scale error it recognises (Trainer counts labels before the
    shift for models whose ``loss_type`` is None, e.g. GPT-2). It never
    changes ``passed`` or the exit code; ``--no_trainer_row`` skips it.

``batchnorm (train mode)`` (informational, only for models with BatchNorm layers)
    the ``tokens`` pass again with the BatchNorm layers normalising with
    batch statistics, against a big batch normalised with its own
    (:mod:`accum_kit.verify.batchnorm`): the deviation BatchNorm itself causes,
    reported as a finding with the fixes, never as a failure.

Any model, loss and data (:mod:`accum_kit.verify.workload`): by default the
rows run verify's own random token sequences through a causal LM; from Python,
``verify_accumulation(model=..., loss_fn=..., dataset=..., collate_fn=...)``
runs your own (a classifier with :func:`accum_kit.classification_loss`, an
encoder-decoder with :func:`accum_kit.seq2seq_loss`, ...) with the same rows
and the same verdict; the oracle then applies your ``loss_fn`` to each window
as one batch.

What the optimizer sees is captured at ``optimizer.step()``
(:mod:`accum_kit.verify.capture`) and compared, window by window, with a
float64 single-process big batch (:mod:`accum_kit.verify.oracle`) under a
float32 tolerance (:mod:`accum_kit.verify.compare`); :mod:`accum_kit.verify.check`
runs it all (settings in :mod:`accum_kit.verify.settings`, the main process's
comparisons in :mod:`accum_kit.verify.rows`), :mod:`accum_kit.verify.report`
holds the result.

Sources: transformers blog "Fixing Gradient Accumulation" (October 2024,
https://huggingface.co/blog/gradient_accumulation); PyTorch DDP notes
(https://pytorch.org/docs/stable/notes/ddp.html) and
``DistributedDataParallel`` docs on gradient averaging; Accelerate's
"Gradient accumulation" guide (``accelerator.backward`` divides by K,
https://huggingface.co/docs/accelerate/usage_guides/gradient_accumulation).

Memory: the main process keeps a float64 copy of the model and float32 CPU
copies of every captured gradient (4 rows x 2 windows); fine for the small
models this check is meant for.

Under DeepSpeed ZeRO (``accelerate launch --config_file accelerate_configs/cpu_deepspeed.yaml
--zero_stage N -m accum_kit verify``) the rows run through the engine: the ZeRO
optimizer hands the capture its flat gradient partitions, from which the whole
averaged gradient is rebuilt (:meth:`GradientCapture.attach_engine`); the
``sum`` row is skipped (every backward goes through the engine, which divides
by K and averages), and so is the Trainer row. With ``--mixed_precision bf16``
DeepSpeed trains the model in bf16 (float32 master weights), and the bf16
normwise tolerance applies.

Under an FSDP2 mesh with tensor or context parallel (accelerate_configs/cpu_tp.yaml, cpu_cp.yaml) only the
data-parallel ranks read different examples; the oracle takes each example once, and an informational row
per mesh runs the ``tokens`` pass with a public miscount of the window's tokens (over every process under tp,
the local cp slice under cp) against the same oracle (:mod:`accum_kit.verify.mesh`).

Command line: ``accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m accum_kit verify``
(any number of processes), or ``python -m accum_kit verify`` on one. Exit 0
when the row selected by ``--loss_normalization`` passes, 1 when it does not,
2 on bad input. From Python: :func:`verify_accumulation`.
"""

from .batchnorm import BatchNormTrainMode, big_batch_statistics
from .capture import EvalMode, ExampleRecorder, GradientCapture
from .check import verify_accumulation
from .settings import DEFAULT_BATCH_SIZE
from .command import ARGUMENTS, DESCRIPTION, VerifyArguments, run_command
from .compare import DEFAULT_ATOL, DEFAULT_RTOL, compare_gradients, scaled_residual
from .data import make_examples, pad_collate, partial_micro_batches
from .oracle import big_batch_gradient, dataparallel_sum_gradient, summed_token_loss, to_oracle
from .report import SELECTABLE, Row, VerifyReport, WindowInfo
from .trainer import capture_trainer, trainer_summary
from .workload import IndexRecorder, Workload, token_workload, user_workload

__all__ = [
    "ARGUMENTS",
    "DEFAULT_ATOL",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_RTOL",
    "DESCRIPTION",
    "SELECTABLE",
    "BatchNormTrainMode",
    "EvalMode",
    "ExampleRecorder",
    "GradientCapture",
    "IndexRecorder",
    "Row",
    "VerifyArguments",
    "VerifyReport",
    "WindowInfo",
    "Workload",
    "big_batch_gradient",
    "big_batch_statistics",
    "capture_trainer",
    "compare_gradients",
    "dataparallel_sum_gradient",
    "make_examples",
    "pad_collate",
    "partial_micro_batches",
    "run_command",
    "scaled_residual",
    "summed_token_loss",
    "to_oracle",
    "token_workload",
    "trainer_summary",
    "user_workload",
    "verify_accumulation",
]
