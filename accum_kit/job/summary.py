"""train_summary.json: the fields every run of the train job writes (the engine adds its own blocks)."""

from __future__ import annotations

from ..core.accumulation_schedule import schedule_pairs
from ..outputs import library_versions
from .config import TrainConfig


def model_name(cfg: TrainConfig) -> str:
    """Where the model came from: its path, ``config:<path>``, ``type:<model_type>`` or ``preset:<name>``."""
    if cfg.model_name_or_path:
        return cfg.model_name_or_path
    return f"config:{cfg.config_name}" if cfg.config_name else (
        f"type:{cfg.model_type}" if cfg.model_type else f"preset:{cfg.model_preset}")


def build_summary(cfg: TrainConfig, accelerator, result, *, k, schedule, checkpointer, resume, evals, data,
             n_params) -> dict:
    """train_summary.json's fields that every run has (``comm``, ``compile`` and ``memory`` are added after).

    ``evals``: (eval loss before, after, perplexity before, after), nats; ``data``: (train dataset, eval
    dataset, its source); ``n_params``: parameters of the model.
    """
    eval_before, eval_after, ppl_before, ppl_after = evals
    train_ds, eval_ds, source = data
    dp = accelerator.run_plan.engine.data_parallel_size(accelerator)  # processes reading different examples
    effective_batch = cfg.per_device_train_batch_size * k * dp
    return {
        "world_size": accelerator.num_processes,
        "data_parallel_size": dp,
        "distributed_type": str(accelerator.distributed_type),
        "gradient_accumulation_steps": k,
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "effective_batch_size": effective_batch,
        "accumulation_schedule": schedule_pairs(schedule),
        "lr_scaling": cfg.lr_scaling,
        "gradient_accumulation_steps_per_step": result.step_accumulation_steps,
        "effective_batch_size_per_step": [cfg.per_device_train_batch_size * s * dp
                                          for s in result.step_accumulation_steps],
        "optimizer_steps": result.optimizer_steps,
        "resumed_from_step": result.resumed_from_step,
        "resumed_from": str(resume) if resume is not None else None,
        "checkpoints": [p.name for p in checkpointer.saved],
        "checkpoint_saves": checkpointer.timings,
        "micro_batches_per_process": result.micro_batches,
        "epochs": result.epochs,
        "train_loss": result.train_loss,
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "eval_perplexity_before": ppl_before,
        "eval_perplexity_after": ppl_after,
        "tokens_per_second": result.tokens_per_second,
        "seconds_per_optimizer_step": result.median_step_seconds,
        "step_seconds": result.step_seconds,
        "train_seconds": sum(result.step_seconds),
        "dataset": source,
        "train_examples": len(train_ds),
        "eval_examples": len(eval_ds),
        "block_size": cfg.block_size,
        "packing": cfg.packing,
        "model": model_name(cfg),
        "model_parameters": n_params,
        "loss_normalization": cfg.loss_normalization,
        "mixed_precision": accelerator.mixed_precision,
        "tracking": cfg.report_to if cfg.with_tracking else None,
        "sync_each_batch": cfg.accumulation_policy == "sync_each_batch",
        "accumulation_policy": accelerator.run_plan.requested_policy.name,  # under DeepSpeed the stage: zero1/2/3
        "gradient_checkpointing": accelerator.run_plan.gradient_checkpointing,  # the flag, or an FSDP config's
        "gradient_checkpointing_kwargs": accelerator.run_plan.gradient_checkpointing_kwargs,  # in force ({} if off)
        **accelerator.run_plan.engine.summary_blocks(accelerator),  # "fsdp", "deepspeed": None unless that engine
        "learning_rate": cfg.learning_rate,
        "seed": cfg.seed,
        "versions": library_versions(),
    }
