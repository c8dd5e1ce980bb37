"""The main job: train a causal LM with exact, no_sync gradient accumulation.

Run it with ``accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/train.py``
or ``accelerate launch ... -m accum_kit train``; both take the flags of
:class:`accum_kit.job.config.TrainConfig`. Data flows one way: config ->
accelerator -> data + model -> :func:`accum_kit.train_loop` -> summary files.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from accelerate.logging import get_logger
from torch.utils.data import DataLoader

from ..core import auto_batch
from ..core.callbacks import LoopCallback
from ..core.checkpoint import (PREEMPTED_EXIT_CODE, Checkpointer, Preempted, check_resumable, check_writable, engine_name,
                              latest_checkpoint, read_loop_state, resolve_checkpoint)
from ..core.checkpoint_files import check_state_files
from ..engines.compiling import CompileWatch, compile_settings
from .adapters import adapter_record, apply_lora, check_adapter_resume
from .config import TrainConfig
from .data import build_collator, build_tokenizer, load_raw_datasets, tokenize_datasets
from ..engines.ddp import ddp_kwargs
from ..errors import UsageError
from .evaluation import evaluate_loss
from ..launch import build_accelerator
from ..core.loop import train_loop
from ..core.loss import CausalLMLoss, check_supported
from .models import build_from_config, build_model, count_parameters, fit_embeddings, load_model, resolve_config
from ..core.accumulation_schedule import optimizer_steps_per_epoch
from ..core.accumulation_schedule import schedule_pairs, scheduled_steps
from ..outputs import atomic_write_json, check_output_dir, staged_output_dir
from ..profiler import ABSwitch, CommProfiler, OverheadSwitch, format_table
from ..profiler.held_memory import HeldMemory
from ..profiler.held_memory import predicted_memory, predicted_peak
from . import moe
from .summary import build_summary, model_name
from .tracking import TrackerLogger, check_trackers, quiet_other_processes

logger = get_logger("accum_kit.job.train")  # logs on the main process only

ARGUMENTS = TrainConfig
DESCRIPTION = "Train a causal LM with exact, no_sync gradient accumulation."


class LogEvery(LoopCallback):
    """Callback: logs loss, learning rate and tokens/s every ``every`` optimizer steps (main process).

    The windows' figures stay on the device in between (:mod:`accum_kit.core.window_figures`): a logging step
    reads every window since the last one in one copy.
    """

    def __init__(self, accelerator, lr_scheduler, every: int):
        self.accelerator, self.lr_scheduler, self.every = accelerator, lr_scheduler, every
        self._t, self._figures = time.perf_counter(), []

    def on_step_end(self, state):
        self._figures.append(state.figures)
        if state.step % self.every:
            return
        if self.accelerator.is_main_process:
            now = time.perf_counter()
            tokens = sum(f.tokens for f in self._figures)  # the first read takes them all
            logger.info(
                "step %d: loss %.4f, lr %.3g, %.0f tokens/s",
                state.step, state.loss, self.lr_scheduler.get_last_lr()[0], tokens / (now - self._t),
            )
            self._t = now
        self._figures = []


def _datasets(cfg: TrainConfig, tokenizer, accelerator, k: int):
    """Tokenised train/validation splits, checked against one global batch."""
    with accelerator.main_process_first():
        raw, source = load_raw_datasets(
            cfg.dataset_name, cfg.dataset_config_name, cfg.train_file, cfg.validation_split_percentage,
            validation_file=cfg.validation_file, keep_linebreaks=not cfg.no_keep_linebreaks,
        )
        lm = tokenize_datasets(raw, tokenizer, cfg.block_size, cfg.packing,
                               num_proc=cfg.preprocessing_num_workers, overwrite_cache=cfg.overwrite_cache)
    train, valid = lm["train"], lm["validation"]
    if cfg.max_train_samples is not None:
        train = train.select(range(min(cfg.max_train_samples, len(train))))
    if cfg.max_eval_samples is not None:
        valid = valid.select(range(min(cfg.max_eval_samples, len(valid))))
    data_flag = "--train_file" if cfg.train_file else "--dataset_name"
    if len(train) == 0:
        raise UsageError(data_flag, f"no training example after tokenisation (block_size {cfg.block_size})",
                         "add text, or lower --block_size")
    if len(valid) == 0 and cfg.validation_file:
        raise UsageError("--validation_file", f"no validation example after tokenisation (block_size {cfg.block_size})",
                         "add text, or lower --block_size")
    dp = accelerator.run_plan.engine.data_parallel_size(accelerator)  # tp / cp ranks share their examples
    global_batch = cfg.per_device_train_batch_size * k * dp
    if len(train) < global_batch:
        raise UsageError(
            "--per_device_train_batch_size",
            f"{len(train)} training examples are fewer than one global batch of {global_batch} "
            f"(per_device_train_batch_size {cfg.per_device_train_batch_size} x gradient_accumulation_steps {k} "
            f"x {dp} data-parallel processes)",
            "lower --per_device_train_batch_size or --gradient_accumulation_steps, or add data",
        )
    return train, valid, source


def _build_model(cfg: TrainConfig, tokenizer):
    """run_clm_no_trainer's model: --model_name_or_path (with --config_name's config if given), else from
    --config_name or --model_type's config, else a --model_preset. Embeddings grow to the tokenizer's size."""
    config = resolve_config(cfg.config_name, cfg.model_name_or_path, cfg.model_type, cfg.trust_remote_code)
    if cfg.model_name_or_path:
        model = load_model(cfg.model_name_or_path, config=config, trust_remote_code=cfg.trust_remote_code,
                           low_cpu_mem_usage=cfg.low_cpu_mem_usage)
    elif config is not None:
        model = build_from_config(config, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
    else:
        return build_model(cfg.model_preset, len(tokenizer), cfg.block_size, seed=cfg.seed,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if cfg.model_type and (cfg.model_name_or_path or cfg.config_name):
        logger.warning("--model_type %s is not used: the config comes from %s", cfg.model_type,
                       "--config_name" if cfg.config_name else "--model_name_or_path")
    positions = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if positions and cfg.block_size > positions:
        raise UsageError("--block_size", f"{cfg.block_size} exceeds the model's {positions} positions",
                         f"pass --block_size {positions} or less")
    if fit_embeddings(model, len(tokenizer)):
        logger.warning("resized the token embeddings to the tokenizer's %d tokens (new rows are random)", len(tokenizer))
    return model


def _build_trained_model(cfg: TrainConfig, tokenizer):
    """:func:`_build_model`, wrapped in LoRA adapters with ``--use_peft`` (every weight frozen but the adapters')."""
    model = _build_model(cfg, tokenizer)
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora, source=model_name(cfg))
    return model


def _optimizer(model, cfg: TrainConfig):
    # No weight decay on biases and LayerNorm weights, as in run_clm_no_trainer; frozen weights (--use_peft) are
    # left out, as Trainer does, so the optimizer holds no state for them.
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate)


def _accelerator(cfg: TrainConfig):
    """The run's Accelerator (K, schedule, policy and engine resolved once, on ``accelerator.run_plan``), and every
    check that needs it, before any data or model work.

    Raises:
        UsageError: a tracker, engine, schedule, profiling or saving setting the launch cannot run.
    """
    if cfg.with_tracking:
        check_trackers(cfg.report_to, cfg.output_dir)
    tracking = dict(log_with=cfg.report_to, project_dir=cfg.output_dir) if cfg.with_tracking else {}
    accelerator = build_accelerator(cfg.gradient_accumulation_steps, accumulation_schedule=cfg.accumulation_schedule,
                                    accumulation_policy=cfg.accumulation_policy, ddp_timeout=cfg.ddp_timeout,
                                    ddp_kwargs=ddp_kwargs(cfg), torch_compile=cfg.torch_compile,
                                    torch_compile_backend=cfg.torch_compile_backend,
                                    torch_compile_mode=cfg.torch_compile_mode,
                                    # unpacked examples vary in length: symbolic shapes from the first call
                                    torch_compile_dynamic=None if cfg.packing else True,
                                    max_grad_norm=cfg.max_grad_norm, gradient_checkpointing=cfg.gradient_checkpointing,
                                    gradient_checkpointing_kwargs=cfg.gradient_checkpointing_kwargs, **tracking)
    quiet_other_processes(accelerator)
    check_supported(accelerator, cfg.loss_normalization)  # before any data or model work
    accelerator.run_plan.engine.check_job(profile_ab_steps=cfg.profile_ab_steps,
                                          auto_find_batch_size=cfg.auto_find_batch_size)
    return accelerator


def _save_outputs(cfg: TrainConfig, accelerator, model, tokenizer, summary: dict) -> None:
    """Model, tokenizer, train_summary.json and all_results.json into ``output_dir``, atomically (collective)."""
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # collective under FSDP: the full, unsharded parameters
    if accelerator.is_main_process:
        with staged_output_dir(cfg.output_dir) as staging:
            accelerator.unwrap_model(model).save_pretrained(staging, state_dict=state_dict)
            tokenizer.save_pretrained(staging)
            atomic_write_json(staging / "train_summary.json", summary)
            # run_clm_no_trainer's results file (its test reads "perplexity" from it)
            atomic_write_json(staging / "all_results.json", {
                "perplexity": summary["eval_perplexity_after"], "eval_loss": summary["eval_loss_after"],
                "epoch": summary["epochs"], "eval_samples": summary["eval_examples"]})
        logger.info("saved model, train_summary.json and all_results.json to %s", cfg.output_dir)


@dataclass
class _Prepared:
    """What :func:`_prepare` builds: the prepared objects, the run's length and what the summary reports of them."""

    tokenizer: object
    model: object
    optimizer: object
    train_dl: object
    eval_dl: object
    lr_scheduler: object
    steps: int  # optimizer steps of the run
    data: tuple  # (train dataset, eval dataset, its source)
    n_params: int  # every parameter of the model (elements)
    n_trainable: int  # those the optimizer updates (all, unless --use_peft)


def _prepare(cfg: TrainConfig, accelerator) -> _Prepared:
    """Tokenizer, data, model, optimizer and LR scheduler, through ``accelerator.prepare`` (Accelerate's order)."""
    from transformers import get_scheduler

    plan = accelerator.run_plan
    k = plan.first_accumulation_steps
    tokenizer = build_tokenizer(cfg.tokenizer_name or cfg.model_name_or_path, use_slow_tokenizer=cfg.use_slow_tokenizer,
                                trust_remote_code=cfg.trust_remote_code,
                                flag="--tokenizer_name" if cfg.tokenizer_name else "--model_name_or_path")
    train_ds, eval_ds, source = _datasets(cfg, tokenizer, accelerator, k)
    model = _build_trained_model(cfg, tokenizer)
    if not cfg.packing and tokenizer.pad_token is None:
        raise UsageError("--packing", "unpacked examples need padding but the tokenizer has no pad token",
                         "use packed blocks (the default) or save a tokenizer with a pad token")
    collate = build_collator(tokenizer, cfg.packing)
    train_dl = DataLoader(train_ds, shuffle=True, collate_fn=collate, batch_size=cfg.per_device_train_batch_size)
    eval_dl = DataLoader(eval_ds, collate_fn=collate, batch_size=cfg.per_device_eval_batch_size)
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, _optimizer(model, cfg), train_dl, eval_dl)
    steps = cfg.max_train_steps or scheduled_steps(len(train_dl), plan.schedule or {0: k}, cfg.num_train_epochs)
    # A prepared scheduler steps once per process per optimizer step (Accelerate's convention, every engine)
    lr_scheduler = accelerator.prepare(get_scheduler(
        cfg.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=cfg.num_warmup_steps * accelerator.num_processes,
        num_training_steps=steps * accelerator.num_processes))
    n_params, n_trainable = count_parameters(model, trainable_only=False), count_parameters(model)
    if n_trainable != n_params:
        logger.info("training %d of the model's %d parameters (%.3f %%); the others are frozen", n_trainable,
                    n_params, 100 * n_trainable / n_params)
    logger.info("%d processes (%s), K=%s, effective batch %d examples, %d optimizer steps, %.2fM parameters, data %s",
                accelerator.num_processes, plan.engine.label, k if plan.schedule is None else
                f"{k} at first (schedule {schedule_pairs(plan.schedule)}, lr_scaling {cfg.lr_scaling})",
                cfg.per_device_train_batch_size * k * plan.engine.data_parallel_size(accelerator), steps,
                n_params / 1e6, source)
    return _Prepared(tokenizer, model, optimizer, train_dl, eval_dl, lr_scheduler, steps, (train_ds, eval_ds, source),
                     n_params, n_trainable)


def _callbacks(cfg: TrainConfig, accelerator, run: _Prepared, auto=None, lm_loss=None):
    """The job's loop callbacks: logging, held memory (with its prediction), the profiler's switches, tracking, the
    compile watch, ``auto``'s phase watch. Returns ``(callbacks, profiler, switches, held, watch)`` (None: off)."""
    plan, k = accelerator.run_plan, accelerator.run_plan.first_accumulation_steps
    profiler, switches = _profiling(cfg, accelerator, run.model, run.steps)
    # what the windows hold between micro-batches, with the prediction beside it (train_summary.json["memory"])
    k_max = max(plan.schedule.values()) if plan.schedule else k  # a schedule's largest window holds the most
    held = HeldMemory(accelerator, run.model, lambda: predicted_memory(accelerator, run.model, k_max),
                      lambda: predicted_peak(accelerator, run.model, k_max, cfg.per_device_train_batch_size,
                                             cfg.block_size, plan.gradient_checkpointing, loss=lm_loss))
    callbacks = [LogEvery(accelerator, run.lr_scheduler, cfg.logging_steps), held, *switches, *auto_batch.watch(auto)]
    if cfg.with_tracking:  # hyperparameters as the tracker's config; figures per step via TrackerLogger
        accelerator.init_trackers("accum_kit", config={
            "gradient_accumulation_steps": k, "world_size": accelerator.num_processes,
            "per_device_train_batch_size": cfg.per_device_train_batch_size,
            "effective_batch_size": cfg.per_device_train_batch_size * k * plan.engine.data_parallel_size(accelerator),
            "loss_normalization": cfg.loss_normalization, "lr_scaling": cfg.lr_scaling,
            "accumulation_schedule": str(schedule_pairs(plan.schedule)) if plan.schedule else "none",
            "tracking": cfg.report_to if cfg.with_tracking else None, "learning_rate": cfg.learning_rate,
            "mixed_precision": accelerator.mixed_precision, "model": model_name(cfg),
            "block_size": cfg.block_size, "seed": cfg.seed})
        # every step's figures, K and the effective batch, read every --logging_steps steps; before LogEvery, so
        # that one copy reads the losses, tokens and gradient norms that both show
        callbacks.insert(0, TrackerLogger(accelerator, run.optimizer, profiler, logging_steps=cfg.logging_steps))
    watch = CompileWatch(warmup_steps=1) if compile_settings(accelerator) else None  # before the first compiled call
    if watch is not None:
        callbacks.append(watch)
    return callbacks, profiler, switches, held, watch


def _evaluate(accelerator, run: _Prepared, when: str, step: int, loss_fn=None) -> tuple[float, float]:
    """Validation loss and perplexity, logged (``when``: "before" or "after" training) at optimizer step ``step``."""
    loss, ppl = evaluate_loss(accelerator, run.model, run.eval_dl, loss_fn)
    logger.info("eval loss %s training: %.4f (perplexity %.2f)", when, loss, ppl)
    accelerator.log({"eval/loss": loss, "eval/perplexity": ppl}, step=step)
    return loss, ppl


def run(cfg: TrainConfig) -> dict:
    """Run the job described by ``cfg``; return the summary (also written to ``output_dir``).

    Raises:
        UsageError: bad input, detected before any output is written.
        ProcessCountError: the launcher and the Accelerator disagree on the process count.
    """
    from accelerate.utils import set_seed

    check_output_dir(cfg.output_dir)
    check_writable(cfg.output_dir)
    if cfg.trace_dir:
        check_output_dir(cfg.trace_dir, flag="--trace_dir")
    resume, earlier = _resume_path(cfg)
    auto = auto_batch.for_job(cfg, resume)  # --auto_find_batch_size: this attempt's (B, K), before the Accelerator
    accelerator = _accelerator(cfg)
    _log_resume(cfg, resume, earlier)  # Accelerate's logger needs its state
    plan, k = accelerator.run_plan, accelerator.run_plan.first_accumulation_steps
    if resume is not None:  # before any work: the data position must mean the same examples
        check_resumable(resume, gradient_accumulation_steps=k, world_size=accelerator.num_processes,
                        per_device_batch_size=cfg.per_device_train_batch_size, accumulation_schedule=plan.schedule,
                        engine=engine_name(accelerator), resplit=auto is not None)
        check_state_files(resume, schedulers=1)  # the job's one scheduler, no registered objects
    set_seed(cfg.seed)
    run = _prepare(cfg, accelerator)
    adapter = adapter_record(run.model) if cfg.lora is not None else None
    if resume is not None:  # the saved weights must be this model's: same adapter (or none), before any training
        check_adapter_resume(resume, read_loop_state(resume).get("adapter"), adapter)
    lm_loss = CausalLMLoss(cfg.fused_linear_cross_entropy, cfg.fused_linear_cross_entropy_chunk)
    lm_loss.head(run.model)  # an explicit --fused_linear_cross_entropy the model cannot serve fails here, before any work
    router = moe.router_loss(cfg.router_aux_loss_scope, accelerator, run.model, lm_loss)  # None for a dense model
    callbacks, profiler, switches, held, watch = _callbacks(cfg, accelerator, run, auto, lm_loss)
    callbacks.append(moe.router_records(router, accelerator))
    before = _evaluate(accelerator, run, "before", 0, lm_loss)
    checkpointer = Checkpointer(accelerator, cfg.output_dir, cfg.checkpointing_steps, cfg.checkpoints_total_limit,
                                resplit=auto is not None, metadata={"adapter": adapter})
    try:
        with auto_batch.on_failure(auto, accelerator.process_index, checkpointer):  # ends this process, no collective
            result = train_loop(accelerator, run.model, run.optimizer, run.train_dl, lr_scheduler=run.lr_scheduler,
                                max_train_steps=run.steps, max_grad_norm=cfg.max_grad_norm,
                                loss_normalization=cfg.loss_normalization, loss_fn=router or lm_loss, callbacks=callbacks,
                                profiler=profiler,
                                checkpointer=checkpointer, resume_from=resume, lr_scaling=cfg.lr_scaling,
                                logging_steps=cfg.logging_steps)
    except Preempted:  # every process stops at the same step: log the steps the trackers have not read yet
        for tracker in (c for c in callbacks if isinstance(c, TrackerLogger)):
            tracker.flush()
        accelerator.end_training()
        raise
    after = _evaluate(accelerator, run, "after", result.optimizer_steps, lm_loss)
    comm = _comm_block(profiler, switches, optimizer_steps_per_epoch(len(run.train_dl), k), accelerator)
    if comm is not None and "speedup" in comm:
        accelerator.log({"comm/ab_speedup": comm["speedup"]}, step=result.optimizer_steps)
    summary = build_summary(cfg, accelerator, result, k=k, schedule=plan.schedule, checkpointer=checkpointer, resume=resume,
                       evals=(before[0], after[0], before[1], after[1]), data=run.data, n_params=run.n_params)
    summary["trainable_parameters"] = run.n_trainable
    summary["adapter"] = adapter  # None unless --use_peft
    if comm is not None:
        summary["comm"] = comm
    summary["auto_find_batch_size"] = auto.summary() if auto is not None else None
    summary["router"] = moe.router_summary(router)
    summary["loss"] = lm_loss.used  # which causal-LM loss ran (fused or the logits), and why
    summary["compile"] = {**compile_settings(accelerator), **watch.summary()} if watch is not None else None
    if watch is not None:  # the last evaluation counted too
        watch.close()
    summary["memory"] = held.summary()  # collective
    _save_outputs(cfg, accelerator, run.model, run.tokenizer, summary)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def _resume_path(cfg: TrainConfig):
    """``(checkpoint to resume from, an earlier run's newest checkpoint this run ignores)`` (each may be None): the
    first is --resume_from_checkpoint or, in a worker torchrun restarted (``TORCHELASTIC_RESTART_COUNT`` > 0,
    ``--max_restarts``), the newest complete checkpoint in --output_dir, without a flag."""
    if cfg.resume_from_checkpoint is not None:
        return resolve_checkpoint(cfg.resume_from_checkpoint, cfg.output_dir), None
    found = latest_checkpoint(cfg.output_dir)  # restart count: torchrun's, or an --auto_find_batch_size re-exec's
    return (found, None) if auto_batch.restart_count() > 0 and found is not None else (None, found)


def _log_resume(cfg: TrainConfig, resume, earlier) -> None:
    """Say that a restarted worker resumes, or that this run starts afresh beside an earlier run's checkpoints."""
    if earlier is not None:
        logger.warning("--output_dir already holds checkpoints up to %s from an earlier run; this run starts afresh "
                       "and replaces those it saves under the same names", earlier.name)
    elif resume is not None and cfg.resume_from_checkpoint is None:
        logger.warning("elastic restart %d: resuming from %s", auto_batch.restart_count(), resume)


def _profiling(cfg: TrainConfig, accelerator, model, steps: int):
    """The CommProfiler and the window-alternating callbacks the profiling flags ask for.

    Windows, in order: 1 warm-up step, ``2 x --profile_ab_steps`` A/B windows,
    ``2 x --profile_overhead_steps`` profiler on/off windows, then (with
    ``--trace_dir``) 1 trace warm-up step and 2 traced steps, so that no
    measurement disturbs another.
    """
    if not cfg.profile_comm:
        return None, []
    ab_end = 1 + 2 * cfg.profile_ab_steps
    overhead_end = ab_end + 2 * cfg.profile_overhead_steps
    needed = overhead_end + (3 if cfg.trace_dir else 0)
    if steps < needed:
        flag = "--trace_dir" if cfg.trace_dir else ("--profile_overhead_steps" if cfg.profile_overhead_steps else "--profile_ab_steps")
        raise UsageError(flag, f"the profiling windows need {needed} optimizer steps but the run has {steps}",
                         "raise --max_train_steps or ask for fewer profiling windows")
    profiler = CommProfiler(accelerator, model, trace_dir=cfg.trace_dir, trace_wait=overhead_end)
    switches = []
    if cfg.profile_ab_steps:
        switches.append(ABSwitch(accelerator, cfg.profile_ab_steps, profiler, warmup_steps=1))
    if cfg.profile_overhead_steps:
        switches.append(OverheadSwitch(profiler, cfg.profile_overhead_steps, warmup_steps=ab_end))
    return profiler, switches


def _comm_block(profiler, switches, steps_per_epoch: int, accelerator) -> dict | None:
    """The profiler's summary plus the A/B and overhead figures, printed as a table on the main process."""
    if profiler is None:
        return None
    comm = profiler.summary()  # collective
    for switch in switches:
        comm.update(switch.summary(steps_per_epoch) if isinstance(switch, ABSwitch) else switch.summary())
    if getattr(profiler, "trace_path", None):
        comm["trace_file"] = profiler.trace_path
    accelerator.print(format_table(comm))
    return comm


def run_command(cfg: TrainConfig) -> int:
    """``accum-kit train``: run the job; 0 on success (bad input raises, and the CLI exits 2)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    try:
        run(cfg)
    except auto_batch.BatchTooLarge:  # the state file holds the next micro-batch: restart (torchrun) or re-exec
        auto_batch.exit_for_retry()
    except Preempted as stop:
        logging.getLogger("accum_kit.job.train").warning(
            "preempted by %s: checkpoint %s (optimizer step %d) is complete; exiting with code %d. Continue with "
            "--resume_from_checkpoint latest", stop.signal_name, stop.path, stop.step, PREEMPTED_EXIT_CODE)
        return PREEMPTED_EXIT_CODE
    return 0
