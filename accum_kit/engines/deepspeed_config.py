"""DeepSpeed's configuration from the run's flags, and what a DeepSpeed run refuses before any work.

The plugin's K and clipping come from ``--gradient_accumulation_steps`` and
``--max_grad_norm`` (a number in the DeepSpeed JSON that says otherwise is
refused); the config's batch sizes must agree with the dataloader; K cannot
change during a run; a ZeRO-3 run must be able to save its model; the A/B
profiling switch has no meaning. Used by :class:`accum_kit.engines.deepspeed.ZeroEngine`.
"""

from __future__ import annotations

import importlib.util
import json
import os

from ..errors import UsageError

EXTRA_FIX = 'install the extra: pip install -e ".[deepspeed]" (or pip install deepspeed==0.19.8)'


def check_deepspeed_installed() -> None:
    """Raise :class:`UsageError` (``--use_deepspeed``, exit 2) naming the extra when ``deepspeed`` cannot be imported."""
    if importlib.util.find_spec("deepspeed") is None:
        raise UsageError("--use_deepspeed", "this run was launched with a DeepSpeed config but the deepspeed "
                         "package is not installed", EXTRA_FIX)


def written_config() -> dict:
    """The launcher's DeepSpeed JSON (``deepspeed_config_file``) as written; empty without one.

    Accelerate inserts ``gradient_accumulation_steps: 1`` into a file that has
    none (``DeepSpeedPlugin.__post_init__``), which must not read as a
    contradiction; and a ``gradient_clipping`` number written there pins the
    run's clipping (:meth:`ZeroEngine.use_clipping`).
    """
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path in ("", "none") or not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _agree(config: dict, key: str, value, flag: str, written: set | None) -> None:
    """Fill ``config[key]`` from the run's flag; refuse a number that says something else."""
    have = config.get(key)
    if have is None or have == "auto" or (written is not None and key not in written):
        config[key] = value
        return
    if float(have) != float(value):
        raise UsageError(flag, f"the DeepSpeed config sets {key}: {have} but this run's flag gives {value}",
                         f"set {key} to \"auto\" in the DeepSpeed config (accum-kit fills it from {flag}), "
                         f"or pass {flag} {have}")
    config[key] = value


def launched_plugin():
    """The ``DeepSpeedPlugin`` ``accelerate launch`` describes (its ``ACCELERATE_DEEPSPEED_*`` variables and JSON).

    Raises:
        UsageError (``--deepspeed_config_file``): settings Accelerate refuses (its own checks raise ValueError).
    """
    from accelerate.utils import DeepSpeedPlugin

    try:
        return DeepSpeedPlugin()
    except ValueError as exc:
        raise UsageError("--deepspeed_config_file", f"Accelerate refuses the DeepSpeed settings: {exc}",
                         "keep the settings in one place: the DeepSpeed JSON, or the accelerate config's "
                         "deepspeed_config keys (see accelerate_configs/cpu_deepspeed.yaml)") from None


def deepspeed_plugin_for(deepspeed_plugin=None, *, gradient_accumulation_steps: int, max_grad_norm: float | None):
    """The ``DeepSpeedPlugin`` to build the Accelerator with, its K and clipping taken from the run's flags.

    Args:
        deepspeed_plugin: the caller's plugin, or None to read the launcher's
            ``ACCELERATE_DEEPSPEED_*`` variables (``accelerate launch --config_file
            accelerate_configs/cpu_deepspeed.yaml``, ``--zero_stage N``).
        gradient_accumulation_steps: K, micro-batches per optimizer step; becomes
            the config's ``gradient_accumulation_steps`` (the engine divides each
            loss by it).
        max_grad_norm: the run's clipping (None: none); becomes ``gradient_clipping``
            (DeepSpeed's 0 means no clipping). Accelerate would otherwise fill an
            ``auto`` value with 1.0 in ``prepare``, clipping a run that asked for none.

    Returns:
        The plugin, its ``deepspeed_config`` filled.

    Raises:
        UsageError: deepspeed not installed (``--use_deepspeed``, naming the
            extra); settings Accelerate refuses (``--deepspeed_config_file``); a config number contradicting ``--gradient_accumulation_steps``
            or ``--max_grad_norm``. (The policy is the engine's to check: :meth:`ZeroEngine.check_policy`.)
    """
    check_deepspeed_installed()
    plugin = deepspeed_plugin if deepspeed_plugin is not None else launched_plugin()
    config = plugin.deepspeed_config
    written = set(written_config()) or None
    _agree(config, "gradient_accumulation_steps", int(gradient_accumulation_steps), "--gradient_accumulation_steps",
           written)
    _agree(config, "gradient_clipping", 0.0 if max_grad_norm is None else float(max_grad_norm), "--max_grad_norm",
           written)
    plugin.gradient_accumulation_steps = config["gradient_accumulation_steps"]
    plugin.gradient_clipping = config["gradient_clipping"]
    return plugin


def check_batch_sizes(accelerator, objects) -> None:
    """Refuse a DeepSpeed config whose micro-batch or global batch contradicts the train dataloader.

    Called by ``AccumulationAccelerator.prepare`` under DeepSpeed, before
    ``deepspeed.initialize`` (whose own check only compares the config's numbers
    with each other). ``auto`` values are filled by Accelerate from the dataloader.

    Raises:
        UsageError (``--per_device_train_batch_size``): ``train_micro_batch_size_per_gpu``
            differs from the dataloader's batch size, or ``train_batch_size`` from
            micro x K x W.
    """
    from torch.utils.data import DataLoader

    config = accelerator.deepspeed_plugin.deepspeed_config
    sizes = [o.batch_size for o in objects if isinstance(o, DataLoader) and o.batch_size]
    micro = config.get("train_micro_batch_size_per_gpu")
    if sizes and micro not in (None, "auto") and int(micro) != max(sizes):
        raise UsageError("--per_device_train_batch_size", f"the DeepSpeed config sets train_micro_batch_size_per_gpu: "
                         f"{micro} but the train dataloader's batch is {max(sizes)}", "set "
                         "train_micro_batch_size_per_gpu to \"auto\" in the DeepSpeed config, or pass "
                         f"--per_device_train_batch_size {micro}")
    total = config.get("train_batch_size")
    if sizes and total not in (None, "auto"):
        want = max(sizes) * int(config["gradient_accumulation_steps"]) * accelerator.num_processes
        if int(total) != want:
            raise UsageError("--per_device_train_batch_size", f"the DeepSpeed config sets train_batch_size: {total} "
                             f"but micro-batch x K x processes is {want}", "set train_batch_size to \"auto\" in the "
                             "DeepSpeed config")


def refuse_changing_k(schedule) -> None:
    """Refuse an accumulation schedule whose K changes: a DeepSpeed engine's K is fixed for the run.

    ``deepspeed.initialize`` fixes the engine's ``gradient_accumulation_steps``
    for the run: every loss is divided by it and its boundary follows it, so
    a window of another K would be scaled wrongly (DeepSpeed 0.19.8 has no
    supported way to change it on a built engine).

    Raises:
        UsageError (``--accumulation_schedule``): more than one K.
    """
    if schedule and len(set(schedule.values())) > 1:
        raise UsageError("--accumulation_schedule", "K cannot change during a DeepSpeed run: the engine divides "
                         "every loss by the gradient_accumulation_steps it was built with",
                         "drop the schedule under DeepSpeed (or run it under DDP or FSDP2)")


def check_model_saving(plugin) -> None:
    """Refuse, before training, a ZeRO-3 run whose config (``plugin``, a ``DeepSpeedPlugin``) cannot save the
    trained model.

    Under ZeRO-3 each process holds 1/W of every parameter; Accelerate's
    ``get_state_dict`` (the train job's ``save_pretrained``) gathers them only with
    ``stage3_gather_16bit_weights_on_model_save: true`` and raises after the whole
    run otherwise (accelerate 1.15).

    Raises:
        UsageError (``--zero3_save_16bit_model``).
    """
    if int(plugin.zero_stage) != 3:
        return
    if not plugin.deepspeed_config.get("zero_optimization", {}).get("stage3_gather_16bit_weights_on_model_save"):
        raise UsageError("--zero3_save_16bit_model", "under ZeRO-3 the trained model can be saved only if its "
                         "partitions are gathered on save, and the config turns that off", "set "
                         "zero3_save_16bit_model: true in the accelerate config's deepspeed_config (or "
                         "stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed JSON)")


def refuse_ab_profiling(ab_steps: int) -> None:
    """Refuse ``--profile_ab_steps`` under DeepSpeed: the A/B switch flips ``no_sync``, which the ZeRO stage fixes.

    Raises:
        UsageError (``--profile_ab_steps``).
    """
    if ab_steps:
        raise UsageError("--profile_ab_steps", "alternates no_sync with syncing every micro-batch, but under "
                         "DeepSpeed the ZeRO stage decides when gradients are reduced", "drop it; compare "
                         "stages with --profile_comm under accelerate launch --zero_stage 1, then --zero_stage 2")
