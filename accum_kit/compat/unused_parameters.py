"""Parameters a backward did not reach (a mixture-of-experts expert without tokens): torch 2.13's FSDP2 and DDP internals.

Part of :mod:`accum_kit.compat`. An expert that is its own module gets no gradient at all from a backward
in which the router sent it no token; the engines then reduce different sets of tensors on different ranks
(checked with torch 2.13 CPU, gloo, 2 processes, tests/moe_model.py):

- FSDP2 reduce-scatters only the parameters that have a gradient (``FSDPParamGroup.post_backward``), so a
  rank whose expert got tokens sends more bytes than one whose expert did not: gloo's "Received data size
  doesn't match expected size" or "Connection reset by peer". Its
  ``FSDPModule.set_reduce_scatter_unused_params(True)`` (public, torch 2.13) adds a zero gradient for every
  parameter without one instead (:func:`fsdp_reduce_unused_parameters`).
- FSDP2 with a ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``: under ``no_sync`` each
  backward moves the parameters' bf16 gradients into ``FSDPParam.unsharded_accumulated_grad`` in float32
  (``to_accumulated_grad_if_needed``), but a parameter that first gets a gradient in the window's synchronising
  backward still holds it in bf16 as ``unsharded_param.grad``, and ``foreach_reduce`` asserts one dtype per
  unit: "FSDP reduce-scatter expects uniform gradient dtype but got {torch.bfloat16, torch.float32}"
  (pytorch/pytorch#196996). :func:`fsdp_zero_fill_accumulated_grads`, run after every ``no_sync`` backward,
  gives every such parameter a float32 zero accumulated gradient, into which its bf16 gradient is then
  added (``accumulate_unsharded_grad_if_needed``), so the boundary reduces one dtype on every rank.
- DDP without ``find_unused_parameters`` waits for a gradient from every parameter in a synchronising
  backward; a parameter without one leaves its bucket unreduced and the next forward fails ("Expected to have
  finished reduction in the prior iteration"), after an optimizer step on unreduced gradients.
  :func:`ddp_needs_every_parameter` tells when the next backward is such a one, and
  :func:`ddp_unreduced_parameters` asks DDP's reducer, right after that backward, whether it reduced everything.

:func:`ddp_parameter_pairs` and :func:`fsdp_parameter_pairs` give :class:`accum_kit.engines.reached.ReachedParameters`
each parameter with the tensor autograd accumulates into.
"""

from __future__ import annotations


def fsdp_reduce_unused_parameters(model) -> int:
    """Make every FSDP2 unit of ``model`` reduce a zero gradient for each trainable parameter without one.

    Calls ``FSDPModule.set_reduce_scatter_unused_params(True)`` on each top-level FSDP2 module (it recurses),
    public in torch 2.13 and read by ``FSDPParamGroup.post_backward`` (torch 2.13) for the parameters that
    have an unsharded tensor. Returns the number of modules set (0: not an FSDP2 model, or a torch without
    the method).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return 0
    roots, inside = [], set()
    for module in model.modules():
        if isinstance(module, FSDPModule) and id(module) not in inside and hasattr(module, "set_reduce_scatter_unused_params"):
            module.set_reduce_scatter_unused_params(True)
            roots.append(module)
            inside.update(id(m) for m in module.modules())
    return len(roots)


def fsdp_zero_fill_accumulated_grads(model) -> int:
    """After a ``no_sync`` backward: a float32 zero ``unsharded_accumulated_grad`` for every FSDP2 parameter of
    ``model`` that has neither it nor an unsharded gradient, when its unit reduces in another dtype than it
    computes in (``FSDPParam.reduce_dtype`` is not None). Returns how many were filled.

    Touches ``FSDPParam._unsharded_param``, ``unsharded_accumulated_grad`` and ``reduce_dtype`` (torch 2.13);
    ``torch.zeros_like`` of the unsharded parameter, as torch's own ``unsharded_zero_grad_data``, keeps a
    DTensor parameter (tensor parallel) a DTensor. A parameter not yet gathered on this rank (its unit never ran)
    has no unsharded tensor and is left alone, as FSDP2 leaves it.
    """
    import torch

    from .fsdp_internals import fsdp_units

    filled = 0
    for _, group in fsdp_units(model):
        for fp in group.fsdp_params:
            unsharded = getattr(fp, "_unsharded_param", None)
            dtype = getattr(fp, "reduce_dtype", None)
            if (unsharded is None or dtype is None or not unsharded.requires_grad
                    or fp.unsharded_accumulated_grad is not None or unsharded.grad is not None):
                continue
            fp.unsharded_accumulated_grad = torch.zeros_like(unsharded, dtype=dtype)
            filled += 1
    return filled


def ddp_module(model):
    """The ``DistributedDataParallel`` inside ``model`` (``model`` itself, or the module ``torch.compile`` wrapped as
    ``OptimizedModule._orig_mod``, torch 2.13); None when there is none."""
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, DistributedDataParallel) else None


def ddp_needs_every_parameter(model) -> bool:
    """Whether ``model``'s next backward is a DDP synchronising backward that expects a gradient from every parameter.

    True when ``model`` is DDP (:func:`ddp_module`) with ``require_backward_grad_sync`` set (DDP clears it inside
    ``no_sync``) and without ``find_unused_parameters`` (with it, DDP finds the unused parameters itself after
    each forward). Both are attributes of ``DistributedDataParallel`` (torch 2.13).
    """
    ddp = ddp_module(model)
    return (ddp is not None and bool(getattr(ddp, "require_backward_grad_sync", True))
            and not getattr(ddp, "find_unused_parameters", False))


def ddp_unreduced_parameters(model) -> list[str] | None:
    """Right after a synchronising backward of ``model`` (DDP without ``find_unused_parameters``): None when DDP's
    reducer reduced every bucket; else the names of the parameters that got no gradient on this rank (``[]`` when DDP's
    message lists none).

    Calls ``DistributedDataParallel._check_reducer_finalized`` (torch 2.13; the check DDP's next forward makes, with
    its "Expected to have finished reduction in the prior iteration" error and the unreduced parameters' indices
    into the reducer's parameter list, rebuilt here as DDP's ``_build_params_for_reducer`` builds it: by module,
    trainable, not ignored, each once). One C++ call (a lock and a flag) when everything was reduced. None for a
    model that is not DDP or has no such method.
    """
    import re

    ddp = ddp_module(model)
    check = getattr(ddp, "_check_reducer_finalized", None)
    if check is None:
        return None
    try:
        check()
    except RuntimeError as err:
        if "Expected to have finished reduction" not in str(err):
            raise
        match = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(err))
        indices = [int(i) for i in match.group(1).split()] if match else []
        ignored, seen, names = set(getattr(ddp, "parameters_to_ignore", ()) or ()), set(), []
        for module_name, module in ddp.module.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                fqn = f"{module_name}.{param_name}" if module_name else param_name
                if param.requires_grad and f"{module_name}.{param_name}" not in ignored and id(param) not in seen:
                    seen.add(id(param))
                    names.append(fqn)
        return [names[i] for i in indices if i < len(names)]
    return None


def ddp_parameter_pairs(model):
    """For :class:`accum_kit.engines.reached.ReachedParameters`: a callable giving ``[(p, p)]`` for every trainable
    parameter of DDP ``model``'s module (autograd accumulates into the parameter itself)."""
    module = getattr(ddp_module(model), "module", model)
    params = [p for p in module.parameters() if p.requires_grad]
    return lambda: [(p, p) for p in params]


def fsdp_parameter_pairs(model):
    """For :class:`accum_kit.engines.reached.ReachedParameters`: a callable giving, for every trainable parameter of
    FSDP2 ``model``'s units, ``(sharded parameter, unsharded parameter)`` (``FSDPParam.sharded_param`` and
    ``_unsharded_param``, torch 2.13: the forward's autograd graph holds the unsharded one, the optimizer steps the
    sharded one; the unsharded one exists from the unit's first all-gather on, None before)."""
    from .fsdp_internals import fsdp_units

    def pairs():
        return [(fp.sharded_param, getattr(fp, "_unsharded_param", None))
                for _, group in fsdp_units(model) for fp in group.fsdp_params if fp.sharded_param.requires_grad]

    return pairs
