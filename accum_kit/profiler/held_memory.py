"""What gradient accumulation holds in memory, measured: gradients and gathered parameters between micro-batches.

Between two micro-batches of a window the only state accumulation adds is
the gradient kept for the next micro-batch and, with the FSDP2 policies that
keep parameters gathered, those parameters. :class:`HeldMemory` counts the
bytes of the tensors actually held at that moment (after every non-boundary
backward), not the transient gradients of one layer during a backward nor
activations:

- FSDP2: every unit's sharded gradient shards, unsharded gradients
  (``unsharded_param.grad``), gradients accumulated in the reduce dtype
  (``unsharded_accumulated_grad``), the reduce-scattered shards summed
  until HSDP's deferred all-reduce (``partial_reduce_output``) and gathered
  parameters (:func:`accum_kit.compat.fsdp_held_tensors`);
- DeepSpeed: parameters' ``.grad`` and the ZeRO optimizer's reduced
  gradient partitions (:func:`accum_kit.compat.deepspeed_held_gradients`);
- DDP and one process: every parameter's ``.grad`` (DDP's communication
  buckets, another copy of the same size unless ``gradient_as_bucket_view``,
  are DDP's own and not counted).

Bytes are counted per storage, so views of one buffer count once. Next to
them: the process's peak (``VmHWM`` of ``/proc/self/status`` on CPU, i.e. the
resident set's high-water mark since the process started;
``torch.cuda.max_memory_allocated`` on CUDA).
"""

from __future__ import annotations

from ..core.callbacks import LoopCallback
from ..stats import spread

GRADIENT_KINDS = ("grad", "sharded_grad", "unsharded_grad", "accumulated_grad", "partial_reduce_output",
                  "partition_grad")


def held_tensors(model, engine=None):
    """Yield ``(kind, tensor)`` for the gradients (and FSDP2's gathered parameters) ``model`` holds now.

    Args:
        model: a prepared model.
        engine: the run's engine (:meth:`accum_kit.engines.base.Engine.held_tensors` says where it keeps
            them); None: the engine that prepared ``model`` (:func:`accum_kit.engines.engine_for_model`).
    """
    if engine is None:
        from ..engines import engine_for_model

        engine = engine_for_model(model)
    yield from engine.held_tensors(model)


def held_bytes(model, engine=None) -> dict:
    """Bytes held now by kind, counting each storage once: ``{kind: bytes}`` (kinds of :func:`held_tensors`)."""
    seen, out = set(), {}
    for kind, t in held_tensors(model, engine):
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out[kind] = out.get(kind, 0) + storage.nbytes()
    return out


def process_peak_bytes(device) -> tuple[int | None, str | None]:
    """(the process's peak memory in bytes, how it was read); (None, None) where neither way exists."""
    if getattr(device, "type", None) == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    kb = proc_status_kb("VmHWM")
    if kb is None:
        return None, None
    return kb * 1024, "VmHWM of /proc/self/status (resident set high-water mark)"


def proc_status_kb(key: str) -> int | None:
    """The ``key:`` line of ``/proc/self/status`` (Linux, ``proc(5)``) in kB, or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class HeldMemory(LoopCallback):
    """Loop callback: the most gradient bytes (and gathered parameter bytes) held between two micro-batches.

    Measures after every non-boundary backward (the boundary's gradients go
    to the optimizer step at once), per accumulation policy in force (an A/B
    run alternates two), and keeps the peak.

    Args:
        accelerator: the run's Accelerator (policy in force, device, processes).
        model: the prepared model.
        predicted: optional ``{policy: {"gradient_bytes", "gathered_parameter_bytes", ...}}`` put beside
            the measurement in :meth:`summary` (see :func:`accum_kit.engines.costs.policy_costs`), or a
            function returning it, called by :meth:`summary` (after training: FSDP2 settles its
            units' reshard settings at the first forward).
        predicted_peak: optional, called by :meth:`summary`: returns None or ``f(resident bytes before
            training) -> {part: bytes, "total"}``, the peak predicted by part (:func:`predicted_peak`).

    Attributes:
        peaks: ``{policy: {"gradient_bytes", "gathered_parameter_bytes", "by_kind", "measurements"}}``.
    """

    def __init__(self, accelerator, model, predicted: dict | None = None, predicted_peak=None):
        from ..core.run_plan import run_plan_of

        self.accelerator, self.model, self.predicted = accelerator, model, predicted
        self.predicted_peak = predicted_peak  # () -> (f(resident before training) -> {part: bytes}) | None
        self.plan = run_plan_of(accelerator)  # the engine holds the tensors; the policy in force names the peak
        self.peaks: dict[str, dict] = {}
        self.resident_before_training = self.gathered_before_training = None

    def on_train_begin(self, state):
        self.resident_before_training = process_resident_bytes(self.accelerator.device)
        # parameters left gathered before training (an evaluation under no_sync_no_reshard): resident already
        self.gathered_before_training = held_bytes(self.model, self.plan.engine).get("gathered_parameter", 0)

    def on_backward_end(self, state):
        if state.boundary or getattr(state, "forced_sync", False):  # a static-graph DDP model's priming sync is no policy's
            return
        held = held_bytes(self.model, self.plan.engine)
        grads = sum(v for k, v in held.items() if k in GRADIENT_KINDS)
        peak = self.peaks.setdefault(self.plan.policy.name, {
            "gradient_bytes": 0, "gathered_parameter_bytes": 0, "by_kind": {}, "measurements": 0})
        peak["measurements"] += 1
        if grads >= peak["gradient_bytes"]:
            peak["gradient_bytes"], peak["by_kind"] = grads, held
        peak["gathered_parameter_bytes"] = max(peak["gathered_parameter_bytes"], held.get("gathered_parameter", 0))

    def local(self) -> dict:
        """This process's figures: the run policy's peaks, every policy's, the process peak."""
        run_policy = self.plan.requested_policy.name
        mine = self.peaks.get(run_policy, {})
        peak, method = process_peak_bytes(self.accelerator.device)
        return {"policy": run_policy, "gradient_bytes": mine.get("gradient_bytes"),
                "gathered_parameter_bytes": mine.get("gathered_parameter_bytes"),
                "by_kind": mine.get("by_kind"), "by_policy": self.peaks,
                "process_peak_bytes": peak, "process_peak_method": method,
                "resident_before_training_bytes": self.resident_before_training,
                "gathered_before_training_bytes": self.gathered_before_training}

    def summary(self) -> dict:
        """The ``memory`` block of ``train_summary.json``; collective (every process must call it).

        Keys: ``policy``; ``gradient_bytes_peak`` and ``gathered_parameter_bytes_peak``
        (``{"min", "median", "max"}`` over processes of each one's peak between two
        micro-batches under the run's policy; None when no window has two micro-batches);
        ``process_peak_bytes`` (same form); ``process_peak_method``; ``by_kind`` (main
        process, at its gradient peak); ``by_policy`` (main process, every policy that ran,
        e.g. both sides of an A/B run); with ``predicted``: ``predicted`` (the run policy's
        figures) and ``measured_over_predicted`` (gradient bytes, median over processes); the peak per
        process and its prediction by part: the keys of :func:`peak_by_rank`.
        """
        local = self.local()
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            everyone = gather_object([local])
        else:
            everyone = [local]
        out = {"policy": local["policy"],
               "gradient_bytes_peak": spread(p["gradient_bytes"] for p in everyone),
               "gathered_parameter_bytes_peak": spread(p["gathered_parameter_bytes"] for p in everyone),
               "process_peak_bytes": spread(p["process_peak_bytes"] for p in everyone),
               "process_peak_method": local["process_peak_method"],
               "by_kind": local["by_kind"], "by_policy": local["by_policy"]}
        predicted = self.predicted() if callable(self.predicted) else self.predicted
        predicted = (predicted or {}).get(local["policy"])
        if predicted is not None:
            out["predicted"] = predicted
            measured = out["gradient_bytes_peak"]
            want = predicted.get("gradient_bytes")
            out["measured_over_predicted"] = measured["median"] / want if (measured and want) else None
        out.update(peak_by_rank(everyone, self.predicted_peak() if self.predicted_peak is not None else None))
        return out


def peak_by_rank(everyone: list[dict], predicted_peak) -> dict:
    """The summary's peak keys from every process's :meth:`HeldMemory.local` (rank order):

    ``process_peak_bytes_by_rank`` and ``resident_before_training_bytes_by_rank`` (lists, bytes); with
    ``predicted_peak`` (``f(resident before training) -> {part: bytes, "total"}``,
    :func:`accum_kit.engines.activation_memory.peak_parts`): ``predicted_peak_by_part`` (the main process's
    parts), ``predicted_peak_bytes_by_rank`` and ``peak_measured_over_predicted_by_rank`` (each process's
    measured peak over its own prediction, whose baseline is its own resident set before training less the
    gathered parameters it held then, which the prediction counts as a part of its own).
    """
    peaks = [p["process_peak_bytes"] for p in everyone]
    before = [p.get("resident_before_training_bytes") for p in everyone]
    out = {"process_peak_bytes_by_rank": peaks, "resident_before_training_bytes_by_rank": before}
    if predicted_peak is None:
        return out
    # the baseline leaves out what the prediction counts as its own parts: gathered parameters already held
    parts = [predicted_peak(None if b is None else b - (p.get("gathered_before_training_bytes") or 0))
             for b, p in zip(before, everyone)]
    out["predicted_peak_by_part"] = parts[0]
    out["predicted_peak_bytes_by_rank"] = [p["total"] for p in parts]
    out["peak_measured_over_predicted_by_rank"] = [m / p["total"] if (m and p["total"]) else None
                                                   for m, p in zip(peaks, parts)]
    return out


def process_resident_bytes(device) -> int | None:
    """The process's memory now, bytes: ``VmRSS`` of ``/proc/self/status`` on CPU, ``torch.cuda.memory_allocated``
    on CUDA (the counterparts of :func:`process_peak_bytes`); None where neither exists."""
    if getattr(device, "type", None) == "cuda":
        import torch

        return torch.cuda.memory_allocated(device)
    kb = proc_status_kb("VmRSS")
    return None if kb is None else kb * 1024


def predicted_memory(accelerator, model, accumulation_steps: int) -> dict:
    """``{policy: PolicyCosts.to_dict()}`` for the run's policy and ``sync_each_batch``: what each holds between
    micro-batches, in bytes, from the run's engine (:meth:`accum_kit.engines.base.Engine.predicted_memory`:
    FSDP2 and HSDP from the cost table per unit and mesh, DeepSpeed for its ZeRO stage only, DDP the whole gradient).

    Args:
        accelerator: the run's Accelerator; model: the prepared model; accumulation_steps: K of the largest window.
    """
    from ..core.run_plan import run_plan_of

    plan = run_plan_of(accelerator)
    names = list(dict.fromkeys([plan.requested_policy.name, "sync_each_batch"]))
    return plan.engine.predicted_memory(accelerator, model, accumulation_steps, names)


def with_adapters(shape, model):
    """``shape`` (:class:`accum_kit.engines.activation_memory.TransformerShape`) with ``model``'s LoRA adapters
    (a peft ``PeftModel``: its rank, targets and dropout) when it has some on GPT-2 block layers only; else
    ``shape``. Adapters elsewhere (the output layer) leave the count of full fine-tuning."""
    from ..errors import UsageError

    config = getattr(model, "peft_config", None)
    if not isinstance(config, dict) or not config or shape.family != "gpt2":
        return shape
    c = next(iter(config.values()))
    targets = c.target_modules
    targets = [targets] if isinstance(targets, str) else sorted(targets or ())
    try:
        return shape.with_lora(getattr(c, "r", 0), targets, getattr(c, "lora_dropout", 0.0) or 0.0)
    except UsageError:
        return shape


def predicted_peak(accelerator, model, accumulation_steps: int, micro_batch: int, seq: int, checkpointing: bool,
                   loss=None):
    """``f(resident before training) -> {part: bytes}``: the run policy's peak per process by part
    (:func:`accum_kit.engines.activation_memory.peak_parts`): the engine's cost-table row
    (:meth:`accum_kit.engines.base.Engine.window_costs`; K of at least 2, since a window of one still holds
    its gradients during the backward), its persistent communication buffers
    (:meth:`accum_kit.engines.base.Engine.communication_buffer_bytes`) and a micro-batch's activations from the
    model's config
    (:func:`accum_kit.engines.activation_memory.activation_bytes`, the element size of the compute precision),
    with the head priced for ``loss``: a :class:`accum_kit.core.loss.CausalLMLoss` (what it ran, read when the
    prediction is made) or its ``used`` record; None: the logits' cross-entropy.
    None when the model has no transformer config it can read.
    """
    from ..core.run_plan import run_plan_of
    from dataclasses import replace

    from ..engines.activation_memory import TransformerShape, activation_bytes, peak_parts
    from ..errors import UsageError

    def inner_output_layer(m):
        get = getattr(accelerator.unwrap_model(m), "get_output_embeddings", None)
        return get() if callable(get) else None

    plan = run_plan_of(accelerator)
    config = getattr(accelerator.unwrap_model(model), "config", None)
    try:
        shape = TransformerShape.from_config(config.to_dict() if config is not None else {},
                                             element_bytes=2 if plan.engine.compute_precision(accelerator) in
                                             ("bf16", "fp16") else 4)
    except UsageError:
        return None
    head = inner_output_layer(model)
    shape = shape.with_loss(getattr(loss, "used", loss))
    shape = with_adapters(shape, accelerator.unwrap_model(model))
    if head is not None and getattr(head, "bias", None) is not None:
        shape = replace(shape, head_bias=True)
    acts = activation_bytes(shape, micro_batch, seq, checkpointing=checkpointing)
    costs = plan.engine.window_costs(accelerator, model, max(2, accumulation_steps), plan.requested_policy.name)
    row = costs.to_dict()
    buffers = plan.engine.communication_buffer_bytes(accelerator, model, plan.requested_policy.name)
    return lambda before: peak_parts(row, acts, before, buffers)
