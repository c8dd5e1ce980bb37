"""Where a run is in its data: epoch, micro-batches done, and the RNG that orders the epoch.

:class:`DataCursor` is what lets a checkpoint taken mid-epoch resume on the
very next micro-batch with the same order (:mod:`accum_kit.core.checkpoint` saves
its position and :func:`rng_snapshot`).
"""

from __future__ import annotations

import torch

from ..compat import shuffle_generators
from ..errors import UsageError


def rng_snapshot(dataloader) -> dict:
    """The global torch RNG state and the dataloader's shuffling generators' states (what decides an epoch's order)."""
    return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in shuffle_generators(dataloader)]}


def rng_restore(dataloader, snap: dict) -> None:
    """Put back a :func:`rng_snapshot`.

    Raises:
        UsageError (``--resume_from_checkpoint``): the dataloader has another number of shuffling generators.
    """
    torch.set_rng_state(snap["torch"])
    gens = shuffle_generators(dataloader)
    if len(gens) != len(snap["generators"]):
        raise UsageError("--resume_from_checkpoint", f"the checkpoint holds {len(snap['generators'])} shuffling "
                         f"generator(s) but this dataloader has {len(gens)}", "build the dataloader as the saved run did")
    for g, s in zip(gens, snap["generators"]):
        g.set_state(s)


class DataCursor:
    """The loop's way through the data: epoch, micro-batches done in it, and a mid-epoch resume.

    :meth:`batches` calls ``set_epoch`` (reshuffle, as in Accelerate's
    examples), snapshots the RNG that decides the epoch's order, and yields
    the epoch's batches. After :meth:`resume_at` the first epoch restores the
    saved snapshot and skips the consumed batches with Accelerate's
    ``skip_first_batches``; before its first batch the global torch RNG is
    set back to the state saved with the checkpoint (dropout then continues
    where the saved run was), since iterating may draw from it.

    Args:
        dataloader: the prepared train dataloader.
    """

    def __init__(self, dataloader):
        self.dataloader = dataloader
        self.batches_per_epoch = len(dataloader)
        dataset = getattr(dataloader, "dataset", None)  # examples: what a re-split resume compares (auto_batch)
        self.examples_per_epoch = len(dataset) if hasattr(dataset, "__len__") else None
        self.epoch, self.position = 0, 0  # position: micro-batches of ``epoch`` done on this process
        self.epoch_rng: dict | None = None
        self._resume: tuple | None = None
        self._active = None

    @property
    def epoch_done(self) -> bool:
        return self.position >= self.batches_per_epoch

    def resume_at(self, epoch: int, position: int, epoch_rng: dict, rng_now: torch.Tensor) -> None:
        """Make the next :meth:`batches` call continue epoch ``epoch`` after ``position`` batches."""
        self.epoch, self.position, self._resume = epoch, position, (position, epoch_rng, rng_now)

    def batches(self, epoch: int):
        """Yield the batches of ``epoch`` that are still to run."""
        dl = self.dataloader
        if hasattr(dl, "set_epoch"):
            dl.set_epoch(epoch)
        skip, rng_at_save = 0, None
        if self._resume is not None:
            (skip, epoch_rng, rng_at_save), self._resume = self._resume, None
            # The epoch's order is drawn when its iterator starts: from the sampler's generator, or (one
            # process, no generator) from the global torch RNG. Put both back as they were at the epoch start.
            rng_restore(dl, epoch_rng)
            if skip:
                from accelerate import skip_first_batches

                dl = skip_first_batches(dl, skip)
        self.epoch, self.position = epoch, skip
        self.epoch_rng = rng_snapshot(self.dataloader)
        self._active = dl
        for i, batch in enumerate(dl):
            if i == 0 and skip:
                torch.set_rng_state(rng_at_save)  # then continue the global RNG (dropout) where the save left it
            self.position += 1
            yield batch

    @property
    def active(self):
        """The dataloader being iterated (a skipping copy during a resumed epoch)."""
        return self._active if self._active is not None else self.dataloader
