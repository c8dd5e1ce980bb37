"""``accum-kit verify`` on a tensor or context parallel mesh: who reads which examples, and the miscount rows.

Under a mesh ``dp_replicate x dp_shard x cp x tp`` (FSDP2's, :class:`accum_kit.engines.mesh.Mesh`) only the
``R x S`` data-parallel ranks read different examples from the prepared DataLoader; the tp and cp ranks of a
data-parallel rank read the same ones (tp: the same tokens; cp: one slice of every sequence each). So verify
draws ``(K + r) x B x (R x S)`` examples, takes each example once for the oracle (one process per data-parallel
rank: the ranks of one are consecutive, tp and cp being the innermost mesh dimensions), and hands the loop a
normaliser whose sequence split (:meth:`accum_kit.core.token_ranks.TokenRanks.part`) reaches the collated
batch inside verify's ``{"index", "batch"}`` micro-batches.

The miscount rows (informational, never deciding ``passed``): the ``tokens`` pass again with the window's tokens
counted the way several public trainers count them (:func:`accum_kit.engines.model_parallel.miscounts`:
over every process under tp, over the local cp slice under cp), compared with the same oracle.

Without tp and cp every process reads its own examples and nothing here changes what verify does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.loss import WindowNormalizer
from ..core.token_ranks import TokenRanks
from ..engines.model_parallel import MISCOUNT_BUGS, miscounts

__all__ = ["MISCOUNT_BUGS", "MeshPlan", "mesh_plan", "one_per_data_parallel_rank"]


@dataclass
class MeshPlan:
    """How the run's processes share examples and tokens.

    Attributes:
        world_size: processes.
        data_parallel_size: processes reading different examples (``R x S`` under a mesh, else all).
        token_ranks: processes holding different tokens (``R x S x cp``, else all).
        gradient_mean_size: processes the engine averages each gradient over (FSDP2: ``R x S x cp``; DDP and
            DeepSpeed: all), the ``sum`` row's expected ratio being its inverse.
        mesh: the mesh's sizes (:meth:`accum_kit.engines.mesh.Mesh.to_dict`), None without a sharded mesh.
        ranks: the loop's token ranks (the engine's).
        miscounts: row name -> the token ranks of a public miscount (empty without tp and cp).
    """

    world_size: int
    data_parallel_size: int
    token_ranks: int
    gradient_mean_size: int
    mesh: dict | None
    ranks: TokenRanks | None = field(default=None, repr=False)
    miscounts: dict = field(default_factory=dict, repr=False)

    @property
    def model_parallel(self) -> bool:
        """True when some processes share examples (tp or cp)."""
        return self.data_parallel_size != self.world_size

    def normalizer(self, accelerator, mode: str, ranks: TokenRanks | None = None) -> WindowNormalizer | None:
        """The loop's normaliser for ``mode`` counting over ``ranks`` (None: the engine's ranks); None when the
        engine's own normaliser does (no miscount asked for and no sequence split to reach into the batch)."""
        if ranks is None:
            if self.ranks is None or self.ranks.split is None:
                return None
            ranks = self.ranks
        return WindowNormalizer(accelerator, mode, ranks=indexed(ranks), gradient_mean_size=self.gradient_mean_size)

    def part(self, batch):
        """This process's part of one of verify's micro-batches (its cp slice, the index kept)."""
        return batch if self.ranks is None else indexed(self.ranks).part(batch)


def mesh_plan(accelerator, engine) -> MeshPlan:
    """The :class:`MeshPlan` of a built Accelerator (before or after ``prepare``)."""
    mesh = engine.mesh(accelerator)
    world = accelerator.num_processes
    ranks = engine.token_ranks(accelerator)
    return MeshPlan(world_size=world, data_parallel_size=engine.data_parallel_size(accelerator),
                    token_ranks=ranks.size, gradient_mean_size=mesh.fsdp_size if mesh is not None else world,
                    mesh=None if mesh is None else {**mesh.to_dict(), "world_size": mesh.world_size},
                    ranks=ranks, miscounts=miscounts(accelerator, mesh))


def indexed(ranks: TokenRanks) -> TokenRanks:
    """``ranks`` with its split applied to the ``batch`` part of verify's ``{"index", "batch"}`` micro-batches."""
    if ranks.split is None:
        return ranks
    inner = ranks.split

    def split(batch):
        return {"index": batch["index"], "batch": inner(batch["batch"])}

    return type(ranks)(ranks.accelerator, group=ranks.group, size=ranks.size, cp=ranks.cp, split=split)


def one_per_data_parallel_rank(per_process: list, data_parallel_size: int) -> list:
    """What each data-parallel rank ran, from what every process ran (``gather_object``'s rank order).

    The processes of one data-parallel rank are consecutive (tp and cp are the innermost mesh dimensions,
    :class:`accum_kit.engines.mesh.Mesh`), and they must have run the same examples.

    Args:
        per_process: one entry per process, in rank order.
        data_parallel_size: processes reading different examples; divides ``len(per_process)``.

    Returns:
        ``per_process[::share]`` with ``share = len(per_process) // data_parallel_size``.

    Raises:
        RuntimeError: two processes of one data-parallel rank ran different examples.
    """
    share = len(per_process) // data_parallel_size
    for i, ran in enumerate(per_process):
        if ran != per_process[i - i % share]:
            raise RuntimeError(f"process {i} ran other examples than process {i - i % share}, which reads the same "
                               f"data-parallel rank's micro-batches ({share} processes per data-parallel rank)")
    return per_process[::share]
