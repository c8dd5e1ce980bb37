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

    Attributes:
        peaks: ``{policy: {"gradient_bytes", "gathered_parameter_bytes", "by_kind", "measurements"}}``.
    """

    def __init__(self, accelerator, model, predicted: dict | None = None):
        from ..core.run_plan import run_plan_of

        self.accelerator, self.model, self.predicted = accelerator, model, predicted
        self.plan = run_plan_of(accelerator)  # the engine holds the tensors; the policy in force names the peak
        self.peaks: dict[str, dict] = {}

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
                "process_peak_bytes": peak, "process_peak_method": method}

    def summary(self) -> dict:
        """The ``memory`` block of ``train_summary.json``; collective (every process must call it).

        Keys: ``policy``; ``gradient_bytes_peak`` and ``gathered_parameter_bytes_peak``
        (``{"min", "median", "max"}`` over processes of each one's peak between two
        micro-batches under the run's policy; None when no window has two micro-batches);
        ``process_peak_bytes`` (same form); ``process_peak_method``; ``by_kind`` (main
        process, at its gradient peak); ``by_policy`` (main process, every policy that ran,
        e.g. both sides of an A/B run); with ``predicted``: ``predicted`` (the run policy's
        figures) and ``measured_over_predicted`` (gradient bytes, median over processes).
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
        return out


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
