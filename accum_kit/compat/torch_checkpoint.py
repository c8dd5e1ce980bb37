"""torch's activation-checkpoint wrapper, a private module of torch.distributed (checked: torch 2.11 and 2.13).

``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper``
is what Accelerate (``fsdp2_apply_ac``) and torchtitan put around a transformer
block; it has no public name. It wraps a module so that its forward runs under
``torch.utils.checkpoint.checkpoint`` and its ``state_dict`` keys stay those of
the wrapped module (the ``_checkpoint_wrapped_module.`` prefix is removed by a
state-dict hook), so checkpoints written with and without it load into each other.
"""

from __future__ import annotations


def checkpoint_wrapper(module, *, use_reentrant: bool = False, **checkpoint_kwargs):
    """``module`` wrapped so that its forward is recomputed in backward (``torch.utils.checkpoint.checkpoint``).

    Args:
        module: an ``nn.Module`` (one transformer block).
        use_reentrant: torch's reentrant implementation (``CheckpointImpl.REENTRANT``) instead of the
            non-reentrant one (``NO_REENTRANT``, torch's recommendation and the default here).
        **checkpoint_kwargs: passed to ``torch.utils.checkpoint.checkpoint`` (``preserve_rng_state``,
            ``determinism_check``, ``debug``, ``early_stop``).

    Returns:
        The ``CheckpointWrapper`` module (put it in the parent's place with ``set_submodule``).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    impl = CheckpointImpl.REENTRANT if use_reentrant else CheckpointImpl.NO_REENTRANT
    return wrap(module, checkpoint_impl=impl, **checkpoint_kwargs)


def is_checkpoint_wrapper(module) -> bool:
    """Whether ``module`` is torch's ``CheckpointWrapper`` (what :func:`checkpoint_wrapper` and Accelerate's FSDP2
    activation checkpointing put around a block)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(module, CheckpointWrapper)
