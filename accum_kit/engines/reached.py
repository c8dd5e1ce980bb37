"""Which parameters a window's backwards reached, on any rank: so that one no token reached holds no gradient at the
optimizer step, as in one big batch on one process (:mod:`accum_kit.engines.moe`).

For models with per-module experts only (:func:`accum_kit.engines.moe.expert_blocks`). To keep every rank's
reductions matched, DDP (the zero-gradient term) and FSDP2 (``set_reduce_scatter_unused_params``) give a parameter
without a gradient a zero one; an optimizer then steps it (weight decay, moments), where the big batch's optimizer
skips it (``torch.optim`` skips a parameter whose ``.grad`` is None). :class:`ReachedParameters` records, per
backward, the parameters the loss's autograd graph reaches (the traversal DDP's ``find_unused_parameters`` does),
ORs them over the ranks once per window (one all-reduce of one int32 per parameter, one host read), and sets
``.grad = None`` on the others after the boundary's reduction, whose gradient is then zero on every rank.

A parameter used inside reentrant activation checkpointing is not in the outer graph (its block is one
``CheckpointFunction`` node); the engines keep the zero gradients then (:func:`accum_kit.engines.moe.reentrant_checkpointing`).
"""

from __future__ import annotations


def reached_leaves(tensor) -> set[int]:
    """The ``id`` of every leaf tensor the autograd graph of ``tensor`` accumulates a gradient into (its
    ``AccumulateGrad`` nodes' ``variable``); empty when ``tensor`` has no ``grad_fn``.

    Cost: one visit per graph node, in Python: 0.08 ms for the 458 nodes of the ``small`` preset's loss (9 layers,
    1 x 64 tokens), 0.2 us a node, on one core of the 2-core CPU machine the benchmarks ran on.
    """
    root = getattr(tensor, "grad_fn", None)
    if root is None:
        return set()
    seen, stack, leaves = {root}, [root], set()
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return leaves


class ReachedParameters:
    """The trainable parameters of one prepared model that a window's backwards reached on any rank; at the window's
    boundary :meth:`drop_unreached` takes the gradient of the others.

    Args:
        pairs: a callable returning ``[(holder, leaf), ...]``, in the same order on every rank: ``holder`` the
            parameter whose ``.grad`` the optimizer steps, ``leaf`` the tensor autograd accumulates into during the
            forward (DDP: both the module's parameter, :func:`accum_kit.compat.unused_parameters.ddp_parameter_pairs`;
            FSDP2: the sharded parameter and its unsharded one,
            :func:`accum_kit.compat.unused_parameters.fsdp_parameter_pairs`; ``leaf`` None before the unit's first
            all-gather). Called at every :meth:`observe`, so leaves made later are found.
    """

    def __init__(self, pairs):
        self._pairs = pairs
        self._reached: list[bool] | None = None

    def observe(self, loss) -> None:
        """Record the parameters ``loss``'s graph reaches (before a backward of the window; the graph is freed after)."""
        leaves = reached_leaves(loss)
        pairs = self._pairs()
        if self._reached is None or len(self._reached) != len(pairs):
            self._reached = [False] * len(pairs)
        for i, (_, leaf) in enumerate(pairs):
            if leaf is not None and id(leaf) in leaves:
                self._reached[i] = True

    def drop_unreached(self, device=None) -> int:
        """After the window's boundary backward: OR this rank's record with every rank's (``all_reduce`` MAX over the
        default process group when several processes run; every rank must call it at the same boundary), set
        ``.grad = None`` on each parameter no rank reached, and start the next window's record. Returns how many
        gradients were dropped.

        Args:
            device: where the mask is reduced (the accelerator's device: nccl needs a CUDA tensor).
        """
        import torch
        import torch.distributed as dist

        pairs = self._pairs()
        reached = self._reached if self._reached is not None and len(self._reached) == len(pairs) else [False] * len(pairs)
        self._reached = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            mask = torch.tensor(reached, dtype=torch.int32, device=device)
            dist.all_reduce(mask, op=dist.ReduceOp.MAX)
            reached = [bool(r) for r in mask.tolist()]  # the one host read per window
        dropped = 0
        for (holder, _), hit in zip(pairs, reached):
            if not hit and holder.grad is not None:
                holder.grad = None
                dropped += 1
        return dropped
