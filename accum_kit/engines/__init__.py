"""The engines a run can train under, each one object that answers what differs between them.

- :mod:`.base`: :class:`~accum_kit.engines.base.Engine`, the protocol (and the plain data-parallel behaviour);
- :mod:`.ddp`: :class:`~accum_kit.engines.ddp.DDPEngine` (DDP and one process), DDP's constructor flags;
- :mod:`.fsdp2`: :class:`~accum_kit.engines.fsdp2.FSDP2Engine` (FSDP2, and HSDP on a 2-D mesh: :mod:`.mesh`);
- :mod:`.deepspeed`: :class:`~accum_kit.engines.deepspeed.ZeroEngine` (DeepSpeed ZeRO 1, 2, 3);
- :mod:`.policies`: the accumulation policies (torch-free); :mod:`.costs`: what each policy sends and holds
  under each engine, the one cost table (torch-free); :mod:`.compiling`: ``torch.compile`` over an engine;
  :mod:`.checkpoint_tag`: which engine wrote a checkpoint; :mod:`.accelerator`: the Accelerator subclass
  that lets the engine act inside ``prepare`` and ``no_sync``.

:func:`requested_engine` picks the engine once, before the Accelerator is
built (:func:`accum_kit.build_accelerator`); :func:`engine_of` tells the
engine of an Accelerator built some other way. This module imports no torch:
the ``plan`` command reads the policies and the cost table without it.
"""

from __future__ import annotations

import os

from ..errors import UsageError

def _launched(variable: str) -> bool:
    return os.environ.get(variable, "false").lower() == "true"


def requested_engine_name(fsdp_plugin=None, deepspeed_plugin=None) -> str:
    """``"deepspeed"``, ``"fsdp2"`` or ``"ddp"``: what the plugins passed, or ``accelerate launch``'s config, ask for.

    ``accelerate launch`` with a DeepSpeed config sets ``ACCELERATE_USE_DEEPSPEED=true``,
    with an FSDP config ``ACCELERATE_USE_FSDP=true`` (accelerate 1.15). Torch-free.

    Raises:
        UsageError: both DeepSpeed and FSDP were asked for.
    """
    deepspeed = deepspeed_plugin is not None or _launched("ACCELERATE_USE_DEEPSPEED")
    fsdp = fsdp_plugin is not None or _launched("ACCELERATE_USE_FSDP")
    if deepspeed and fsdp:
        raise UsageError("--use_deepspeed", "DeepSpeed and FSDP were both requested", "launch with one config: "
                         "accelerate_configs/cpu_deepspeed.yaml or cpu_fsdp.yaml")
    return "deepspeed" if deepspeed else ("fsdp2" if fsdp else "ddp")


def requested_engine(*, fsdp_plugin=None, deepspeed_plugin=None, parallelism_config=None, world_size: int = 1):
    """The :class:`~accum_kit.engines.base.Engine` the run asks for, not yet bound to an Accelerator.

    Args:
        fsdp_plugin, deepspeed_plugin, parallelism_config: what the caller passed to
            :func:`accum_kit.build_accelerator` (None: the launcher's variables decide).
        world_size: processes launched (an HSDP mesh is checked against it).

    Raises:
        UsageError: both DeepSpeed and FSDP asked for; a parallelism config that cannot work
            (:func:`accum_kit.engines.mesh.resolve_parallelism_config`), e.g. one without FSDP2.
    """
    name = requested_engine_name(fsdp_plugin, deepspeed_plugin)
    if name == "fsdp2":
        from .fsdp2 import FSDP2Engine

        return FSDP2Engine.requested(fsdp_plugin, parallelism_config, world_size=world_size)
    from .mesh import resolve_parallelism_config

    resolve_parallelism_config(parallelism_config, world_size=world_size, fsdp=False)  # refuses a mesh without FSDP2
    if name == "deepspeed":
        from .deepspeed import ZeroEngine

        return ZeroEngine(deepspeed_plugin)
    from .ddp import DDPEngine

    return DDPEngine()


def engine_of(accelerator):
    """The engine ``accelerator`` prepares with: the one :func:`accum_kit.build_accelerator` chose, or, for an
    Accelerator built another way, the one its state says (read once and kept on its run plan)."""
    from ..core.run_plan import run_plan_of

    return run_plan_of(accelerator).engine


def infer_engine(accelerator):
    """The engine an Accelerator built without :func:`accum_kit.build_accelerator` prepares with, bound to it."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        from .deepspeed import ZeroEngine

        engine = ZeroEngine(accelerator.deepspeed_plugin)
    elif getattr(accelerator, "is_fsdp2", False):
        from .fsdp2 import FSDP2Engine

        pc = getattr(accelerator, "parallelism_config", None)
        engine = FSDP2Engine(accelerator.state.fsdp_plugin, pc if pc is not None and pc.dp_replicate_enabled else None)
    else:
        from .ddp import DDPEngine

        engine = DDPEngine()
    engine.accelerator = accelerator
    return engine


def engine_for_model(model):
    """The engine (unbound) that prepared ``model``, told from the model itself: DeepSpeed's engine object,
    a model with FSDP2 units, else DDP (or a plain module)."""
    if type(model).__name__ == "DeepSpeedEngine":
        from .deepspeed import ZeroEngine

        return ZeroEngine()
    from ..compat import fsdp_units

    if fsdp_units(model):
        from .fsdp2 import FSDP2Engine

        return FSDP2Engine()
    from .ddp import DDPEngine

    return DDPEngine()
