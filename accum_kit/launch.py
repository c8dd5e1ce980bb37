"""Building the Accelerator so that multi-process CPU runs cannot silently train alone.

On a machine without CUDA, `accelerate launch` with a two-process config starts
two processes through torchrun, but a plain ``Accelerator()`` in each of them
sees ``DistributedType.NO`` and ``num_processes == 1``: two independent
trainings and no error (measured with accelerate 1.15, torch 2.13; docs/design.md). ``Accelerator(cpu=True)``
makes them join one gloo process group instead. :func:`build_accelerator` passes
``cpu=True`` whenever the launcher started several processes and no GPU is
present, then :func:`check_process_count` compares the launcher's ``WORLD_SIZE``
with what the Accelerator sees and fails loudly on a mismatch.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, get_int_from_env

from .errors import ProcessCountError
# The default-K rule lives in the torch-free settings module (``accum-kit plan`` uses it too);
# re-exported here for callers of ``accum_kit.launch.resolve_accumulation_steps``.
from .settings import DEFAULT_GRADIENT_ACCUMULATION_STEPS, resolve_accumulation_steps  # noqa: F401


def launcher_world_size() -> int:
    """Number of processes the launcher (torchrun, accelerate launch, mpirun) started; 1 if none.

    Reads the same variables as Accelerate's own state (``WORLD_SIZE`` and the MPI ones).
    """
    return get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1)


def _has_gpu() -> bool:
    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "is_available"):
        return bool(accel.is_available())
    return torch.cuda.is_available()


def check_process_count(accelerator: Accelerator, expected: int | None = None) -> None:
    """Fail loudly when the Accelerator does not see every launched process.

    Args:
        accelerator: a constructed Accelerator.
        expected: the number of processes that should train together; defaults
            to the launcher's ``WORLD_SIZE`` environment variable (1 if unset).

    Raises:
        ProcessCountError: ``accelerator.num_processes != expected``.
    """
    expected = launcher_world_size() if expected is None else expected
    if accelerator.num_processes != expected:
        raise ProcessCountError(
            f"the launcher started {expected} processes but the Accelerator sees "
            f"{accelerator.num_processes} (distributed_type={accelerator.distributed_type}): "
            "each process would train alone on its own data. On a machine without a GPU "
            "build the Accelerator with accum_kit.build_accelerator() or Accelerator(cpu=True), "
            "or set ACCELERATE_USE_CPU=true."
        )


def build_accelerator(
    gradient_accumulation_steps: int | None = None,
    *,
    sync_each_batch: bool = False,
    cpu: bool | None = None,
    **accelerator_kwargs,
) -> Accelerator:
    """Build an Accelerator for gradient accumulation that is safe on CPU-only machines.

    Args:
        gradient_accumulation_steps: micro-batches per optimizer step (K); None
            reads ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` or uses 4
            (see :func:`resolve_accumulation_steps`).
        sync_each_batch: all-reduce gradients on every micro-batch instead of
            only on the window's boundary (Accelerate's ``GradientAccumulationPlugin``
            option of the same name); for A/B comparisons only, it is slower.
        cpu: force CPU; None means "CPU when several processes were launched
            and no GPU exists", which is what makes gloo DDP work.
        **accelerator_kwargs: passed to ``accelerate.Accelerator`` (e.g.
            ``mixed_precision``, ``log_with``, ``kwargs_handlers``).

    Returns:
        The Accelerator, already checked with :func:`check_process_count`.

    Raises:
        UsageError: K below 1.
        ProcessCountError: launched and visible process counts differ.
    """
    steps = resolve_accumulation_steps(gradient_accumulation_steps)
    if cpu is None:
        cpu = launcher_world_size() > 1 and not _has_gpu()
    plugin = GradientAccumulationPlugin(num_steps=steps, sync_each_batch=sync_each_batch)
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_plugin=plugin, **accelerator_kwargs)
    check_process_count(accelerator)
    return accelerator
