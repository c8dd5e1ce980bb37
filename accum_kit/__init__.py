"""accum-kit: fast and exact gradient accumulation on Hugging Face Accelerate.

Public entry points:

- :func:`build_accelerator` / :func:`check_process_count`: an Accelerator that
  cannot silently train each process alone on CPU-only machines.
- :func:`train_loop`: the accumulation loop (no_sync on non-boundary
  micro-batches, exact token-count normalisation); :class:`LoopCallback` for hooks.
- :class:`WindowNormalizer`, :func:`causal_lm_loss`: the normalisation on its own; :class:`CausalLMLoss`
  (the causal-LM loss from the last hidden states in chunks, no full-vocabulary logits) and
  :func:`logits_causal_lm_loss` (the same from the logits);
  :func:`classification_loss`, :func:`seq2seq_loss`: ``loss_fn`` for classifiers and encoder-decoders.
- :func:`optimizer_steps_per_epoch`: the ``ceil(M / K)`` step count of an epoch.

The names are imported lazily, on first use (PEP 562 module ``__getattr__``,
https://peps.python.org/pep-0562/): ``import accum_kit`` alone loads neither
torch nor accelerate, so torch-free commands such as ``accum-kit plan`` start
quickly, while ``from accum_kit import train_loop`` works as usual.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: Public name -> the submodule that defines it.
_EXPORTS = {
    "AccumKitError": "errors",
    "CausalLMLoss": "core.loss",
    "LoopCallback": "core.callbacks",
    "LoopResult": "core.loop",
    "LoopState": "core.callbacks",
    "ProcessCountError": "errors",
    "UsageError": "errors",
    "WindowNormalizer": "core.loss",
    "build_accelerator": "launch",
    "causal_lm_loss": "core.loss",
    "classification_loss": "core.task_losses",
    "logits_causal_lm_loss": "core.loss",
    "check_process_count": "launch",
    "optimizer_steps_per_epoch": "core.accumulation_schedule",
    "seq2seq_loss": "core.task_losses",
    "train_loop": "core.loop",
}

__all__ = sorted(_EXPORTS)

#: Modules that moved when the package was laid out by role (old name -> new name, under ``accum_kit.``).
#: ``import accum_kit.data`` and ``from accum_kit.zero import ...`` keep working: :class:`_MovedModules`
#: answers the old name with the module itself (one object under both names, so patching either patches both).
MOVED_MODULES = {
    "batchnorm": "core.batchnorm",
    "callbacks": "core.callbacks",
    "checkpoint": "core.checkpoint",
    "checkpoint_engine": "engines.checkpoint_tag",
    "checkpoint_files": "core.checkpoint_files",
    "clm_flags": "job.clm_flags",
    "compiling": "engines.compiling",
    "config": "job.config",
    "data": "job.data",
    "data_cursor": "core.data_cursor",
    "ddp_options": "engines.ddp",
    "evaluation": "job.evaluation",
    "faults": "core.faults",
    "hsdp": "engines.mesh",
    "loop": "core.loop",
    "loop_history": "core.loop_history",
    "loss": "core.loss",
    "manual_allreduce": "reference.manual_allreduce",
    "memory": "profiler.held_memory",
    "models": "job.models",
    "policies": "engines.policies",
    "raw_ddp": "reference.raw_ddp",
    "schedule": "core.window_schedule",
    "settings": "core.settings",
    "sharding": "engines.fsdp2",
    "tracking": "job.tracking",
    "train": "job.train",
    "zero": "engines.deepspeed",
    "planning.fsdp": "engines.costs",
    "planning.schedule": "core.accumulation_schedule",
    "planning.lr": "core.lr_scaling",
    "planning.report": "planning.plan_report",
    "planning.command": "planning.plan_command",
    "planning.ddp_costs": "engines.costs",
    "profiler.zero": "profiler.deepspeed_comm",
    "bench.config": "bench.bench_config",
    "bench.data": "bench.bench_data",
    "bench.memory": "bench.peak_memory",
    "bench.records": "bench.run_records",
    "bench.report": "bench.report_ddp",
    "bench.tune_report": "bench.report_tune",
    "bench.fsdp_report": "bench.report_fsdp2",
    "bench.zero_report": "bench.report_zero",
    "bench.tables": "bench.bench_tables",
    "bench.files": "bench.bench_files",
    "bench.fsdp_files": "bench.bench_files",
    "bench.zero_files": "bench.bench_files",
    "bench.driver": "bench.sweep",
    "bench.fsdp": "bench.part_fsdp2",
    "bench.zero": "bench.part_zero",
    "bench.tune": "bench.part_tune",
    "bench.compiled": "bench.part_compiled",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook (PEP 451 finder and loader) that resolves a moved module's old name to its new module."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED_MODULES.get(fullname.partition(".")[2]) if fullname.startswith(__name__ + ".") else None
        return importlib.util.spec_from_loader(fullname, self) if new is not None else None

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MOVED_MODULES[spec.name.partition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system overwrites it with the old name's spec next
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on demand
    from .core.callbacks import LoopCallback, LoopState
    from .errors import AccumKitError, ProcessCountError, UsageError
    from .launch import build_accelerator, check_process_count
    from .core.loop import LoopResult, train_loop
    from .core.loss import CausalLMLoss, WindowNormalizer, causal_lm_loss, logits_causal_lm_loss
    from .core.task_losses import classification_loss, seq2seq_loss
    from .core.accumulation_schedule import optimizer_steps_per_epoch


def __getattr__(name: str):
    """Import a public name from its submodule on first access and cache it here.

    Raises:
        AttributeError: ``name`` is not public (this also lets ``from accum_kit
            import <submodule>`` fall back to importing the submodule).
    """
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
