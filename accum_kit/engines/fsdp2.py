"""FSDP2 for accumulation: the plugin a policy needs, and the Accelerator that applies the policy.

The policies themselves (what each skips and keeps, and why) are described in
:mod:`accum_kit.engines.policies`; what each costs per window and per process is
:func:`accum_kit.engines.costs.policy_costs` and docs/fsdp.md.
"""

from __future__ import annotations

import contextlib

from accelerate import Accelerator

from ..errors import UsageError
from .policies import DEFAULT_POLICY, POLICIES, AccumulationPolicy, fsdp_launched


def fsdp_requested(fsdp_plugin=None) -> bool:
    """True when the run asked for FSDP: a plugin was passed, or ``accelerate launch`` set ``ACCELERATE_USE_FSDP=true``."""
    return fsdp_plugin is not None or fsdp_launched()


def fsdp_plugin_for(policy: AccumulationPolicy, fsdp_plugin=None, mixed_precision: str | None = None):
    """The ``FullyShardedDataParallelPlugin`` to build the Accelerator with, checked against ``policy``.

    Args:
        policy: the run's :class:`AccumulationPolicy`.
        fsdp_plugin: the caller's plugin, or None to read the launcher's ``FSDP_*`` variables
            (what ``accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml`` sets).
        mixed_precision: ``"no"``, ``"bf16"``, ``"fp16"`` (the Accelerator's). Unless the
            plugin has a mixed-precision policy already, low precision gets
            ``MixedPrecisionPolicy(param_dtype=<low>, reduce_dtype=float32, output_dtype=<low>)``: compute in
            low precision, gradients reduced and accumulated in float32 (under ``no_sync`` in
            FSDP2's ``unsharded_accumulated_grad``), as torchtitan's default
            ``mixed_precision_reduce = "float32"``. Accelerate's own default reduces in the low
            precision, which accumulates a window's gradients in bf16.

    Returns:
        The plugin (FSDP2), with ``reshard_after_forward`` set when the policy needs it.

    Raises:
        UsageError: FSDP1 (``fsdp_version: 1``), or a policy whose reshard setting contradicts
            the config's ``fsdp_reshard_after_forward``.
    """
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = fsdp_plugin if fsdp_plugin is not None else FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise UsageError("--fsdp_version", f"FSDP{plugin.fsdp_version} is not supported: accum-kit's accumulation "
                         "policies, its exactness tests and its profiler are built on FSDP2 (fully_shard)",
                         "set fsdp_version: 2 in the fsdp_config of the accelerate config (or pass "
                         "FullyShardedDataParallelPlugin(fsdp_version=2))")
    if policy.reshard_after_forward is False:
        plugin.reshard_after_forward = False
    elif policy.reshard_after_forward is True and plugin.reshard_after_forward is False:
        raise UsageError("--accumulation_policy", f"{policy.name} reshards after forward, but the accelerate "
                         "config sets fsdp_reshard_after_forward: false (parameters kept through the window "
                         "already)", "use --accumulation_policy no_sync_no_reshard, or set "
                         "fsdp_reshard_after_forward: true")
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision or "no")
    if low is not None and plugin.mixed_precision_policy is None:
        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32,
                                                             output_dtype=low)
    return plugin


class AccumulationAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` that applies an :class:`AccumulationPolicy` inside ``no_sync``.

    :func:`accum_kit.build_accelerator` returns one. It behaves exactly as an
    ``Accelerator`` except that, under FSDP2 with a policy that keeps
    parameters gathered, ``no_sync(model)`` (which ``accumulate(model)``
    enters on every non-boundary micro-batch) also calls
    ``model.set_reshard_after_backward(False)`` and restores ``True`` when it
    exits, so the boundary backward reshards before the optimizer step.

    Attributes:
        accumulation_policy: the :class:`AccumulationPolicy` of this run.
    """

    accumulation_policy: AccumulationPolicy = POLICIES[DEFAULT_POLICY]

    def prepare(self, *args, **kwargs):
        """``Accelerator.prepare``; under DeepSpeed the config's batch sizes are checked against the dataloader first."""
        if getattr(self, "deepspeed_plugin", None) is not None:
            from .deepspeed import check_batch_sizes

            check_batch_sizes(self, args)
        return super().prepare(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self, model):
        """``Accelerator.no_sync``, plus the policy's reshard switch under FSDP2 (see the class docstring).

        Under ``reduce_scatter_each_batch`` (HSDP) it skips only the all-reduce across replicas
        (``model.set_requires_all_reduce(False)``): the reduce-scatter inside the shard group runs.
        """
        if self.is_fsdp2 and self.accumulation_policy.hsdp_only:
            model.set_requires_all_reduce(False)
            try:
                yield
            finally:
                model.set_requires_all_reduce(True)
            return
        keep = self.is_fsdp2 and self.accumulation_policy.keep_params_after_backward
        if keep:
            model.set_reshard_after_backward(False)
        try:
            with super().no_sync(model):
                yield
        finally:
            if keep:
                model.set_reshard_after_backward(True)


def reduces_each_micro_batch(accelerator) -> bool:
    """Whether every micro-batch's backward reduces gradients now (``LoopState.sync``'s inside a window).

    True under ``sync_each_batch`` (several processes), under HSDP's
    ``reduce_scatter_each_batch`` (its reduce-scatter runs every micro-batch; only the all-reduce
    across replicas waits for the boundary) and under DeepSpeed ZeRO-2 and 3 (their gradients are
    partitioned, so every backward reduces them).
    """
    from ..compat import sync_each_batch

    plugin = getattr(accelerator, "deepspeed_plugin", None)
    if plugin is not None:
        return accelerator.num_processes > 1 and int(plugin.zero_stage) >= 2
    return sync_each_batch(accelerator) or (getattr(accelerator, "is_fsdp2", False)
                                            and getattr(accelerator, "accumulation_policy", None) is not None
                                            and accelerator.accumulation_policy.hsdp_only)


def policy_name(accelerator) -> str:
    """The accumulation policy in force now (``sync_each_batch`` while the A/B switch has it on)."""
    from ..compat import sync_each_batch

    if sync_each_batch(accelerator):
        return "sync_each_batch"
    policy = getattr(accelerator, "accumulation_policy", None)
    return policy.name if policy is not None else DEFAULT_POLICY


def fsdp_summary(accelerator) -> dict | None:
    """What ``train_summary.json`` records of the sharding: None for DDP / one process.

    Returns:
        ``{"version": 2, "mesh": {"dp_replicate_size", "dp_shard_size"}, "accumulation_policy": str,
        "reshard_after_forward": bool,
        "state_dict_type": str, "mixed_precision_policy": {param_dtype, reduce_dtype} | None}``.
    """
    if not getattr(accelerator, "is_fsdp2", False):
        return None
    from .mesh import run_mesh

    plugin = accelerator.state.fsdp_plugin
    mp = plugin.mixed_precision_policy
    return {
        "version": 2,
        "mesh": run_mesh(accelerator).to_dict(),
        "accumulation_policy": policy_name(accelerator),
        "reshard_after_forward": bool(plugin.reshard_after_forward),
        "state_dict_type": str(getattr(plugin.state_dict_type, "name", plugin.state_dict_type)),
        "mixed_precision_policy": None if mp is None else {
            "param_dtype": str(mp.param_dtype).replace("torch.", "") if mp.param_dtype else None,
            "reduce_dtype": str(mp.reduce_dtype).replace("torch.", "") if mp.reduce_dtype else None},
    }


def sharded_model(model):
    """The :class:`accum_kit.engines.costs.ShardedModel` of a prepared FSDP2 model (None if it is not one).

    Each unit is put under ``resharded`` or ``kept`` by its reshard-after-forward
    setting now; FSDP2 settles the root's at the first forward, so read after one
    for the split (the total P is right at any time).
    """
    from ..compat import fsdp_reshards_after_forward, fsdp_unit_parameters, fsdp_units
    from .costs import ShardedModel

    units = fsdp_units(model)
    if not units:
        return None
    return ShardedModel.from_units([{"parameters": fsdp_unit_parameters(g),
                                     "reshard_after_forward": fsdp_reshards_after_forward(g)} for _, g in units],
                                   source="the prepared model's FSDP2 units")


def element_bytes(accelerator, model) -> tuple[int, int, int]:
    """(b_p, b_c, b_r): bytes per stored parameter, per gathered parameter, per reduced gradient element.

    b_p from the parameters themselves; under FSDP2, b_c and b_r from the
    plugin's ``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``; FSDP2
    reduces in ``param_dtype`` when ``reduce_dtype`` is unset); otherwise both b_p.
    """
    b_p = next((p.element_size() for p in model.parameters()), 4)
    plugin = getattr(accelerator.state, "fsdp_plugin", None) if getattr(accelerator, "is_fsdp2", False) else None
    mp = getattr(plugin, "mixed_precision_policy", None)
    if mp is None:
        return b_p, b_p, b_p
    b_c = mp.param_dtype.itemsize if mp.param_dtype is not None else b_p
    b_r = mp.reduce_dtype.itemsize if mp.reduce_dtype is not None else b_c
    return b_p, b_c, b_r


def predicted_memory(accelerator, model, accumulation_steps: int) -> dict:
    """``{policy: PolicyCosts.to_dict()}`` for the run's policy and ``sync_each_batch``, as held between micro-batches.

    Under DeepSpeed one entry, the ZeRO stage (``"zero1"`` ...), from :func:`accum_kit.engines.costs.zero_costs`.

    Under FSDP2 from :func:`accum_kit.engines.costs.policy_costs` with the
    model's units and the run's mesh (HSDP: its replicate size); under DDP (and one process) every policy holds the full
    gradient, P b_p bytes, as ``.grad``. An empty dict if the model has no
    trainable parameter.
    """
    from .mesh import run_mesh
    from .costs import policy_costs

    plugin = getattr(accelerator, "deepspeed_plugin", None)
    if plugin is not None:  # DeepSpeed: the stage is the policy (ZeRO-3's ds_numel: the unpartitioned size)
        from .costs import zero_costs

        stage = f"zero{plugin.zero_stage}"
        P = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
        groups = len(getattr(getattr(model, "optimizer", None), "param_groups", None) or [None])
        return {stage: zero_costs(stage, P, world_size=accelerator.num_processes, accumulation_steps=accumulation_steps,
                                  param_groups=groups).to_dict()}
    layout = sharded_model(model)
    b_p, b_c, b_r = element_bytes(accelerator, model)
    names = {getattr(accelerator, "accumulation_policy", POLICIES[DEFAULT_POLICY]).name, "sync_each_batch"}
    if layout is not None:
        replicas = run_mesh(accelerator).replicate
        return {n: policy_costs(n, layout, world_size=accelerator.num_processes, accumulation_steps=accumulation_steps,
                                param_bytes=b_p, compute_bytes=b_c, reduce_bytes=b_r,
                                replicate_size=replicas).to_dict() for n in names}
    P = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not P:
        return {}
    grads = P * b_p if accumulation_steps >= 2 else 0
    return {n: {"policy": n, "gradient_bytes": grads, "gathered_parameter_bytes": 0,
                "formulas": {"gradients": f"P b_p = {P} x {b_p} (DDP: every process holds the full gradient)"}}
            for n in names}
