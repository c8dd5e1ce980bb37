"""What makes ``accum-kit train`` a drop-in for transformers' ``run_clm_no_trainer.py``: checks and defaults.

The flags themselves are fields of :class:`accum_kit.job.config.TrainConfig`;
:func:`resolve_run_clm_flags` gives them run_clm_no_trainer's meaning:

- ``--num_train_epochs N`` alone trains N epochs; ``--max_train_steps``
  overrides it; with neither, the demo's :data:`DEMO_MAX_TRAIN_STEPS` steps;
- ``--max_eval_samples`` unset evaluates all of ``--validation_file``, or the
  first 256 examples of a held-out split;
- the Hub flags are refused: this job never uploads.
"""

from __future__ import annotations

from .. import checks
from ..errors import UsageError

#: Optimizer steps when neither --max_train_steps nor --num_train_epochs is given (the README demo).
DEMO_MAX_TRAIN_STEPS = 100
#: Evaluation examples of a held-out split when --max_eval_samples is not given.
DEFAULT_MAX_EVAL_SAMPLES = 256
HUB_FLAGS = ("push_to_hub", "hub_model_id", "hub_token")
HUB_FIX = ("drop it; this job writes the model and tokenizer to --output_dir only. Upload that folder "
           "afterwards, e.g. `hf upload <repo_id> <output_dir>` or huggingface_hub.upload_folder")


def resolve_run_clm_flags(cfg) -> None:
    """Refuse the Hub flags, check the new flags, and settle the step and evaluation counts of ``cfg`` in place.

    Args:
        cfg: a :class:`accum_kit.job.config.TrainConfig` (called from its ``__post_init__``).

    Raises:
        UsageError: a Hub flag given; ``--preprocessing_num_workers`` below 1;
            ``--model_type`` not a causal-LM type of transformers.
    """
    for name in HUB_FLAGS:
        value = getattr(cfg, name)
        if value not in (None, False):
            raise UsageError(f"--{name}", "the Hugging Face Hub is not supported by this job (nothing is uploaded)",
                             HUB_FIX)
    if cfg.preprocessing_num_workers is not None:
        checks.at_least("--preprocessing_num_workers", cfg.preprocessing_num_workers,
                        fix="pass a positive number of processes, or omit it to tokenise in this process")
    if cfg.model_type is not None:
        from .models import check_model_type

        check_model_type(cfg.model_type)
    if cfg.max_train_steps is None and cfg.num_train_epochs is None:
        cfg.max_train_steps = DEMO_MAX_TRAIN_STEPS
    elif cfg.max_train_steps is not None and cfg.max_train_steps <= 0:
        cfg.max_train_steps = None  # 0 or less: train --num_train_epochs epochs
    if cfg.num_train_epochs is None:
        cfg.num_train_epochs = 1
    if cfg.max_eval_samples is None:
        cfg.max_eval_samples = 0 if cfg.validation_file else DEFAULT_MAX_EVAL_SAMPLES  # 0: all (normalised after)
