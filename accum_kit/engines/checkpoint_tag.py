"""Which engine wrote a checkpoint: DeepSpeed's layout is readable only by DeepSpeed, and by the same ZeRO stage.

Part of :mod:`accum_kit.core.checkpoint` (import from there). The loop state records
``engine`` (:func:`engine_name`); :func:`check_engine` refuses a resume across
engines or stages before anything is built or written.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError


def engine_name(accelerator) -> str:
    """What wrote (or would read) a checkpoint: the run's engine's tag (:meth:`accum_kit.engines.base.Engine.checkpoint_tag`):
    ``"deepspeed_zero<N>"`` under DeepSpeed, else Accelerate's distributed type in lower case (``"multi_cpu"``,
    ``"fsdp"``, ``"no"``, ...)."""
    from ..core.run_plan import run_plan_of

    return run_plan_of(accelerator).engine.checkpoint_tag(accelerator)


def _saved_engine(path, saved: dict) -> str | None:
    """The checkpoint's engine: its loop state's ``engine``, or for an older checkpoint "deepspeed" when it
    holds DeepSpeed's ZeRO files (``save_state`` writes them under ``pytorch_model/``), else None."""
    if saved.get("engine"):
        return saved["engine"]
    return "deepspeed" if any(Path(path).glob("*/zero_pp_rank_*_optim_states.pt")) else None


def check_engine(path, saved: dict, engine: str) -> None:
    """Refuse a checkpoint written by another engine, or another ZeRO stage, when DeepSpeed is on either side.

    DeepSpeed's ``save_checkpoint`` writes its own layout (model states and one
    optimizer partition per process, per stage), which neither Accelerate's
    DDP/FSDP loader nor another stage's engine reads: without this check the
    resume fails deep inside ``load_state`` after the model and data were built.
    ZeRO-1 and 2 write the same files but are refused too (the loop state's
    ``engine`` tells them apart).

    Raises:
        UsageError: ``--zero_stage`` (another stage) or ``--config_file`` (another engine), with the
            relaunch that fits the checkpoint.
    """
    have = _saved_engine(path, saved)
    now_ds, have_ds = engine.startswith("deepspeed"), (have or "").startswith("deepspeed")
    if not (now_ds or have_ds):
        return
    if now_ds and have_ds:
        if have != "deepspeed" and have != engine:
            stage = have.removeprefix("deepspeed_zero")
            raise UsageError("--zero_stage", f"{path} was saved under DeepSpeed ZeRO-{stage} but this run is "
                             f"ZeRO-{engine.removeprefix('deepspeed_zero')}; each stage partitions the optimizer "
                             "state its own way", f"relaunch with accelerate launch --zero_stage {stage} (or "
                             "zero_stage in the accelerate config), or start afresh without --resume_from_checkpoint")
        return
    raise UsageError("--config_file", f"{path} was saved by {_label(have)} but this run is "
                     f"{_label(engine)}; DeepSpeed's checkpoints and Accelerate's other "
                     "formats cannot be read by each other", "relaunch with the accelerate config it was saved "
                     "under (e.g. accelerate_configs/cpu_deepspeed.yaml for a DeepSpeed checkpoint), or start "
                     "afresh without --resume_from_checkpoint")


def _label(engine: str | None) -> str:
    """A reader's name for an engine: "DeepSpeed ZeRO-2", "DDP (multi_cpu)", "FSDP", "one process"."""
    if engine is None:
        return "Accelerate without DeepSpeed (DDP or FSDP)"
    if engine.startswith("deepspeed_zero"):
        return f"DeepSpeed ZeRO-{engine.removeprefix('deepspeed_zero')}"
    if engine == "deepspeed":
        return "DeepSpeed"
    return {"fsdp": "FSDP", "no": "one process"}.get(engine, f"DDP ({engine})" if engine.startswith("multi_") else engine)
