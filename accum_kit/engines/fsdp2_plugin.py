"""The ``FullyShardedDataParallelPlugin`` an accumulation policy needs: FSDP2 only, the policy's reshard setting,
and float32 reduction under low precision (:func:`fsdp_plugin_for`)."""

from __future__ import annotations

from ..errors import UsageError
from .policies import AccumulationPolicy


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
    return with_mixed_precision(checked_plugin(policy, fsdp_plugin), mixed_precision)


def checked_plugin(policy: AccumulationPolicy, fsdp_plugin=None):
    """The caller's (or the launcher's) plugin, refused if it is not FSDP2 or contradicts ``policy``'s reshard
    setting, and given the reshard setting the policy needs (see :func:`fsdp_plugin_for`)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

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
    return plugin


def with_mixed_precision(plugin, mixed_precision: str | None):
    """``plugin`` with the mixed-precision policy low precision needs, unless it has one (see :func:`fsdp_plugin_for`)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision or "no")
    if low is not None and plugin.mixed_precision_policy is None:
        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32,
                                                             output_dtype=low)
    return plugin
