"""The device mesh a sharded run asks for (HSDP, tensor and context parallel), checked before the Accelerator is built.

Under HSDP every parameter is sharded over the ``dp_shard`` processes of a
*shard group* (on GPUs: the GPUs of one machine, joined by fast links) and
replicated over the ``dp_replicate`` shard groups (across machines, over the
slower network). A gradient is reduce-scattered inside the shard group and
the resulting shard all-reduced across the *replicate group* (the processes
holding the same shard in every replica). torchtitan's multi-node default;
Accelerate spells it ``ParallelismConfig(dp_replicate_size, dp_shard_size)``
(https://huggingface.co/docs/accelerate/concept_guides/fsdp1_vs_fsdp2 and
torch's ``fully_shard(mesh=<2-D mesh>)``, whose first dimension replicates).

A run asks for it in one of two ways: ``accelerate launch`` with an accelerate
config holding ``parallelism_config: {parallelism_config_dp_replicate_size: R,
parallelism_config_dp_shard_size: S}`` (accelerate_configs/cpu_hsdp.yaml) or
the launch flags of the same names, which export
``ACCELERATE_USE_PARALLELISM_CONFIG=true`` and ``PARALLELISM_CONFIG_*``; or
``build_accelerator(parallelism_config=ParallelismConfig(...))``.

Tensor parallel (``tp_size``) and context parallel (``cp_size``) add two dimensions to the same mesh
(accelerate_configs/cpu_tp.yaml, cpu_cp.yaml; :mod:`accum_kit.engines.model_parallel` says what each does
to the model and to the token count).

Rank layout (Accelerate's mesh, row-major over ``(dp_replicate, dp_shard)``):
rank ``r`` is shard ``r % S`` of replica ``r // S``, so the shard groups are
consecutive ranks, i.e. the processes of one machine when ``S`` equals the
processes per machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import UsageError

#: The launch flags (and accelerate-config keys) that size the mesh.
REPLICATE_FLAG = "--parallelism_config_dp_replicate_size"
SHARD_FLAG = "--parallelism_config_dp_shard_size"
TP_FLAG = "--parallelism_config_tp_size"
CP_FLAG = "--parallelism_config_cp_size"
SP_FLAG = "--parallelism_config_sp_size"


@dataclass(frozen=True)
class Mesh:
    """The device mesh of a sharded run: ``replicate`` x ``shard`` x ``cp`` x ``tp`` processes.

    Attributes:
        replicate: processes holding the same shard (the replicate group's size, R); 1 for plain FSDP2.
        shard: processes a parameter is sharded over by data parallelism (the shard group's size, S).
        tp: tensor-parallel processes (1: none): they split every weight matrix and see the *same* tokens.
        cp: context-parallel processes (1: none): each holds a slice of every sequence of its data-parallel
            rank's micro-batch; FSDP2 shards over ``shard x cp`` (Accelerate's ``dp_shard_cp``).

    Rank layout (Accelerate's, row-major over ``(dp_replicate, dp_shard, cp, tp)``): tp is the innermost
    dimension, so the tp ranks of a group are consecutive.
    """

    replicate: int
    shard: int
    tp: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        """R x S x cp x tp: every process of the run."""
        return self.replicate * self.shard * self.cp * self.tp

    @property
    def data_parallel_size(self) -> int:
        """R x S: the ranks that read different micro-batches from the dataloader."""
        return self.replicate * self.shard

    @property
    def token_ranks(self) -> int:
        """R x S x cp: the ranks that hold different tokens; a window's tokens are counted over these, never over tp."""
        return self.replicate * self.shard * self.cp

    @property
    def fsdp_size(self) -> int:
        """R x S x cp: the processes FSDP2 averages a gradient over (its mesh ``(dp_replicate, dp_shard_cp)``)."""
        return self.replicate * self.shard * self.cp

    @property
    def is_hybrid(self) -> bool:
        """True when gradients cross two links: reduce-scatter in the shard group, all-reduce across replicas."""
        return self.replicate > 1

    def to_dict(self) -> dict:
        out = {"dp_replicate_size": self.replicate, "dp_shard_size": self.shard}
        if self.tp > 1 or self.cp > 1:
            out.update(tp_size=self.tp, cp_size=self.cp)
        return out


def parallelism_requested(parallelism_config=None) -> bool:
    """True when the run passed a ``ParallelismConfig`` or ``accelerate launch`` exported one."""
    return parallelism_config is not None or \
        os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"


def launched_replicas() -> int:
    """R of the mesh ``accelerate launch`` exported (``PARALLELISM_CONFIG_DP_REPLICATE_SIZE``); 1 without one."""
    if not parallelism_requested():
        return 1
    value = os.environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")
    return int(value) if value.isdigit() else 1


def resolve_parallelism_config(parallelism_config, *, world_size: int, fsdp: bool):
    """The caller's (or the launcher's) ``ParallelismConfig``, checked; None when the run asked for none.

    Args:
        parallelism_config: an ``accelerate.ParallelismConfig`` or None (then the launcher's
            ``PARALLELISM_CONFIG_*`` variables are read, when ``ACCELERATE_USE_PARALLELISM_CONFIG`` is set).
        world_size: the number of processes launched.
        fsdp: whether the run is sharded with FSDP2 (an FSDP config or plugin).

    Returns:
        The ``ParallelismConfig`` (Accelerate's), or None.

    Raises:
        UsageError: Accelerate's sequence parallel (``sp_size`` > 1: DeepSpeed-only, use ``cp_size``); tensor or
            context parallel without FSDP2; a mesh whose product is not ``world_size``; ``dp_replicate_size > 1`` with ``dp_shard_size == 1``
            (that is DDP); a parallelism config without FSDP2.
    """
    if not parallelism_requested(parallelism_config):
        return None
    from accelerate import ParallelismConfig

    pc = parallelism_config if parallelism_config is not None else ParallelismConfig()
    if getattr(pc, "sp_size", 1) > 1:
        raise UsageError(SP_FLAG, f"is {pc.sp_size}: Accelerate's sp (DeepSpeed's Ulysses) runs only under its "
                         "DeepSpeed engine, whose accumulation accum-kit drives without a device mesh",
                         f"split sequences with {CP_FLAG} {pc.sp_size} under FSDP2 (accelerate_configs/cpu_cp.yaml: "
                         "the same Ulysses all-to-all, exact and counted once), or set sp_size 1")
    if not fsdp and (pc.tp_size > 1 or pc.cp_size > 1):
        flag = TP_FLAG if pc.tp_size > 1 else CP_FLAG
        raise UsageError(flag, "tensor and context parallel run on FSDP2's device mesh, and this run is not an "
                         "FSDP2 run (DeepSpeed and DDP have no such mesh here)", "launch with accelerate_configs/"
                         "cpu_tp.yaml or cpu_cp.yaml (distributed_type: FSDP, fsdp_version: 2), or set it to 1")
    mesh = Mesh(pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size)
    if mesh.world_size != world_size:
        sizes = " x ".join(f"{n} {v}" for n, v in (("dp_replicate", mesh.replicate), ("dp_shard", mesh.shard),
                                                   ("cp", mesh.cp), ("tp", mesh.tp)) if v > 1 or n == "dp_shard")
        flags = f"{REPLICATE_FLAG} / {SHARD_FLAG}" + (f" / {TP_FLAG} / {CP_FLAG}" if mesh.tp * mesh.cp > 1 else "")
        raise UsageError(flags, f"{sizes} = {mesh.world_size} processes, but {world_size} were launched",
                         f"choose sizes whose product is --num_processes ({world_size}), e.g. "
                         f"{REPLICATE_FLAG} <machines> {SHARD_FLAG} <processes per machine>")
    if mesh.replicate > 1 and mesh.shard == 1:
        raise UsageError(SHARD_FLAG, f"is 1 with dp_replicate_size {mesh.replicate}: every process would hold "
                         "the whole model, which is DDP", "launch with accelerate_configs/cpu_ddp.yaml (or "
                         "gpu_ddp.yaml) for DDP, or set dp_shard_size > 1 for HSDP")
    if mesh.shard == 1 and mesh.cp == 1 and mesh.tp > 1:
        raise UsageError(SHARD_FLAG, f"is 1 with tp_size {mesh.tp}: FSDP2 would have no dimension to shard over",
                         f"set {SHARD_FLAG} to --num_processes / tp_size (accelerate_configs/cpu_tp.yaml: 2 x 2)")
    if not fsdp:
        raise UsageError(REPLICATE_FLAG, "a parallelism config shards the model with FSDP2, but this run is not "
                         "an FSDP run", "launch with accelerate_configs/cpu_hsdp.yaml (distributed_type: FSDP, "
                         "fsdp_version: 2), or drop the parallelism config for DDP")
    return pc


def run_mesh(accelerator) -> Mesh | None:
    """The :class:`Mesh` of a prepared run: None unless it is sharded with FSDP2.

    Plain FSDP2 is ``Mesh(1, num_processes)``; HSDP reads the Accelerator's ``parallelism_config``.
    """
    if not getattr(accelerator, "is_fsdp2", False):
        return None
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None or pc.total_size != accelerator.num_processes:
        return Mesh(1, accelerator.num_processes)
    return Mesh(pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size)


class EmulatedInterNodeLink:
    """EMULATION, off unless asked for: a slow link under HSDP's all-reduce across replicas, on one machine.

    On one machine every process talks over loopback, so the case HSDP and
    ``reduce_scatter_each_batch`` exist for (fast links inside a machine, a
    slow network between machines) cannot show. While installed, every
    ``torch.distributed.all_reduce`` that FSDP2 runs on a unit's replicate
    group is followed by a sleep of what a ring all-reduce of its buffer would
    take at ``GBps`` (nccl-tests' bus bandwidth: ``2 (R - 1) / R x bytes /
    busbw``, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
    The sleep adds to the real loopback time; the shard group's collectives
    are untouched. For checking the planner against measurements, never for
    claiming speed: every report that used it says so.

    Args:
        model: the prepared FSDP2 model on a 2-D mesh.
        GBps: the emulated inter-node bus bandwidth, GB/s (1e9 bytes per second), > 0.

    Raises:
        UsageError: ``GBps`` not positive (``--emulate_inter_node_GBps``), or the model has no
            replicate group (not HSDP).
    """

    FLAG = "--emulate_inter_node_GBps"

    def __init__(self, model, GBps: float):
        from .. import checks
        from ..compat import fsdp_replicate_process_group, fsdp_units

        checks.positive(self.FLAG, GBps, fix="pass the emulated inter-node bus bandwidth in GB/s, e.g. 0.1")
        self.groups = [g for g in (fsdp_replicate_process_group(group) for _, group in fsdp_units(model))
                       if g is not None]
        if not self.groups:
            raise UsageError(self.FLAG, "emulates the link HSDP all-reduces over, and this run has no replicate "
                             "group", "launch with accelerate_configs/cpu_hsdp.yaml, or drop the flag")
        self.GBps = GBps
        self.seconds_added = 0.0  # total sleep, seconds
        self._inner = None

    def delay(self, nbytes: int, replicas: int) -> float:
        """Seconds a ring all-reduce of ``nbytes`` over ``replicas`` processes takes at the emulated busbw
        (:func:`accum_kit.engines.costs.all_reduce_seconds`)."""
        from .bandwidth import all_reduce_seconds

        return all_reduce_seconds(nbytes, replicas, self.GBps)

    def install(self) -> "EmulatedInterNodeLink":
        import time

        import torch.distributed as dist

        inner = self._inner = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            work = inner(tensor, *args, **kwargs)
            if any(group is g for g in self.groups):
                pause = self.delay(tensor.numel() * tensor.element_size(), dist.get_world_size(group))
                self.seconds_added += pause
                time.sleep(pause)
            return work

        dist.all_reduce = all_reduce
        return self

    def remove(self) -> None:
        import torch.distributed as dist

        if self._inner is not None:
            dist.all_reduce = self._inner
            self._inner = None
