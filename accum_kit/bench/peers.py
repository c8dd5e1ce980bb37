"""The bench's peers: what users would pick instead of accum-kit, run on the same model, data, K, seed and DDP settings.

``accelerate_guide``
    The loop of Accelerate's gradient accumulation guide
    (https://huggingface.co/docs/accelerate/usage_guides/gradient_accumulation),
    written as the guide writes it: for every micro-batch,
    ``with accelerator.accumulate(model):`` forward (the model's own mean loss
    over the micro-batch's targets), ``accelerator.backward(loss)``,
    ``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()``
    (Accelerate skips the last three and DDP's all-reduce except on the
    window's last micro-batch). It runs on the same prepared model and
    AdamW as the toolkit modes, with a constant ``LambdaLR`` scheduler. Its
    update is the mean of the W x K micro-batch means ("mean of means"); its
    per-step loss is reported the same way (the window's micro-batch losses
    averaged over micro-batches and processes, gathered after the run so the
    timed loop has no collective the guide does not have).
``trainer``
    ``transformers.Trainer`` on a fresh copy of the model (like ``raw_ddp``,
    so its own DDP wrapper does not share parameters with the toolkit's):
    ``per_device_train_batch_size``, ``gradient_accumulation_steps`` = K,
    ``max_steps``, a sequential sampler, ``average_tokens_across_devices=True``,
    ``max_grad_norm=0`` (no clipping, as in the other modes), the same DDP
    bucket size, static-graph and find-unused-parameters settings,
    ``logging_steps=1`` (its per-step loss), ``report_to="none"``, no
    checkpoints, and the same AdamW (a fresh one per run, i.e. zero state)
    with a constant ``LambdaLR``. Trainer prefetches each window, all-gathers
    its label count, runs the non-final micro-batches under ``no_sync`` and
    computes the gradient norm before every optimizer step. A new Trainer
    (hence a new Accelerator and DDP wrapper) is built for every run, outside
    the timed steps; Accelerate's shared gradient-accumulation state is
    restored after it (:func:`accum_kit.compat.keep_gradient_plugin`).

Instrumentation: both peers carry the same instrumentation as the other
modes. ``accelerate_guide`` calls the loop callbacks (the
:class:`~accum_kit.profiler.CommProfiler` and the run's tag) at the same points
as :func:`accum_kit.train_loop`. For ``trainer``, :class:`TrainerHooks`
attaches a CommProfiler (comm hook around DDP's all-reduce) to Trainer's DDP
model at ``on_train_begin`` and drives the same phase timers from a forward
pre-hook and a forward hook on that model (micro-batch begin, forward end), a
wrapper around its Accelerator's ``backward`` (backward end; the optimizer
phase starts there, so it covers the gradient norm, ``optimizer.step``, the
scheduler and ``zero_grad``) and Trainer's ``on_step_end``. A step lasts from
the previous ``on_step_end`` to this one, so Trainer's prefetch, label-count
gather and per-step logging fall into ``other`` (time outside forward,
backward and optimizer phases).
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ..compat import keep_gradient_plugin
from ..core.callbacks import CallbackList, LoopState
from ..core.run_plan import run_plan_of
from ..profiler import CommProfiler


def constant_schedule(optimizer):
    """A ``LambdaLR`` that keeps every learning rate as set (the guide's loop calls ``scheduler.step()``)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def train_accelerate_guide(accelerator, model, optimizer, scheduler, dataloader, K: int, callbacks,
                           max_grad_norm: float | None = None) -> list[float]:
    """Accelerate's gradient accumulation guide's loop over every batch of ``dataloader``; per-step losses.

    Args:
        accelerator: the Accelerator that prepared ``model``, ``optimizer``,
            ``scheduler`` and ``dataloader`` (its run plan is set to ``K`` and ``no_sync`` here).
        model: a prepared causal LM that returns ``.loss`` given ``labels``.
        dataloader: a prepared DataLoader of ``{"input_ids", "labels"}`` with
            a multiple of ``K`` batches per process.
        K: gradient accumulation steps.
        callbacks: :class:`accum_kit.LoopCallback` instances (profiler first),
            called at the points :func:`accum_kit.train_loop` calls them.
        max_grad_norm: clip the gradient norm to this on the window's last micro-batch, as the guide does
            (``if accelerator.sync_gradients: accelerator.clip_grad_norm_(...)``); None or 0: no clipping.

    Returns:
        One loss per optimizer step: the mean over the window's micro-batches
        and over processes of each micro-batch's mean token loss, nats.
    """
    plan = run_plan_of(accelerator)
    plan.set_accumulation_steps(K)  # also restarts Accelerate's window counter
    plan.use_policy("no_sync")
    hooks, st, local = CallbackList(callbacks), LoopState(), []
    model.train()
    hooks("on_train_begin", st)
    for batch in dataloader:
        with accelerator.accumulate(model):
            st.boundary = st.sync = accelerator.sync_gradients
            hooks("on_micro_batch_begin", st)
            loss = model(**batch).loss
            hooks("on_forward_end", st)
            accelerator.backward(loss)
            hooks("on_backward_end", st)
            st.micro_step += 1
            local.append(loss.detach())
            if st.boundary:
                hooks("on_step_begin", st)
                if max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if st.boundary:
                st.step += 1
                hooks("on_step_end", st)
    hooks("on_train_end", st)
    # The reported loss, computed after the timed loop (the guide itself gathers nothing).
    means = torch.stack(local).double().view(-1, K).mean(dim=1)
    if dist.is_initialized():
        dist.all_reduce(means)
        means /= dist.get_world_size()
    return means.tolist()


class TrainerLosses(TrainerCallback):
    """Trainer callback that keeps Trainer's logged loss of every optimizer step (``logging_steps=1``).

    Attributes:
        trainer: the ``transformers.Trainer`` it serves (set before ``trainer.train()``, cleared after).
        losses: the logged loss of every optimizer step, nats.
    """

    def __init__(self):
        self.trainer, self.losses = None, []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


class TrainerHooks(TrainerLosses):
    """Trainer callback that drives accum-kit loop callbacks (profiler, tags) from a Trainer run.

    See the module docstring for where each loop hook fires. Set
    :attr:`trainer` before ``trainer.train()``.

    Args:
        accelerator: the bench's Accelerator (world size, device) for the profiler.
        hook: the DDP comm hook the profiler wraps (None: plain all-reduce).
        make_callbacks: ``profiler -> [loop callbacks]``, profiler first.

    Attributes:
        profiler: the :class:`~accum_kit.profiler.CommProfiler` of the run (set at train begin).
        losses: Trainer's logged loss of every optimizer step, nats.
    """

    def __init__(self, accelerator, hook, make_callbacks):
        super().__init__()
        self.accelerator, self.hook, self.make_callbacks = accelerator, hook, make_callbacks
        self.profiler, self.state = None, LoopState()
        self._loop, self._handles = None, []

    def on_train_begin(self, args, state, control, **kwargs):
        ddp = self.trainer.model_wrapped  # prepared (DDP-wrapped) before on_train_begin
        self.profiler = CommProfiler(self.accelerator, ddp, hook=self.hook, keep_records=None)
        self.profiler.mode = "no_sync"  # Trainer runs non-final micro-batches under no_sync
        self._loop = CallbackList(self.make_callbacks(self.profiler))
        self._handles = [ddp.register_forward_pre_hook(self._forward_begin), ddp.register_forward_hook(self._forward_end)]
        acc = self.trainer.accelerator
        backward = acc.backward

        def timed_backward(loss, **kw):
            backward(loss, **kw)
            self._backward_end()

        acc.backward = timed_backward  # this Trainer's own Accelerator, discarded after the run
        self._loop("on_train_begin", self.state)

    def _forward_begin(self, module, inputs):
        self.state.boundary = self.state.sync = bool(self.trainer.accelerator.sync_gradients)  # set by Trainer
        self._loop("on_micro_batch_begin", self.state)

    def _forward_end(self, module, inputs, output):
        self._loop("on_forward_end", self.state)

    def _backward_end(self):
        self._loop("on_backward_end", self.state)
        self.state.micro_step += 1
        if self.state.sync:
            self._loop("on_step_begin", self.state)

    def on_step_end(self, args, state, control, **kwargs):
        self.state.step += 1
        self._loop("on_step_end", self.state)

    def on_train_end(self, args, state, control, **kwargs):
        self._loop("on_train_end", self.state)
        for h in self._handles:
            h.remove()
        self._handles = []
        self.trainer.accelerator.__dict__.pop("backward", None)


def run_trainer(model, dataset, cfg, K: int, steps: int, accelerator, hook, make_callbacks) -> tuple[list, CommProfiler]:
    """One Trainer run of ``steps`` optimizer steps over ``dataset`` under DDP, instrumented as the other modes
    (:class:`TrainerHooks`); returns (per-step losses, its profiler). Arguments: see :func:`train_trainer`;
    ``accelerator``, ``hook``, ``make_callbacks``: see :class:`TrainerHooks`.

    Raises:
        RuntimeError: Trainer logged a different number of losses than ``steps``.
    """
    hooks = TrainerHooks(accelerator, hook, make_callbacks)
    return train_trainer(model, dataset, cfg, K, steps, accelerator, hooks), hooks.profiler


def train_trainer(model, dataset, cfg, K: int, steps: int, accelerator, callback: TrainerLosses, *,
                  optimizer=None, max_grad_norm: float = 0.0, mixed_precision: str = "no") -> list[float]:
    """One Trainer run of ``steps`` optimizer steps over ``dataset``; returns its per-step losses.

    Args:
        model: the peer copy of the preset model, weights already reset.
        dataset: map-style dataset of ``{"input_ids", "labels"}`` rows, exactly
            ``steps`` x K x world size x batch size of them, in the order the
            toolkit's prepared DataLoader shards them.
        cfg: the bench's :class:`~accum_kit.bench.bench_config.BenchConfig`.
        accelerator: the bench's Accelerator (its gradient-accumulation state is restored after the run; its
            device decides ``use_cpu``).
        callback: a :class:`TrainerLosses` (it collects the losses; :attr:`TrainerLosses.trainer` is set for the run).
        optimizer: the optimizer over ``model``'s parameters, fresh (zero state); None: ``torch.optim.AdamW``
            at ``cfg.learning_rate``, as the other modes.
        max_grad_norm: Trainer's ``max_grad_norm`` (0: no clipping).
        mixed_precision: ``"no"``, ``"bf16"`` or ``"fp16"``: Trainer's ``bf16`` / ``fp16``.

    Raises:
        RuntimeError: Trainer logged a different number of losses than ``steps``.
    """
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)  # as the other modes, zero state
    with tempfile.TemporaryDirectory() as out, keep_gradient_plugin(accelerator):
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=cfg.per_device_train_batch_size,
            gradient_accumulation_steps=K, max_steps=steps, learning_rate=cfg.learning_rate,
            lr_scheduler_type="constant", max_grad_norm=max_grad_norm, average_tokens_across_devices=True,
            train_sampling_strategy="sequential", remove_unused_columns=False, report_to="none",
            save_strategy="no", logging_strategy="steps", logging_steps=1, disable_tqdm=True,
            dataloader_num_workers=0, dataloader_pin_memory=False, seed=cfg.seed,
            ddp_find_unused_parameters=cfg.ddp_find_unused_parameters, ddp_bucket_cap_mb=cfg.ddp_bucket_cap_mb,
            ddp_static_graph=True if cfg.ddp_static_graph else None,
            bf16=mixed_precision == "bf16", fp16=mixed_precision == "fp16",
            use_cpu=accelerator.device.type == "cpu")
        trainer = Trainer(model=model, args=args, train_dataset=dataset,
                          optimizers=(optimizer, constant_schedule(optimizer)), callbacks=[callback])
        trainer.remove_callback(PrinterCallback)
        callback.trainer = trainer
        try:
            trainer.train()
        finally:
            trainer.accelerator.free_memory()
            callback.trainer = None  # break the trainer <-> callback cycle
    if len(callback.losses) != steps:
        raise RuntimeError(f"Trainer logged {len(callback.losses)} losses for {steps} steps")
    return callback.losses
