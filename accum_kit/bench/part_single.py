"""The one-process part of ``accum-kit bench``: accum-kit's loop against a plain PyTorch loop and the peers.

On one process there is no DDP wrapper, so ``no_sync`` and raw DDP mean nothing; what a user on one GPU
(or one CPU) asks is what the kit costs against the loop they would write, and against the tools they would
pick instead. The arms (``--modes``, default all):

- ``kit``: :func:`accum_kit.train_loop` on the prepared model, optimizer and dataloader, with the loss from the
  logits (:func:`accum_kit.core.loss.logits_causal_lm_loss`), the formula ``plain`` and the peers compute: its
  ratio to ``plain`` is what the loop costs;
- ``kit_fused``: the same with ``train_loop``'s default loss (computed in the output layer in chunks, without
  full-vocabulary logits; :mod:`accum_kit.bench.loss_axis`): the kit as it ships. Its ratio to ``kit`` and the
  memory it saves against ``kit`` (and the memory model's prediction of it) are what the loss brings; the
  one-process targets judge it against ``plain`` (see :func:`accum_kit.bench.report_single.evaluate_one_process_targets`);
- ``plain``: :func:`accum_kit.reference.plain_loop.train_plain` on its own copy of the model, not prepared: the
  model's own loss given ``labels``, ``torch.autocast`` in the run's precision (float16 with a GradScaler),
  ``optimizer.step()``, ``zero_grad``, clipping when ``--max_grad_norm`` is set. It is the baseline of every
  ratio, and its loss at the first step is the kit's oracle (same weights, same data);
- ``accelerate_guide``: the loop of Accelerate's gradient accumulation guide on the prepared model
  (:func:`accum_kit.bench.peers.train_accelerate_guide`);
- ``trainer``: ``transformers.Trainer`` on its own copy of the model, a new Trainer per run
  (:func:`accum_kit.bench.peers.train_trainer`).

Every arm runs the same weights (reset before every run, optimizer state zeroed), the same synthetic data in
the same order, the same optimizer (``--optim``: AdamW, fused or not), precision (``--mixed_precision``, or
the launch's) and clipping (``--max_grad_norm``). Every run is ``--warmup_steps`` unmeasured then ``--steps``
measured optimizer steps; the sweep's blocks rotate the arms' order by one from block to block, and every
ratio to ``plain`` (or to ``kit``) is paired per repeat with a 95 % interval (:mod:`.report_single`).

Timing: a step is the time from the end of the previous step (or the run's start) to the end of this one, on
the process's clock; on a GPU the clock first waits for the device (``torch.cuda.synchronize``), once per
optimizer step in every arm, so a step's time is the device's, and a host read inside a window still costs
what it costs. CPU seconds per step (``time.process_time``) are kept too: on a loaded machine they show extra
work that wall-clock noise hides. Peak memory per run: CUDA's ``max_memory_allocated`` after a reset, or on
CPU the resident-set high-water mark after freed heap memory is handed back
(:class:`accum_kit.bench.checkpointing_ab.TrimmedPeakMemory`). The comparison of arms is the rise over the run's
start, which leaves out what every arm holds alike (the model copies, the optimizer states), of the tensors
alone: on CUDA the timed runs' ``max_memory_allocated`` rise, on the CPU, where the resident set scatters by tens
of MB, the peak of the tensors one extra untimed run per arm makes (:mod:`.tensor_memory`).

Throughput and utilisation: tokens per step are the input tokens (K x batch x ``--block_size``); model FLOPs
utilisation is 6 x parameters x tokens/s over the device's peak (:mod:`.peak_flops`: a datasheet table for
H100 / H200 / A100, else a matmul measured here; the report says which).

The loss as its own axis: :data:`KIT_ARMS` maps each kit arm's name to the ``loss_fn`` that
:func:`accum_kit.train_loop` gets (None: its default). An entry added there (or passed as
``SingleBench(kit_arms=...)``) is one more arm: it joins ``--modes``' choices and default, runs on the kit's
prepared model in the same rotation, and gets its ratio to ``plain`` and to the first kit arm (``kit``), its
tensor peak against both and its predicted one, and its loss difference, with no other change.
"""

from __future__ import annotations

import copy
import gc
import time

import torch
from torch.utils.data import DataLoader

from ..core.callbacks import LoopCallback
from ..core.loop import train_loop
from ..core.loss import LossFn, logits_causal_lm_loss
from ..core.run_plan import run_plan_of
from ..job.models import PRESETS, build_model, count_parameters
from ..reference.plain_loop import train_plain
from .bench_config import PEERS
from .bench_data import TokenRows, synthetic_rows
from .bench_tables import format_loss_axis_table, format_one_process_table, format_targets
from .checkpointing_ab import TrimmedPeakMemory
from .parts import BenchPart
from .peak_flops import peak_flops
from .peers import TrainerLosses, constant_schedule, train_accelerate_guide, train_trainer
from .loss_axis import compute_element_bytes, predicted_loss_memory
from .report_single import (KIT, KIT_FUSED, ONE_PROCESS_CSV_FIELDS, PLAIN, evaluate_one_process_targets,
                            one_process_loss_axis, summarize_one_process)
from .runs import load_average, reset_training_state, reset_weights
from .tensor_memory import METHOD as TENSOR_METHOD
from .tensor_memory import tensor_peak

#: The kit's arms: name -> the ``loss_fn`` :func:`accum_kit.train_loop` gets (None: its default). One entry per
#: loss to compare; the first is the kit every other arm's ``over_kit`` ratio divides by: the logits' formula, the
#: one ``plain`` runs, so that ``kit_fused`` / ``kit`` is the fused loss alone.
KIT_ARMS: dict[str, LossFn | None] = {KIT: logits_causal_lm_loss, KIT_FUSED: None}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_optimizer(cfg, params) -> torch.optim.Optimizer:
    """``--optim``'s optimizer over ``params``: ``torch.optim.AdamW`` at ``--learning_rate``, ``fused=True`` for
    ``adamw_torch_fused`` (else PyTorch's default implementation)."""
    return torch.optim.AdamW(params, lr=cfg.learning_rate, fused=True if cfg.optim == "adamw_torch_fused" else None)


class StepClock(LoopCallback):
    """Loop callback timing every optimizer step: wall seconds (``time.perf_counter``) and the process's CPU
    seconds (``time.process_time``) from the end of the previous step, or from ``on_train_begin``, to
    ``on_step_end``; on CUDA it waits for the device at both points (once per step, in every arm)."""

    def __init__(self, device):
        self.wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.seconds, self.cpu_seconds = [], []
        self._last = self._cpu = None

    def on_train_begin(self, state=None):
        self.wait()
        self._last, self._cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, state=None):
        self.wait()
        now, cpu = time.perf_counter(), time.process_time()
        self.seconds.append(now - self._last)
        self.cpu_seconds.append(cpu - self._cpu)
        self._last, self._cpu = now, cpu


class TrainerClock(TrainerLosses):
    """Trainer callback: Trainer's losses (:class:`accum_kit.bench.peers.TrainerLosses`) and its steps timed by a
    :class:`StepClock` (Trainer's per-step loss logging falls into the next step, as its host read does)."""

    def __init__(self, clock: StepClock):
        super().__init__()
        self.clock = clock

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.on_train_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.on_step_end()


class SingleBench(BenchPart):
    """The one-process part (see the module docstring).

    Args:
        kit_arms: the kit's arms, name -> ``loss_fn`` (default :data:`KIT_ARMS`).
    """

    name = "one_process"
    schema = "accum_kit.bench.one_process/1"
    progress = "bench runs (one process)"
    collects = ("rows", "fused_loss")
    timings_from = ("the one process: wall and CPU seconds per optimizer step (on CUDA after "
                    "torch.cuda.synchronize at every step end, in every arm); peak memory per run")
    csv_fields = ONE_PROCESS_CSV_FIELDS

    def __init__(self, kit_arms: dict | None = None):
        self.kit_arms = dict(KIT_ARMS if kit_arms is None else kit_arms)
        self.peak = None

    # ---- the flags ----------------------------------------------------------------------------
    def default_modes(self) -> list[str]:
        """Every arm: the kit's (:attr:`kit_arms`), ``plain``, then the peers."""
        return [*self.kit_arms, PLAIN, *PEERS]

    def mode_choices(self) -> tuple:
        return tuple(self.default_modes())

    def check_loop_flags(self, cfg) -> None:
        """``--mixed_precision``, ``--max_grad_norm`` and ``--optim`` are this part's own: nothing refused."""

    def check_flags(self, cfg, policies_given: bool) -> None:
        """Refuse what needs several processes: DDP's settings, ``--tune``, ``--comm_hook``, the FSDP2 policies,
        the ZeRO stages.

        Raises:
            UsageError: naming the flag.
        """
        self.refuse([*self.ddp_only_flags(cfg), ("--accumulation_policies", policies_given)],
                    "has no meaning on one process (no DDP wrapper, nothing to synchronise)",
                    "drop {flag}, or launch 2 or more processes, e.g. accelerate launch --config_file "
                    "accelerate_configs/cpu_ddp.yaml -m accum_kit bench")
        self.refuse_stages(cfg)

    # ---- the run ------------------------------------------------------------------------------
    def config_file(self) -> tuple[str, int]:
        """``cpu_single.yaml`` (1 process), or on a GPU ``gpu_ddp.yaml`` (bf16) with ``--num_processes 1``."""
        return ("gpu_ddp.yaml", 8) if torch.cuda.is_available() else ("cpu_single.yaml", 1)

    def check_launch(self, cfg) -> None:
        """Nothing to refuse: this part is chosen for a launch of one process."""

    def build_accelerator(self, cfg):
        """The run's Accelerator (:func:`accum_kit.build_accelerator`) in ``--mixed_precision`` (default: the launch's)."""
        from ..launch import build_accelerator

        precision = {} if cfg.mixed_precision is None else {"mixed_precision": cfg.mixed_precision}
        return build_accelerator(None, **cfg.checkpointing(), **precision)

    def session(self, cfg, preset: str, accelerator) -> "SingleSession":
        if self.peak is None:  # once per sweep: a measured peak takes about a second on 2 CPU cores
            self.peak = peak_flops(accelerator.device, accelerator.mixed_precision)
        return SingleSession(cfg, preset, accelerator, self.kit_arms, self.peak)

    # ---- the report ---------------------------------------------------------------------------
    def summarize(self, preset, info, runs, cfg, world) -> dict:
        """The rows (:func:`summarize_one_process`) and the loss axis (:func:`one_process_loss_axis`: every kit arm
        with ``train_loop``'s default loss against the first kit arm)."""
        rows = summarize_one_process(preset, info, runs, cfg.modes, cfg.accumulation_steps, kit=self.kit())
        fused = [arm for arm, fn in self.kit_arms.items() if fn is None and arm != self.kit() and arm in cfg.modes]
        axis = one_process_loss_axis(preset, info, runs, rows, fused, kit=self.kit()) if self.kit() in cfg.modes else []
        return {"rows": rows, "fused_loss": axis}

    def kit(self) -> str:
        """The kit arm the others are compared with (``over_kit``): the first of :attr:`kit_arms`."""
        return next(iter(self.kit_arms))

    def shipped(self) -> str:
        """The kit arm the targets judge: the first that runs :func:`accum_kit.train_loop`'s default loss (the kit as
        it ships), else the first."""
        return next((name for name, fn in self.kit_arms.items() if fn is None), self.kit())

    def format_preset(self, preset, info, collected, cfg) -> str:
        text = format_one_process_table(preset, info, collected["rows"], cfg.modes)
        if collected["fused_loss"]:
            text += "\n" + format_loss_axis_table(preset, collected["fused_loss"])
        return text

    def result(self, cfg, presets, collected, runs, world):
        rows = [r for c in collected.values() for r in c["rows"]]
        axis = [r for c in collected.values() for r in c["fused_loss"]]
        targets = evaluate_one_process_targets(rows, presets, kit_arms=tuple(self.kit_arms), shipped=self.shipped(),
                                               loss_rows=axis)
        return ({"presets": presets, "rows": rows, "fused_loss": axis, "targets": targets, "runs": runs},
                format_targets(targets) or None)


class SingleSession:
    """The runs of one preset on one process: the prepared model (the kit's arms and the guide), the plain
    loop's and Trainer's copies, the data of every K.

    Attributes:
        info: what the preset's entry in ``bench.json`` starts with (shape, parameters, precision, peak FLOP/s...).
    """

    def __init__(self, cfg, preset: str, accelerator, kit_arms: dict, peak: dict):
        self.cfg, self.preset, self.accelerator, self.kit_arms = cfg, preset, accelerator, kit_arms
        self.device = device = accelerator.device
        plan = run_plan_of(accelerator)
        model = build_model(preset, cfg.vocab_size, cfg.block_size, seed=cfg.seed)
        if plan.gradient_checkpointing:  # every arm's copy checkpoints, not only the prepared one
            model = plan.engine.apply_activation_checkpointing(accelerator, model)
        model.to(device)
        modes = set(cfg.modes)
        self.plain_model = copy.deepcopy(model) if PLAIN in modes else None
        self.peer_model = copy.deepcopy(model) if "trainer" in modes else None  # Trainer prepares its own
        self.initial = [p.detach().clone() for p in model.parameters()]
        self.mixed_precision = accelerator.mixed_precision
        self.kit_model, self.kit_opt = accelerator.prepare(model, make_optimizer(cfg, model.parameters()))
        self.sched = None
        if "accelerate_guide" in modes:  # the guide's loop calls scheduler.step(): a constant one, prepared
            self.sched = accelerator.prepare(constant_schedule(self.kit_opt.optimizer))
        self.plain_opt = None if self.plain_model is None else make_optimizer(cfg, self.plain_model.parameters())

        # Data: the K-th dataloaders hold exactly (warm-up + measured) x K micro-batches.
        self.run_steps = cfg.warmup_steps + cfg.steps
        B, K_max = cfg.per_device_train_batch_size, max(cfg.accumulation_steps)
        tokens, labels = synthetic_rows(cfg, self.run_steps * K_max * B)
        self.data = {}
        for K in cfg.accumulation_steps:
            rows = TokenRows(tokens[: self.run_steps * K * B], labels[: self.run_steps * K * B])
            self.data[K] = {"rows": rows, "kit": accelerator.prepare(DataLoader(rows, batch_size=B, shuffle=False)),
                            "plain": DataLoader(rows, batch_size=B, shuffle=False)}
        self.memory = TrimmedPeakMemory(device)  # each run's peak from the memory in use at its start
        micro_tokens = B * cfg.block_size
        self.info = {"config": PRESETS[preset], "parameters": count_parameters(model),
                     "micro_batch": f"{B}x{cfg.block_size} tokens", "tokens_per_micro_batch": micro_tokens,
                     "vocab_size": cfg.vocab_size, "logits_fp32_bytes": micro_tokens * cfg.vocab_size * 4,
                     "device": str(device), "mixed_precision": self.mixed_precision, "optim": cfg.optim,
                     "max_grad_norm": cfg.max_grad_norm, "prepared_model": type(self.kit_model).__name__,
                     "kit_arms": {name: _loss_name(fn) for name, fn in kit_arms.items()},
                     "memory_method": self.memory.method, "peak_flops": peak,
                     "targets_per_micro_batch": float((labels[:, 1:] != -100).sum()) / (self.run_steps * K_max)}
        self.info["predicted_tensor_peak_mb"] = self.predicted_tensor_peaks(model)

    def predicted_tensor_peaks(self, model) -> dict | None:
        """Per arm, the rise of tensor memory the memory model predicts, MB: the gradients (made in the run: every
        arm sets them to None between windows) plus one micro-batch's activations with the arm's loss
        (:func:`accum_kit.bench.loss_axis.predicted_loss_memory`: the fused loss for a kit arm with
        ``train_loop``'s default, the logits for the others; the peers and ``plain`` compute the model's own loss
        from the logits), and for ``trainer``, whose AdamW is new every run, AdamW's two float32 moments.
        None when the model's config is not one the memory model reads."""
        cfg = self.cfg
        head = model.get_output_embeddings()
        loss = predicted_loss_memory(model.config.to_dict(), cfg.per_device_train_batch_size, cfg.block_size,
                                     element_bytes=compute_element_bytes(self.accelerator),
                                     checkpointing=run_plan_of(self.accelerator).gradient_checkpointing,
                                     head_bias=getattr(head, "bias", None) is not None)
        if loss is None:
            return None
        trainable = [p for p in model.parameters() if p.requires_grad]
        grads = sum(p.numel() * p.element_size() for p in trainable) / 2**20
        moments = 8 * sum(p.numel() for p in trainable) / 2**20
        out = {}
        for arm in self.cfg.modes:
            fused = arm in self.kit_arms and self.kit_arms[arm] is None
            out[arm] = grads + (loss["fused_mb"] if fused else loss["logits_mb"]) + (moments if arm == "trainer" else 0)
        return {"mb": out, "loss": loss, "gradients_mb": grads}

    def train(self, arm: str, K: int, clock: StepClock) -> list[float]:
        """Run ``arm`` at ``K`` (``--warmup_steps`` + ``--steps`` optimizer steps, timed by ``clock``); its losses."""
        cfg, acc, data = self.cfg, self.accelerator, self.data[K]
        clip = cfg.max_grad_norm or None
        if arm in self.kit_arms:
            run_plan_of(acc).set_accumulation_steps(K)
            return train_loop(acc, self.kit_model, self.kit_opt, data["kit"], max_train_steps=self.run_steps,
                              max_grad_norm=clip, loss_fn=self.kit_arms[arm], callbacks=[clock],
                              progress=False).train_loss
        if arm == "accelerate_guide":
            return train_accelerate_guide(acc, self.kit_model, self.kit_opt, self.sched, data["kit"], K, [clock],
                                          max_grad_norm=clip)
        if arm == PLAIN:
            scaler = torch.amp.GradScaler(self.device.type) if self.mixed_precision == "fp16" else None
            return train_plain(self.plain_model, self.plain_opt, iter(data["plain"]), K, self.run_steps, self.device,
                               autocast_dtype=AUTOCAST.get(self.mixed_precision), scaler=scaler, max_grad_norm=clip,
                               callbacks=[clock])
        return train_trainer(self.peer_model, data["rows"], cfg, K, self.run_steps, acc, TrainerClock(clock),
                             optimizer=make_optimizer(cfg, self.peer_model.parameters()),
                             max_grad_norm=cfg.max_grad_norm, mixed_precision=self.mixed_precision)

    def reset(self, arm: str) -> None:
        """``arm``'s model back to the initial weights, its optimizer state zeroed (Trainer's: a fresh one per run)."""
        if arm == "trainer":
            reset_weights(self.peer_model, self.initial)
        elif arm == PLAIN:
            reset_training_state(self.plain_model, self.initial, self.plain_opt)
        else:
            reset_training_state(self.kit_model, self.initial, self.kit_opt)
        gc.collect()

    def one_run(self, arm: str, K: int) -> dict:
        """One timed run of ``arm`` at ``K`` from the initial weights and a zeroed optimizer state; its record."""
        clock = StepClock(self.device)
        self.reset(arm)
        self.memory.reset()
        t0 = time.perf_counter()
        losses = self.train(arm, K, clock)
        wall = time.perf_counter() - t0
        peak, increase = self.memory.peak()
        w = self.cfg.warmup_steps
        return {"preset": self.preset, "K": K, "mode": arm, "wall_seconds": wall, "losses": losses,
                "load_average_1min": load_average(), "peak_mb": peak, "peak_increase_mb": increase,
                "step_seconds": clock.seconds[w:], "step_cpu_seconds": clock.cpu_seconds[w:],
                "warmup_step_seconds": clock.seconds[:w]}

    def tensor_peaks(self) -> dict | None:
        """On the CPU, per K and arm, the peak of the tensors one untimed run makes (:mod:`.tensor_memory`), MB;
        None on CUDA, whose timed runs measure that already (``max_memory_allocated``)."""
        if self.device.type == "cuda":
            return None
        peaks = {}
        for K in self.cfg.accumulation_steps:
            for arm in self.cfg.modes:
                self.reset(arm)
                peaks.setdefault(str(K), {})[arm] = tensor_peak(lambda: self.train(arm, K, StepClock(self.device)))
        return {"method": TENSOR_METHOD, "mb": peaks}

    def warm_up(self) -> None:
        """One unrecorded run per arm: a fresh model's first steps pay page faults, allocator growth and
        (on a GPU) kernel selection that the per-run warm-up steps do not fully absorb; then, on the CPU, the
        tensor peaks (:meth:`tensor_peaks`)."""
        for arm in self.cfg.modes:
            self.one_run(arm, self.cfg.accumulation_steps[0])
        self.info["tensor_peak"] = self.tensor_peaks()

    def run_block(self, K: int, repeat: int, order: list[str]) -> list[dict]:
        """One run of every arm at ``K``, in ``order``."""
        return [self.one_run(arm, K) for arm in order]

    def close(self) -> dict:
        """Drop the preset's models, optimizers and dataloaders; returns the info."""
        for name in ("kit_model", "kit_opt", "sched", "plain_model", "plain_opt", "peer_model", "data", "initial"):
            setattr(self, name, None)
        self.accelerator.free_memory()
        return self.info


def _loss_name(fn) -> str:
    """How the JSON names a kit arm's loss: its qualified name, or ``train_loop's default``."""
    if fn is None:
        return "train_loop's default (accum_kit.core.loss.causal_lm_loss)"
    return getattr(fn, "__qualname__", None) or repr(fn)
