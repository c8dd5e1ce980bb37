"""torch.compile under accumulation: the flags, Accelerate's dynamo plugin, and counting compiles.

The flags are transformers' (``--torch_compile``, ``--torch_compile_backend``,
``--torch_compile_mode``; giving a backend or a mode switches compilation on,
the backend defaults to ``inductor``). They become Accelerate's
``TorchDynamoPlugin`` (:func:`dynamo_plugin_for`), which ``prepare`` applies:

- under DDP the whole model, ``torch.compile(DDP(model))``: dynamo compiles the
  wrapped module and splits its graph at DDP's bucket boundaries (its
  ``DDPOptimizer``), while DDP's own forward, and with it the
  ``no_sync`` switch that Accelerate's ``accumulate`` flips, stays eager;
- under FSDP2 per block (Accelerate's ``use_regional_compilation``, in-place
  ``module.compile()`` of each repeated block before ``fully_shard``), so FSDP2's
  hooks, which gather and reduce-scatter around every block, stay outside the
  compiled code. A whole-model ``torch.compile`` there would return a wrapper
  whose call skips the hooks ``fully_shard`` installs later (accelerate 1.15's
  own note), so it is switched to regional here.

An accelerate config with a ``dynamo_config`` section (``ACCELERATE_DYNAMO_*``
in the environment of the launched processes) works as well and gets the same
checks and the same regional rule under FSDP2.

Nothing the window normalisation computes enters compiled code: the model's
forward is the compiled region, the loss, its division by the power-of-two
``c``, Accelerate's division by K and the boundary rescale run eagerly on its
output and on ``.grad`` (:mod:`accum_kit.core.loss`). So no Python number that
changes from window to window is baked into a graph.

:class:`CompileWatch` counts compiles from torch's own compile callbacks
(``torch._dynamo.callback``, fired by dynamo for every frame compile and by
AOTAutograd for a lazily compiled backward) and graph counters
(``torch._dynamo.utils.counters``); a compile whose id is ``F/N`` with N > 0
is a recompile of frame F, and its reason comes from torch's compilation
metrics.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import time

from .. import checks
from ..core.callbacks import LoopCallback
from ..errors import UsageError

#: ``torch.compile`` modes (transformers' ``--torch_compile_mode`` choices, plus inductor's ``lite``)
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "lite")
#: backend -> (module to import, what to install) for backends whose compiler is a separate package
BACKEND_PACKAGES = {
    "onnxrt": ("onnxruntime", "pip install onnxruntime"),
    "tvm": ("tvm", "pip install apache-tvm"),
    "tensorrt": ("torch_tensorrt", "pip install torch-tensorrt"),
    "fx2trt": ("torch_tensorrt", "pip install torch-tensorrt"),
    "ipex": ("intel_extension_for_pytorch", "pip install intel-extension-for-pytorch"),
    "openxla": ("torch_xla", "pip install torch-xla"),
    "aot_torchxla_trace_once": ("torch_xla", "pip install torch-xla"),
    "torchxla_trace_once": ("torch_xla", "pip install torch-xla"),
}
CXX_COMPILERS = ("g++", "c++", "clang++")


def backends() -> tuple[str, ...]:
    """Backend names Accelerate's ``TorchDynamoPlugin`` accepts (its ``DynamoBackend`` values, lower case, without ``no``)."""
    from accelerate.utils import DynamoBackend

    return tuple(b.value.lower() for b in DynamoBackend if b.value != "NO")


def resolve_flags(torch_compile: bool, backend: str | None, mode: str | None,
                  flags: tuple[str, str] = ("--torch_compile_backend", "--torch_compile_mode")) -> tuple[str, str | None] | None:
    """Check the compile flags and return ``(backend, mode)``, or None when nothing asks for compilation.

    As in transformers, a backend or a mode implies ``--torch_compile``; the
    backend defaults to ``inductor``. Reads Accelerate's backend list; nothing is compiled here.

    Raises:
        UsageError: an unknown backend or mode, or a mode with a backend other
            than inductor (only inductor reads it); the message names the flag.
    """
    if not (torch_compile or backend or mode):
        return None
    backend = (backend or "inductor").lower()
    checks.one_of(flags[0], backend, backends())
    if mode is not None:
        checks.one_of(flags[1], mode, MODES)
        if backend != "inductor" and mode != "default":
            raise UsageError(flags[1], f"{mode!r} is an inductor mode, but the backend is {backend!r}",
                             f"drop {flags[1]}, or pass {flags[0]} inductor")
    return backend, mode


def check_backend_available(backend: str, flag: str = "--torch_compile_backend") -> None:
    """Fail early, naming the flag and what to install, when ``backend`` cannot compile on this machine.

    inductor on CPU writes C++ and needs a C++ compiler on the PATH; some
    backends need a package of their own (:data:`BACKEND_PACKAGES`); any
    backend must be registered with this torch's dynamo.

    Raises:
        UsageError: the compiler, the package or the registration is missing.
    """
    import torch

    if backend in BACKEND_PACKAGES:
        module, install = BACKEND_PACKAGES[backend]
        if importlib.util.find_spec(module) is None:
            raise UsageError(flag, f"backend {backend!r} needs the {module!r} package, which is not installed",
                             f"{install}, or use --torch_compile_backend inductor")
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise UsageError(flag, f"backend {backend!r} is not registered with torch {torch.__version__}'s dynamo",
                         "use one of inductor, aot_eager, eager")
    if backend == "inductor" and not torch.cuda.is_available() and not any(shutil.which(c) for c in CXX_COMPILERS):
        raise UsageError(flag, "inductor compiles C++ on CPU but no C++ compiler (g++, c++, clang++) is on the PATH",
                         "install one (e.g. apt-get install g++), or use --torch_compile_backend aot_eager")


def _env_flags() -> tuple[bool, str | None, str | None]:
    """What an accelerate config's ``dynamo_config`` put into the environment (``ACCELERATE_DYNAMO_*``)."""
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND")
    on = backend is not None and backend.upper() != "NO"
    mode = os.environ.get("ACCELERATE_DYNAMO_MODE")
    return on, backend.lower() if on else None, None if mode in (None, "default") else mode


def dynamo_plugin_for(torch_compile: bool = False, backend: str | None = None, mode: str | None = None, *,
                      per_block: bool = False, dynamic: bool | None = None, fsdp: bool | None = None):
    """Accelerate's ``TorchDynamoPlugin`` for the compile flags, or None when nothing asks to compile.

    Without flags, an accelerate config's ``dynamo_config`` (environment
    ``ACCELERATE_DYNAMO_BACKEND`` / ``_MODE``) is checked the same way and
    used. Under FSDP2 compilation is per block (``use_regional_compilation``);
    under DDP the whole model is compiled unless the config asked for regional.

    Args:
        torch_compile, backend, mode: the train job's ``--torch_compile*`` flags.
        per_block: compile each transformer block on its own (the engine's
            :meth:`~accum_kit.engines.base.Engine.compile_per_block`: FSDP2).
        fsdp: the older name of ``per_block``, kept for existing callers.
        dynamic: ``torch.compile``'s ``dynamic``: True compiles shapes as
            symbols from the first call (no recompile when a sequence length
            changes), None lets torch decide (static first, dynamic after the
            first change: one recompile per dimension that varies).

    Raises:
        UsageError: see :func:`resolve_flags` and :func:`check_backend_available`.
    """
    from accelerate.utils import TorchDynamoPlugin

    per_block = per_block or bool(fsdp)
    resolved = resolve_flags(torch_compile, backend, mode)
    from_env = resolved is None
    if from_env:
        resolved = resolve_flags(*_env_flags(), flags=("--dynamo_backend", "--dynamo_mode"))
        if resolved is None:
            return None
    backend, mode = resolved
    check_backend_available(backend, "--dynamo_backend" if from_env else "--torch_compile_backend")
    plugin = TorchDynamoPlugin(backend=backend, mode=mode or "default")  # other fields from ACCELERATE_DYNAMO_*
    if dynamic is not None:
        plugin.dynamic = dynamic
    if per_block or not from_env:
        plugin.use_regional_compilation = per_block
    return plugin


def check_ddp_buckets(plugin, handlers: list) -> None:
    """Refuse DDP buckets smaller than DDP's first bucket (1 MiB) when the whole DDP model is compiled.

    dynamo's ``DDPOptimizer`` splits the compiled graph at DDP's bucket
    boundaries and asserts that DDP's first bucket (1 MiB,
    ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``) is no larger than the
    others, so ``bucket_cap_mb`` below 1 fails inside the first forward with
    "First bucket should be smaller/equal to other buckets" (torch 2.13).

    Raises:
        UsageError: ``bucket_cap_mb < 1`` in a ``DistributedDataParallelKwargs`` with compilation on.
    """
    from accelerate.utils import DistributedDataParallelKwargs

    if plugin is None or plugin.use_regional_compilation:
        return
    for h in handlers:
        if isinstance(h, DistributedDataParallelKwargs) and h.bucket_cap_mb < 1:
            raise UsageError("--ddp_bucket_cap_mb", f"{h.bucket_cap_mb} MB is below DDP's first bucket (1 MiB), which "
                             "torch.compile's DDP graph splitting does not accept", "pass 1 or more, or drop --torch_compile")


def compile_settings(accelerator) -> dict | None:
    """``{"backend", "mode", "regional", "dynamic"}`` of the Accelerator's dynamo plugin; None when it does not compile."""
    plugin = accelerator.state.dynamo_plugin
    if plugin is None or plugin.backend.value == "NO":
        return None
    return {"backend": plugin.backend.value.lower(), "mode": plugin.mode, "regional": bool(plugin.use_regional_compilation),
            "dynamic": plugin.dynamic}


_COMPILE_ID = re.compile(r"(\d+)/(\d+)")


class CompileWatch(LoopCallback):
    """Count compiles, recompiles and compile seconds from torch's own callbacks; a loop callback.

    Create it before the first compiled call (before the evaluation that
    precedes training); pass it to :func:`accum_kit.train_loop` as a callback
    so that it knows when warm-up ends: compiles after the end of optimizer
    step ``warmup_steps`` count as ``recompiles_after_warmup``. Call
    :meth:`close` at the end (it unregisters the callbacks).

    Args:
        warmup_steps: optimizer steps that may compile (1: the first window,
            which meets sync and non-sync micro-batches and eval's graph, if
            an evaluation ran before).
    """

    def __init__(self, warmup_steps: int = 1):
        import torch._dynamo.callback as cb
        from torch._dynamo.utils import counters

        self.warmup_steps, self.compiles, self._warm, self._start = warmup_steps, [], False, None
        self._phase, self._graphs0 = "before training", counters["stats"]["unique_graphs"]
        self._handler = cb.callback_handler
        self._handler.register_start_callback(self._on_start)
        self._handler.register_end_callback(self._on_end)

    def _on_start(self, args) -> None:
        self._start = time.perf_counter()

    def _on_end(self, args) -> None:
        seconds = time.perf_counter() - (self._start or time.perf_counter())
        m = _COMPILE_ID.search(str(args.compile_id))
        backward = "BACKWARD" in str(args.callback_trigger)
        self.compiles.append({"compile_id": str(args.compile_id), "backward": backward, "seconds": seconds,
                              "recompile": bool(m and int(m.group(2)) > 0 and not backward),
                              "after_warmup": self._warm, "phase": self._phase})

    def on_micro_batch_begin(self, state):
        self._phase = f"optimizer step {state.step + 1}"

    def on_step_end(self, state):
        if state.step >= self.warmup_steps:
            self._warm = True
        self._phase = f"after optimizer step {state.step}"

    def on_train_end(self, state):
        self._phase = "after training"

    def close(self) -> None:
        """Unregister from torch's compile callbacks (idempotent)."""
        for remove, fn in ((self._handler.remove_start_callback, self._on_start),
                           (self._handler.remove_end_callback, self._on_end)):
            try:
                remove(fn)
            except ValueError:
                pass

    def summary(self) -> dict:
        """Counts and seconds for ``train_summary.json["compile"]``.

        Returns:
            ``compile_seconds`` (wall seconds spent compiling, forward frames and
            lazily compiled backward graphs), ``compiles``, ``graphs`` (dynamo's
            ``unique_graphs`` since this watch started), ``recompiles``,
            ``recompiles_after_warmup``, ``warmup_steps`` and
            ``recompile_reasons`` (torch's, with the phase each happened in).
        """
        from torch._dynamo.utils import counters, get_compilation_metrics

        reasons = {}
        for m in get_compilation_metrics():
            if getattr(m, "recompile_reason", None):
                reasons[str(m.compile_id)] = m.recompile_reason
        recompiles = [c for c in self.compiles if c["recompile"]]
        return {
            "compile_seconds": round(sum(c["seconds"] for c in self.compiles), 3),
            "compiles": len(self.compiles),
            "graphs": counters["stats"]["unique_graphs"] - self._graphs0,
            "recompiles": len(recompiles),
            "recompiles_after_warmup": sum(c["after_warmup"] for c in recompiles),
            "warmup_steps": self.warmup_steps,
            "recompile_reasons": [{"compile_id": c["compile_id"], "phase": c["phase"],
                                   "reason": reasons.get(c["compile_id"], "")} for c in recompiles],
        }
