"""What one ``verify`` run is set to, and what its rows captured (shared by :mod:`.check` and :mod:`.rows`).

Also the range checks of its settings (command line and Python alike) and the
copy of the model it verifies.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .. import checks
from ..errors import UsageError
from ..job.models import LLAMA_PRESETS, MOE_PRESETS, PRESETS, build_llama_model, build_model, build_moe_model, load_model
from . import batchnorm
from .compare import DEFAULT_ATOL, DEFAULT_RTOL, MIXED_PRECISIONS
from .data import MAX_LENGTH
from .report import SELECTABLE
from .workload import Workload

DEFAULT_BATCH_SIZE = 2  # examples per micro-batch per process
TINY_VOCAB = 128  # vocabulary of the preset models
#: ``--model_preset`` choices: the GPT-2 style ``tiny`` and the Llama-family ``llama_tiny``.
MODEL_PRESETS = ("tiny", *LLAMA_PRESETS, *MOE_PRESETS)

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
    accumulation_policy: str = "no_sync"  # the Accelerator's (accum_kit.engines.policies)
    workload: Workload | None = None  # the examples, collate, loss and oracle loss
    batchnorm_layers: tuple = ()  # BatchNorm layers of the given model (the finding runs if any)
    engine: str = "ddp"  # the run's engine (accum_kit.engines.base.Engine.name)
    casts_model: bool = False  # the engine casts the model's weights itself (Engine.casts_model: DeepSpeed)
    parallel: object = None  # verify.mesh.MeshPlan: data-parallel / token ranks, the miscount rows' token ranks

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


def model_copy(model, model_name_or_path, seed, model_preset="tiny", token_data=True):
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
    elif model_preset in MOE_PRESETS:
        m = build_moe_model(model_preset, TINY_VOCAB, MAX_LENGTH, seed=seed)
        p = MOE_PRESETS[model_preset]
        desc = (f"preset {model_preset} (MixtralForCausalLM, {p['num_hidden_layers']} layers, {p['num_local_experts']} "
                f"experts, top-{p['num_experts_per_tok']}, vocab {TINY_VOCAB}, random init seed {seed})")
    else:
        m = build_model("tiny", TINY_VOCAB, MAX_LENGTH, seed=seed)
        p = PRESETS["tiny"]
        desc = (f"preset tiny (GPT-2 style, {p['n_layer']} layers, width {p['n_embd']}, vocab {TINY_VOCAB}, "
                f"random init seed {seed})")
    layers = tuple(batchnorm.batchnorm_layers(m))  # any mode: train_loop calls model.train()
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
