"""The accumulation policies: what a window skips (gradient reduction) and keeps (gathered FSDP2 parameters).

Torch-free (``accum-kit plan`` uses it); :mod:`accum_kit.engines.fsdp2` applies them.

Under FSDP2 every process holds 1/W of each parameter. A micro-batch's
forward and backward all-gather the parameters of each FSDP unit (a layer,
or the root with what no layer owns) and the backward reduce-scatters the
gradients. Accumulating K micro-batches per optimizer step can trade
communication for memory in two places, and the policies name the choices:

``no_sync`` (the default, as under DDP)
    Skip the reduce-scatter on the K-1 non-boundary micro-batches
    (``FSDPModule.set_requires_gradient_sync(False)``, which
    ``Accelerator.no_sync`` calls). Every process then holds the *unsharded*
    gradients of the whole model until the boundary; parameters are still
    all-gathered for every forward and backward.
``sync_each_batch``
    Reduce-scatter after every micro-batch (Accelerate's
    ``GradientAccumulationPlugin(sync_each_batch=True)``): gradients stay
    sharded (1/W), at K reduce-scatters per window.
``no_sync_no_reshard_after_backward``
    ``no_sync``, and the parameters gathered for a non-boundary backward stay
    gathered until the next forward (``FSDPModule.set_reshard_after_backward(False)``
    inside the window). Saves the forward's all-gather of the units that
    would otherwise be resharded after the backward.
``no_sync_no_reshard``
    ``no_sync`` with the parameters gathered once per window and kept
    (``reshard_after_forward=False`` for the whole run, plus
    ``set_reshard_after_backward(False)`` inside the window): one all-gather
    per unit per window, DDP's memory for parameters and gradients during
    the window while the optimizer state stays sharded. FSDP1's ``no_sync``
    behaved this way ("both full params and full grads",
    https://github.com/facebookresearch/fairscale/pull/752).

``reduce_scatter_each_batch`` (HSDP only)
    Under HSDP (a 2-D mesh: sharded inside a shard group, replicated across
    replicas, see :mod:`accum_kit.engines.mesh`) a synchronised gradient crosses two
    links: a reduce-scatter inside the shard group and an all-reduce of the
    shard across the replicate group. This policy reduce-scatters on every
    micro-batch but all-reduces across replicas only on the boundary
    (``FSDPModule.set_requires_all_reduce(False)`` inside the window instead
    of ``set_requires_gradient_sync(False)``): gradients stay sharded (1/S of
    them held, the memory of ``sync_each_batch``) while the slow inter-node
    link carries one all-reduce per window (the traffic of ``no_sync``). The
    middle one of the three flavours HSDP's designers describe
    (https://github.com/pytorch/pytorch/pull/126166). Refused without a
    replicate group (plain FSDP2, DDP).

Under HSDP the other four keep their meaning: ``no_sync`` skips both
collectives inside the window, ``sync_each_batch`` runs both on every
micro-batch, and the two no-reshard policies keep parameters gathered.

Parameters do not change inside a window, so all five give the same update;
the boundary backward always reshards, so the optimizer step sees sharded
parameters and the next window gathers the updated ones. What each policy
costs, per window and per process, is :func:`accum_kit.engines.costs.policy_costs`
and docs/fsdp.md.

Torch's own description of the reshard switches: the ``FSDPModule`` API
reference (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html),
"set_reshard_after_backward ... can be used during gradient accumulation to
trade off higher memory for reduced communication".
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class AccumulationPolicy:
    """What one policy does inside an accumulation window.

    Attributes:
        name: the ``--accumulation_policy`` value.
        sync_each_batch: reduce (DDP: all-reduce; FSDP2: reduce-scatter) after every micro-batch.
        keep_params_after_backward: FSDP2 only: no reshard after a non-boundary backward.
        reshard_after_forward: FSDP2 only: the ``fully_shard`` setting the policy needs
            (True: the config must not turn it off; False: set for the run; None: the launch
            config's ``fsdp_reshard_after_forward``).
        fsdp_only: the policy has no meaning under DDP.
        help: one line for ``--help`` and the docs.
        hsdp_only: the policy needs a replicate group (HSDP); it then reduce-scatters on every
            micro-batch and defers only the all-reduce across replicas to the boundary.
    """

    name: str
    sync_each_batch: bool
    keep_params_after_backward: bool
    reshard_after_forward: bool | None
    fsdp_only: bool
    help: str
    hsdp_only: bool = False


POLICIES: dict[str, AccumulationPolicy] = {p.name: p for p in (
    AccumulationPolicy("no_sync", False, False, None, False,
                       "skip the gradient all-reduce / reduce-scatter on non-boundary micro-batches (default)"),
    AccumulationPolicy("sync_each_batch", True, False, None, False,
                       "reduce gradients after every micro-batch (FSDP2: gradients stay sharded; slower)"),
    AccumulationPolicy("no_sync_no_reshard_after_backward", False, True, True, True,
                       "FSDP2: no_sync, and parameters gathered for a backward are kept until the next forward"),
    AccumulationPolicy("no_sync_no_reshard", False, True, False, True,
                       "FSDP2: no_sync, and parameters are gathered once per window and kept until its last backward"),
    AccumulationPolicy("reduce_scatter_each_batch", False, False, None, True,
                       "HSDP: reduce-scatter in the shard group every micro-batch, all-reduce across replicas "
                       "on the boundary only", hsdp_only=True),
)}
DEFAULT_POLICY = "no_sync"


def policies_for(hybrid: bool) -> list[str]:
    """The policy names that apply to a sharded run: all five under HSDP (``hybrid``), else the four without
    ``reduce_scatter_each_batch``."""
    return [name for name, p in POLICIES.items() if hybrid or not p.hsdp_only]


def resolve_policy(accumulation_policy: str | None, sync_each_batch: bool = False) -> AccumulationPolicy:
    """The policy a run asked for: ``accumulation_policy``, or the older ``sync_each_batch`` switch.

    Raises:
        UsageError: unknown name, or ``sync_each_batch=True`` together with another policy.
    """
    if accumulation_policy is None:
        return POLICIES["sync_each_batch" if sync_each_batch else DEFAULT_POLICY]
    if accumulation_policy not in POLICIES:
        raise UsageError("--accumulation_policy", f"unknown policy {accumulation_policy!r}",
                         f"use one of {list(POLICIES)}")
    if sync_each_batch and accumulation_policy != "sync_each_batch":
        raise UsageError("--sync_each_batch", f"conflicts with --accumulation_policy {accumulation_policy}",
                         "pass only --accumulation_policy (sync_each_batch is one of its values)")
    return POLICIES[accumulation_policy]
