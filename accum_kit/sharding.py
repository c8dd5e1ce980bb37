"""FSDP2 for accumulation: the plugin a policy needs, and the Accelerator that applies the policy.

The policies themselves (what each skips and keeps, and why) are described in
:mod:`accum_kit.policies`; what each costs per window and per process is
:func:`accum_kit.planning.fsdp.policy_costs` and docs/fsdp.md.
"""

from __future__ import annotations

import contextlib
import os

from accelerate import Accelerator

from .errors import UsageError
from .policies import DEFAULT_POLICY, POLICIES, AccumulationPolicy


def fsdp_requested(fsdp_plugin=None) -> bool:
    """True when the run asked for FSDP: a plugin was passed, or ``accelerate launch`` set ``ACCELERATE_USE_FSDP=true``."""
    return fsdp_plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_plugin_for(policy: AccumulationPolicy, fsdp_plugin=None, mixed_precision: str | None = None):
    """The ``FullyShardedDataParallelPlugin`` to build the Accelerator with, checked against ``policy``.

    Args:
        policy: the run's :class:`AccumulationPolicy`.
        fsdp_plugin: the caller's plugin, or None to read the launcher's ``FSDP_*`` variables
            (what ``accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml`` sets).
        mixed_precision: ``"no"``, ``"bf16"``, ``"fp16"`` (the Accelerator's). Unless the
            plugin has a mixed-precision policy already, low precision gets
            ``MixedPrecisionPolicy(param_dtype=<low>, reduce_dtype=float32)``: compute in
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

    @contextlib.contextmanager
    def no_sync(self, model):
        """``Accelerator.no_sync``, plus the policy's reshard switch under FSDP2 (see the class docstring)."""
        keep = self.is_fsdp2 and self.accumulation_policy.keep_params_after_backward
        if keep:
            model.set_reshard_after_backward(False)
        try:
            with super().no_sync(model):
                yield
        finally:
            if keep:
                model.set_reshard_after_backward(True)


def policy_name(accelerator) -> str:
    """The accumulation policy in force now (``sync_each_batch`` while the A/B switch has it on)."""
    from .compat import sync_each_batch

    if sync_each_batch(accelerator):
        return "sync_each_batch"
    policy = getattr(accelerator, "accumulation_policy", None)
    return policy.name if policy is not None else DEFAULT_POLICY


def fsdp_summary(accelerator) -> dict | None:
    """What ``train_summary.json`` records of the sharding: None for DDP / one process.

    Returns:
        ``{"version": 2, "accumulation_policy": str, "reshard_after_forward": bool,
        "state_dict_type": str, "mixed_precision_policy": {param_dtype, reduce_dtype} | None}``.
    """
    if not getattr(accelerator, "is_fsdp2", False):
        return None
    plugin = accelerator.state.fsdp_plugin
    mp = plugin.mixed_precision_policy
    return {
        "version": 2,
        "accumulation_policy": policy_name(accelerator),
        "reshard_after_forward": bool(plugin.reshard_after_forward),
        "state_dict_type": str(getattr(plugin.state_dict_type, "name", plugin.state_dict_type)),
        "mixed_precision_policy": None if mp is None else {
            "param_dtype": str(mp.param_dtype).replace("torch.", "") if mp.param_dtype else None,
            "reduce_dtype": str(mp.reduce_dtype).replace("torch.", "") if mp.reduce_dtype else None},
    }
