"""The DeepSpeed ZeRO engine: the plugin from the run's flags, the look-ahead window normalisation, clipping in its step.

How DeepSpeed's accumulation differs from DDP's and FSDP2's (DeepSpeed 0.19.8,
accelerate 1.15):

- ``accelerator.backward`` does not divide the loss by K under DeepSpeed; the
  engine's ``backward`` divides it by its own ``gradient_accumulation_steps``
  (the config's K, also in a partial last window), and ZeRO averages the
  gradients over the W data-parallel processes.
- Accelerate's ``DeepSpeedEngineWrapper.backward`` runs ``engine.backward`` and,
  on the boundary (``sync_gradients``), ``engine.step`` in the same call:
  clipping and the optimizer step happen inside the boundary's backward, and
  under ZeRO-2/3 the reduced gradients live in the ZeRO optimizer's own
  partitions, not in ``.grad``. The loop's "rescale the gradients after the
  window" (:mod:`accum_kit.core.loss`) has nothing to act on.
- So the window's target-token count N is taken first (the transformers
  Trainer's way, ``num_items_in_batch``): :class:`LookaheadNormalizer` reads
  the window's micro-batches ahead, counts their target tokens, sums the count
  over processes (one scalar all-reduce), and each micro-batch back-propagates
  ``S x K x W / N``. The engine's ``1/K`` and ``1/W`` cancel, and the update is
  ``sum S / N``: one big batch on one process, partial windows included.
- The engine clips with the config's ``gradient_clipping``, at its step: the
  config must say the run's ``--max_grad_norm`` (0: no clipping).

What each stage sends per window is in docs/deepspeed.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import torch
import torch.utils.data

from ..compat import set_end_of_dataloader
from ..core.loss import WindowNormalizer
from ..errors import UsageError
from .base import Engine
from .policies import AccumulationPolicy

EXTRA_FIX = 'install the extra: pip install -e ".[deepspeed]" (or pip install deepspeed==0.19.8)'


def deepspeed_requested(deepspeed_plugin=None) -> bool:
    """True when the run asked for DeepSpeed: a plugin was passed, or ``accelerate launch`` set ``ACCELERATE_USE_DEEPSPEED=true``."""
    return deepspeed_plugin is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def check_deepspeed_installed() -> None:
    """Raise :class:`UsageError` (``--use_deepspeed``, exit 2) naming the extra when ``deepspeed`` cannot be imported."""
    if importlib.util.find_spec("deepspeed") is None:
        raise UsageError("--use_deepspeed", "this run was launched with a DeepSpeed config but the deepspeed "
                         "package is not installed", EXTRA_FIX)


def _raw_config_keys() -> set:
    """Top-level keys of the launcher's DeepSpeed JSON (``deepspeed_config_file``) as written; empty without one.

    Accelerate inserts ``gradient_accumulation_steps: 1`` into a file that has
    none (``DeepSpeedPlugin.__post_init__``), which must not read as a contradiction.
    """
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path in ("", "none") or not os.path.isfile(path):
        return set()
    with open(path) as f:
        return set(json.load(f))


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


def deepspeed_plugin_for(deepspeed_plugin=None, *, gradient_accumulation_steps: int, max_grad_norm: float | None,
                         policy_name: str = "no_sync"):
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
        policy_name: the run's accumulation policy; only ``no_sync`` (the
            default) is accepted: the ZeRO stage decides what a window reduces.

    Returns:
        The plugin, its ``deepspeed_config`` filled.

    Raises:
        UsageError: deepspeed not installed (``--use_deepspeed``, naming the
            extra); settings Accelerate refuses (``--deepspeed_config_file``); a config number contradicting ``--gradient_accumulation_steps``
            or ``--max_grad_norm``; a policy other than ``no_sync``.
    """
    check_deepspeed_installed()
    if policy_name != "no_sync":
        raise UsageError("--accumulation_policy", f"{policy_name} has no meaning under DeepSpeed: the ZeRO stage "
                         "decides what a window reduces (ZeRO-1 on the boundary only, ZeRO-2 and 3 every "
                         "micro-batch)", "drop --accumulation_policy and pick the stage with accelerate launch "
                         "--zero_stage N (or zero_stage in the accelerate config)")
    plugin = deepspeed_plugin if deepspeed_plugin is not None else launched_plugin()
    config = plugin.deepspeed_config
    written = _raw_config_keys() or None
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
    config = accelerator.deepspeed_plugin.deepspeed_config
    sizes = [o.batch_size for o in objects if isinstance(o, torch.utils.data.DataLoader) and o.batch_size]
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


def check_constant_k(accelerator, schedule) -> None:
    """:func:`refuse_changing_k` when ``accelerator`` runs DeepSpeed (no check otherwise)."""
    if getattr(accelerator, "deepspeed_plugin", None) is not None:
        refuse_changing_k(schedule)


def count_items(loss_fn, batch) -> torch.Tensor:
    """The items (target tokens) ``loss_fn`` will count in ``batch``, before running the model.

    Uses ``loss_fn.count_items(batch)``; :func:`accum_kit.core.loss.causal_lm_loss`,
    ``classification_loss`` and ``seq2seq_loss`` have one.

    Raises:
        UsageError (``loss_fn``): the function has no ``count_items``.
    """
    counter = getattr(loss_fn, "count_items", None)
    if counter is None:
        raise UsageError("loss_fn", "under DeepSpeed the window's items are counted before its forward passes, "
                         f"and {getattr(loss_fn, '__name__', loss_fn)!r} has no count_items", "give the function "
                         "a count_items(batch) -> int attribute (see accum_kit.core.loss.causal_lm_loss), or use "
                         "--loss_normalization mean")
    return torch.as_tensor(counter(batch))


class LookaheadNormalizer(WindowNormalizer):
    """``tokens`` normalisation under DeepSpeed: count the window first, scale each micro-batch's loss.

    Use as :class:`accum_kit.core.loss.WindowNormalizer`, and iterate the epoch's
    batches through :meth:`batches` (the loop does). Each micro-batch's loss is
    ``S x K x W / N``, with K the engine's ``gradient_accumulation_steps``, W
    the processes and N the window's target tokens over all processes; the
    engine divides by K and averages over W, so the update is ``sum S / N``.
    :meth:`finish` leaves the gradients alone, and checks that the tokens the
    loss function counted equal the look-ahead count.

    Raises:
        RuntimeError (in :meth:`finish`): the look-ahead count and the loss
            function's count differ (``count_items`` disagrees with the loss).
    """

    def __init__(self, accelerator, loss_fn):
        super().__init__(accelerator, "tokens")
        self.loss_fn = loss_fn
        self.window_items: float | None = None  # N of the window being run, summed over processes

    def batches(self, iterable, loss_fn=None):
        """Yield ``iterable``'s batches, reading each window ahead to count its items (one all-reduce per window).

        A window is K batches or fewer when the dataloader ends (Accelerate's
        end-of-dataloader flag, set when the last batch is fetched, is put back
        per batch so that only the window's last batch closes it).
        """
        acc, it = self.accelerator, iter(iterable)
        loss_fn = loss_fn or self.loss_fn
        from ..compat import at_end_of_dataloader

        while True:
            window, ends = [], []
            for batch in it:
                window.append(batch)
                ends.append(at_end_of_dataloader(acc))
                if len(window) == acc.gradient_accumulation_steps or ends[-1]:
                    break
            if not window:
                return
            local = sum(count_items(loss_fn, b).double() for b in window).reshape(1).to(acc.device)
            self.window_items = float(acc.reduce(local, reduction="sum"))
            for batch, end in zip(window, ends):
                set_end_of_dataloader(acc, end)
                yield batch

    def backward_loss(self, summed_loss: torch.Tensor, num_items) -> torch.Tensor:
        """``summed_loss x K x W / N`` for ``accelerator.backward`` (see the class docstring)."""
        if self.window_items is None:
            raise RuntimeError("LookaheadNormalizer.backward_loss before its window was counted: iterate the "
                               "batches through LookaheadNormalizer.batches")
        n = torch.as_tensor(num_items, device=summed_loss.device)
        acc = self.accelerator
        scale = acc.gradient_accumulation_steps * acc.num_processes / max(self.window_items, 1.0)
        step = torch.stack([summed_loss.detach().double(), n.double(), torch.ones_like(n, dtype=torch.float64)])
        self._stats = step if self._stats is None else self._stats + step
        return summed_loss * scale

    @torch.no_grad()
    def finish(self, model: torch.nn.Module) -> tuple[float, int]:
        """Close the window (the engine has stepped already): return ``(window_loss, window_tokens)``."""
        acc = self.accelerator
        stats = self._stats if self._stats is not None else torch.zeros(3, dtype=torch.float64, device=acc.device)
        loss_sum, tokens, _ = acc.reduce(stats.to(acc.device), reduction="sum").cpu().tolist()
        if tokens != self.window_items:
            raise RuntimeError(f"the window's items counted ahead ({self.window_items:g}) differ from those the "
                               f"loss function returned ({tokens:g}): its count_items must count what it averages")
        self._reset()
        return loss_sum / max(tokens, 1.0), int(tokens)


def window_normalizer(accelerator, mode: str, loss_fn) -> WindowNormalizer:
    """The loop's normaliser under the run's engine (:class:`LookaheadNormalizer` for ``tokens`` under DeepSpeed)."""
    from ..core.run_plan import run_plan_of

    return run_plan_of(accelerator).engine.window_normalizer(accelerator, mode, loss_fn)


def deepspeed_summary(accelerator) -> dict | None:
    """What ``train_summary.json`` records of DeepSpeed: None without it.

    Returns:
        ``{"zero_stage", "gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu"}``
        from the config the engine was built with.
    """
    plugin = getattr(accelerator, "deepspeed_plugin", None)
    if plugin is None:
        return None
    config = plugin.deepspeed_config
    return {"zero_stage": int(plugin.zero_stage), **{k: config.get(k) for k in (
        "gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu")}}


def check_model_saving(accelerator) -> None:
    """Refuse, before training, a ZeRO-3 run whose config cannot save the trained model.

    Under ZeRO-3 each process holds 1/W of every parameter; Accelerate's
    ``get_state_dict`` (the train job's ``save_pretrained``) gathers them only with
    ``stage3_gather_16bit_weights_on_model_save: true`` and raises after the whole
    run otherwise (accelerate 1.15).

    Raises:
        UsageError (``--zero3_save_16bit_model``).
    """
    plugin = getattr(accelerator, "deepspeed_plugin", None)
    if plugin is None or int(plugin.zero_stage) != 3:
        return
    if not plugin.deepspeed_config.get("zero_optimization", {}).get("stage3_gather_16bit_weights_on_model_save"):
        raise UsageError("--zero3_save_16bit_model", "under ZeRO-3 the trained model can be saved only if its "
                         "partitions are gathered on save, and the config turns that off", "set "
                         "zero3_save_16bit_model: true in the accelerate config's deepspeed_config (or "
                         "stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed JSON)")


def check_profile_flags(accelerator, ab_steps: int) -> None:
    """Refuse ``--profile_ab_steps`` under DeepSpeed: the A/B switch flips ``no_sync``, which the ZeRO stage fixes.

    Raises:
        UsageError (``--profile_ab_steps``).
    """
    if ab_steps and getattr(accelerator, "deepspeed_plugin", None) is not None:
        raise UsageError("--profile_ab_steps", "alternates no_sync with syncing every micro-batch, but under "
                         "DeepSpeed the ZeRO stage decides when gradients are reduced", "drop it; compare "
                         "stages with --profile_comm under accelerate launch --zero_stage 1, then --zero_stage 2")


def deepspeed_engine(model):
    """The ``DeepSpeedEngine`` of a prepared model, or None (``prepare`` returns the engine itself)."""
    return model if type(model).__name__ == "DeepSpeedEngine" else None


def deepspeed_engine_precision(accelerator) -> str | None:
    """The precision a DeepSpeed engine trains in: ``"bf16"``, ``"fp16"`` or ``"no"``; None without DeepSpeed.

    Read from the plugin's DeepSpeed config (``bf16.enabled`` / ``fp16.enabled``):
    on CPU the Accelerator's own ``mixed_precision`` says ``"no"``
    (:func:`accum_kit.compat.enable_deepspeed_on_cpu`), because DeepSpeed casts
    the model itself (its weights and gradients in that dtype, the optimizer's
    master copy in float32), not Accelerate's autocast.
    """
    plugin = getattr(accelerator, "deepspeed_plugin", None)
    if plugin is None:
        return None
    config = plugin.deepspeed_config
    for name, key in (("bf16", "bf16"), ("fp16", "fp16")):
        if str((config.get(key) or {}).get("enabled", False)).lower() == "true":
            return name
    return "no"


def _written_clipping() -> bool:
    """Whether the launcher's DeepSpeed JSON sets ``gradient_clipping`` to a number (not ``auto``)."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path in ("", "none") or not os.path.isfile(path):
        return False
    with open(path) as f:
        value = json.load(f).get("gradient_clipping")
    return value is not None and value != "auto"


class ZeroEngine(Engine):
    """DeepSpeed's engine with ZeRO stage 1, 2 or 3 (``deepspeed.initialize`` inside ``accelerator.prepare``).

    What differs from DDP (DeepSpeed 0.19.8, accelerate 1.15): the engine
    divides each loss by its own K and reduces as its stage does (ZeRO-1 on the
    boundary, ZeRO-2 and 3 every micro-batch), and runs the optimizer step,
    clipping included, inside the boundary's ``backward``; so the window's
    tokens are counted ahead (:class:`LookaheadNormalizer`), the clipping norm
    is set on the engine (:meth:`use_clipping`), K cannot change during a run,
    and the policy is the stage (``zero1``...). A scheduler ``prepare`` leaves
    unwrapped is wrapped as Accelerate wraps it elsewhere (:meth:`after_prepare`).

    Args:
        deepspeed_plugin: the caller's ``DeepSpeedPlugin``, or None (the launcher's ``ACCELERATE_DEEPSPEED_*``).
    """

    name = "deepspeed"
    compiles = False

    def __init__(self, deepspeed_plugin=None):
        super().__init__()
        self.plugin = deepspeed_plugin
        self._clipping_pinned = False  # the run's clipping was given when the engine was built

    @property
    def stage(self) -> int:
        """The ZeRO stage (from the plugin, filled from the launch)."""
        if self.plugin is None:  # read the launcher's variables once
            self.plugin = launched_plugin()
        return int(self.plugin.zero_stage)

    @property
    def label(self) -> str:
        return f"DeepSpeed ZeRO-{self.stage}" if self.plugin is not None else "DeepSpeed"

    def check_policy(self, policy) -> None:
        """Only ``no_sync`` (the default, which the stage then restates): the stage decides what a window reduces."""
        if policy.name != "no_sync":
            raise UsageError("--accumulation_policy", f"{policy.name} has no meaning under DeepSpeed: the ZeRO stage "
                             "decides what a window reduces (ZeRO-1 on the boundary only, ZeRO-2 and 3 every "
                             "micro-batch)", "drop --accumulation_policy and pick the stage with accelerate launch "
                             "--zero_stage N (or zero_stage in the accelerate config)")

    def check_request(self, policy, *, ddp_kwargs, compile_requested, world_size, on_cpu) -> None:
        check_deepspeed_installed()
        super().check_request(policy, ddp_kwargs=ddp_kwargs, compile_requested=compile_requested,
                              world_size=world_size, on_cpu=on_cpu)
        if compile_requested:
            raise UsageError("--torch_compile", "is not supported with DeepSpeed by accum-kit (not checked for "
                             "exactness or no_sync)", "drop --torch_compile, or launch with a DDP or FSDP2 config")
        if world_size < 2 and on_cpu:
            raise UsageError("--num_processes", "DeepSpeed on CPU needs at least 2 processes (one process has "
                             "nothing to shard with, and Accelerate would run it unsharded)",
                             "launch 2 or more processes, or use accelerate_configs/cpu_single.yaml")

    def accelerator_kwargs(self, kwargs, *, accumulation_steps, policy, max_grad_norm, mixed_precision):
        kwargs["deepspeed_plugin"] = self.plugin = deepspeed_plugin_for(
            self.plugin, gradient_accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)
        self._clipping_pinned = max_grad_norm is not None or _written_clipping()
        return kwargs

    def resolve_policy(self, name: str) -> AccumulationPolicy:
        """``zero<N>`` for the engine's stage N (what the run records), else as for any engine (only ``no_sync``)."""
        from .policies import POLICIES

        if name == f"zero{self.stage}":
            return self.run_policy(POLICIES["no_sync"])
        return super().resolve_policy(name)

    def use_plugin(self, deepspeed_plugin) -> None:
        """Follow the Accelerator to another DeepSpeed plugin (the bench's stage sweep swaps them in one process,
        :func:`accum_kit.compat.use_deepspeed_engine`); the stage and the config are then that plugin's."""
        self.plugin = deepspeed_plugin

    def run_policy(self, policy: AccumulationPolicy) -> AccumulationPolicy:
        """The stage as the run's policy: ``zero1`` reduces on the boundary only, ``zero2``/``zero3`` every micro-batch."""
        stage = self.stage
        return dataclasses.replace(policy, name=f"zero{stage}", sync_each_batch=False, help=f"DeepSpeed ZeRO-{stage}: "
                                   + ("reduces on the boundary only" if stage < 2 else "reduces every micro-batch"))

    def bind(self, accelerator, on_cpu: bool) -> "ZeroEngine":
        super().bind(accelerator, on_cpu)
        if on_cpu:
            from ..compat import enable_deepspeed_on_cpu

            enable_deepspeed_on_cpu(accelerator, self.plugin)
        return self

    def before_prepare(self, accelerator, objects) -> None:
        check_batch_sizes(accelerator, objects)

    def after_prepare(self, accelerator, objects, prepared: list) -> list:
        """Wrap a scheduler that ``prepare`` returned as it came (one prepared without the model).

        Accelerate wraps a scheduler in ``AcceleratedScheduler`` (which steps it
        once per process per optimizer step, its convention, and which
        ``save_state`` saves) everywhere but in a DeepSpeed ``prepare`` call
        that holds no model (accelerate 1.15): there it comes back unwrapped,
        steps once per optimizer step and is not checkpointed. Wrapping it the
        same way keeps one convention for every engine.
        """
        from ..compat import wrap_prepared_scheduler

        return [wrap_prepared_scheduler(accelerator, obj) if obj is out else out
                for obj, out in zip(objects, prepared)]

    def reduces_each_micro_batch(self, accelerator, policy) -> bool:
        """True under ZeRO-2 and 3 with several processes: their gradients are partitioned, so every backward reduces."""
        return accelerator.num_processes > 1 and self.stage >= 2

    def window_normalizer(self, accelerator, mode: str, loss_fn):
        """:class:`LookaheadNormalizer` for ``tokens`` (the engine owns the gradients); ``mean`` as under DDP."""
        if mode == "tokens":
            return LookaheadNormalizer(accelerator, loss_fn)
        return super().window_normalizer(accelerator, mode, loss_fn)

    def check_schedule(self, schedule) -> None:
        """Refuse a schedule whose K changes (see :func:`check_constant_k`)."""
        refuse_changing_k(schedule)

    def use_clipping(self, accelerator, max_grad_norm: float | None) -> None:
        """Make the engine clip at the loop's ``max_grad_norm``: DeepSpeed clips inside its own step.

        A value given when the engine was built (``build_accelerator(max_grad_norm=...)``, or a number in the
        DeepSpeed JSON) must agree; otherwise the loop's value is set on the built engine
        (:func:`accum_kit.compat.set_deepspeed_clipping`).

        Raises:
            UsageError (``--max_grad_norm``): the loop's value contradicts the one the engine was built with.
        """
        have = float(self.plugin.deepspeed_config.get("gradient_clipping") or 0.0)
        want = 0.0 if max_grad_norm is None else float(max_grad_norm)
        if have == want:
            return
        if self._clipping_pinned:
            raise UsageError("--max_grad_norm", f"the DeepSpeed engine was built to clip at {have or 'no norm'} "
                             f"(build_accelerator's max_grad_norm or the DeepSpeed config's gradient_clipping) but "
                             f"the loop was given {max_grad_norm}", "give max_grad_norm in one place: to train_loop "
                             "(and leave gradient_clipping \"auto\" in the DeepSpeed config), or the same value to both")
        from ..compat import set_deepspeed_clipping

        engines = [m for m in accelerator._models if self.prepared_engine(m) is not None]
        for engine in engines:
            set_deepspeed_clipping(engine, want)
        self.plugin.deepspeed_config["gradient_clipping"] = want
        self.plugin.gradient_clipping = want

    def held_tensors(self, model):
        from ..compat import deepspeed_held_gradients

        if self.prepared_engine(model) is None:
            yield from super().held_tensors(model)
            return
        yield from deepspeed_held_gradients(model)

    def window_costs(self, accelerator, model, accumulation_steps, policy):
        """:func:`accum_kit.engines.costs.zero_costs` of the engine's stage (``policy`` is its name, ``zero2``...;
        ZeRO-3's ``ds_numel``: the unpartitioned size)."""
        from .costs import zero_costs

        P = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
        groups = len(getattr(getattr(model, "optimizer", None), "param_groups", None) or [None])
        return zero_costs(f"zero{self.stage}", P, world_size=accelerator.num_processes,
                          accumulation_steps=accumulation_steps, param_groups=groups)

    def predicted_memory(self, accelerator, model, accumulation_steps, policies) -> dict:
        """One entry, the stage (``"zero2"``...): :meth:`window_costs`; the stage is the run's only policy."""
        return {f"zero{self.stage}": self.window_costs(accelerator, model, accumulation_steps, None).to_dict()}

    def compute_precision(self, accelerator) -> str:
        """``"bf16"``, ``"fp16"`` or ``"no"``, from the DeepSpeed config (see :func:`deepspeed_engine_precision`)."""
        config = self.plugin.deepspeed_config
        for name, key in (("bf16", "bf16"), ("fp16", "fp16")):
            if str((config.get(key) or {}).get("enabled", False)).lower() == "true":
                return name
        return "no"

    def casts_model(self) -> bool:
        return True

    def summary_blocks(self, accelerator) -> dict:
        """``{"fsdp": None, "deepspeed": {"zero_stage", "gradient_accumulation_steps", "gradient_clipping",
        "train_micro_batch_size_per_gpu"}}`` from the config the engine was built with."""
        config = self.plugin.deepspeed_config
        return {"fsdp": None, "deepspeed": {"zero_stage": self.stage, **{k: config.get(k) for k in (
            "gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu")}}}

    def checkpoint_tag(self, accelerator) -> str:
        return f"deepspeed_zero{self.stage}"

    def check_job(self, *, profile_ab_steps: int = 0) -> None:
        """Refuse ``--profile_ab_steps`` (the stage fixes when gradients are reduced) and a ZeRO-3 run whose config
        cannot save the trained model (:func:`check_model_saving`)."""
        check_profile_flags(self.accelerator, profile_ab_steps)
        check_model_saving(self.accelerator)

    def prepared_engine(self, model):
        return model if type(model).__name__ == "DeepSpeedEngine" else None

    def profiler_part(self, profiler):
        """:class:`accum_kit.profiler.parts.ZeroPart`: DeepSpeed's communication backend and the ZeRO optimizer's
        reduction path, reported for the stage."""
        from ..profiler.parts import ZeroPart

        return ZeroPart(profiler, stage=self.stage)

    def owns_backward(self) -> bool:
        """True: the engine's ``backward`` divides the loss by its K, reduces as its stage does and steps."""
        return True
