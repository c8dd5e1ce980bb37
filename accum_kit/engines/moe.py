"""Parameters without a gradient in a micro-batch (mixture-of-experts routing): what each engine does so that no rank
crashes or waits, and the update stays the big batch's. Only for models with per-module experts (:func:`expert_blocks`):
a dense model runs exactly what Accelerate runs.

A mixture-of-experts model whose experts are separate modules gives an expert no gradient in a backward in
which the router sent it no token, and routing differs between micro-batches and ranks: an expert may get
tokens only in a window's last micro-batch, only on one rank, or never. Every engine reduces gradients with
collectives that must match across ranks, tensor for tensor (docs/moe.md has the measured failures). The fix,
per engine, gives every trainable parameter a gradient (zero where it had none) before the reduction, which
adds nothing to the sum:

- FSDP2 and HSDP (:class:`accum_kit.engines.fsdp2.FSDP2Engine`): every unit reduce-scatters a zero gradient
  for a parameter without one (:func:`accum_kit.compat.unused_parameters.fsdp_reduce_unused_parameters`, at
  ``prepare``), and after each ``no_sync`` backward a parameter without a gradient gets a zero one in the
  reduce dtype (:func:`accum_kit.compat.unused_parameters.fsdp_zero_fill_accumulated_grads`), so that the
  boundary's reduce-scatter sees one dtype under bf16;
- DDP without ``find_unused_parameters`` and DeepSpeed ZeRO-1/2 (:func:`zero_gradient_term`):
  ``accelerator.backward`` adds ``0 x`` one element of every parameter to the loss of a backward that reduces,
  so that every parameter's gradient hook fires (DDP's reducer, DeepSpeed's reduce buckets) with a zero gradient
  where the forward did not reach it; DDP with ``find_unused_parameters`` finds those parameters itself;
- DeepSpeed ZeRO-2 also needs every rank to hand its gradients to the reduce buckets in one order (it
  flattens them in the order their hooks fire, and sums the buckets position by position: an expert used on
  one rank only fires mid-backward there and at once elsewhere, and the sums mix parameters, silently; measured,
  DeepSpeed 0.19.8). :func:`order_expert_gradients` adds ``0 x`` one element of each expert parameter to the
  block's input, so that every expert's gradient, used or not, is complete only when the block's backward
  has run, in the same order on every rank;
- DeepSpeed ZeRO-3, whose parameters are partitioned outside their module's forward (no element to take):
  each module that holds an ``experts`` list (:func:`expert_blocks`) becomes a ZeRO-3 "leaf module"
  (``deepspeed.utils.set_z3_leaf_modules``, DeepSpeed's own answer for mixture-of-experts): its parameters
  are gathered together at its forward and, after its backward, DeepSpeed gives every one of them without a
  gradient a zero one before reducing them all.

A parameter that no micro-batch of a window reached on any rank has no gradient in one big batch on one process,
and the optimizer skips it (no weight decay, no moment update). Under DDP and FSDP2 / HSDP the zeros given for the
reduction are taken back at the window's boundary (:class:`ReachedParameters`: which parameters each backward's
autograd graph reached, OR-ed over the ranks), so such a parameter holds ``.grad = None`` at the step as there;
one process and DDP with ``find_unused_parameters`` leave it without a gradient by themselves. DeepSpeed's
optimizer steps flat partitions, so under ZeRO it steps with a zero gradient (docs/moe.md).
"""

from __future__ import annotations


def zero_gradient_term(parameters):
    """``0 x`` the sum of the first element of each trainable parameter in ``parameters``: a zero scalar whose backward
    gives every one of them a gradient (zero) and adds nothing to a gradient it already gets. None when none trains.

    Cost per backward it is added to: one zero gradient tensor per parameter (``P`` elements written and added),
    about what an SGD step reads; no collective.
    """
    import torch

    firsts = [p.reshape(-1)[:1] for p in parameters if p.requires_grad and p.numel()]
    if not firsts:
        return None
    return torch.cat([f.float() for f in firsts]).sum() * 0.0


def with_zero_gradients(loss, parameters):
    """``loss + zero_gradient_term(parameters)`` (``loss`` unchanged when no parameter trains)."""
    term = zero_gradient_term(parameters)
    return loss if term is None else loss + term.to(loss.dtype)


def expert_blocks(model) -> list:
    """The modules of ``model`` that hold their experts as a list: an attribute ``experts`` that is an
    ``nn.ModuleList`` or ``nn.ModuleDict`` of at least 2 modules (transformers' sparse MoE blocks of the
    per-expert-module kind, and tests/moe_model.py's), in module order. A model whose experts are one fused
    3-D parameter (transformers 5's Mixtral, OLMoE, Qwen2-MoE) has none: every expert gets a gradient there."""
    from torch import nn

    found = []
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, (nn.ModuleList, nn.ModuleDict)) and len(experts) >= 2:
            found.append(module)
    return found


def order_expert_gradients(block):
    """Make every expert parameter of ``block`` (one of :func:`expert_blocks`) receive its gradient at the same point
    of the backward on every rank, used or not: a forward pre-hook adds :func:`zero_gradient_term` of the experts'
    parameters to the block's hidden states (its first positional argument, or ``hidden_states``), so the autograd
    engine completes each expert gradient only after the whole block's backward, in the term's order. Adds
    nothing to any value or gradient. Returns the hook's handle (None when no expert parameter trains).

    For DeepSpeed ZeRO-2, whose reduce buckets are filled in gradient-hook order; the parameters must be whole on
    every rank (not ZeRO-3's partitions).
    """
    import torch

    params = [p for p in block.experts.parameters() if p.requires_grad]
    if not params:
        return None

    def add_term(module, args, kwargs):
        if args and torch.is_tensor(args[0]) and args[0].is_floating_point():
            return (args[0] + zero_gradient_term(params).to(args[0].dtype), *args[1:]), kwargs
        h = kwargs.get("hidden_states")
        if torch.is_tensor(h) and h.is_floating_point():
            return args, {**kwargs, "hidden_states": h + zero_gradient_term(params).to(h.dtype)}
        return None

    return block.register_forward_pre_hook(add_term, with_kwargs=True)


def reentrant_checkpointing(accelerator) -> bool:
    """Whether the run checkpoints its blocks with reentrant ``torch.utils.checkpoint`` (``use_reentrant: true``).

    Then :func:`zero_gradient_term` must stay out of the loss: a checkpointed block's parameters get their
    gradient in the inner backward of the recompute and the term's in the outer one, two gradient-hook calls
    for one parameter (DDP: "Expected to mark a variable ready only once"; DeepSpeed ZeRO-1/2: "Gradient computed
    twice for this partition").
    """
    plan = getattr(accelerator, "run_plan", None)
    return bool(plan is not None and plan.gradient_checkpointing
                and (plan.gradient_checkpointing_kwargs or {}).get("use_reentrant"))


def experts_as_units(model, unit_modules) -> list[str]:
    """The names of the modules in ``unit_modules`` (FSDP2's units) that are experts of one of :func:`expert_blocks`
    (or inside one): an expert that is an FSDP2 unit of its own reduces its gradients from its own post-backward,
    which runs during the backward on a rank whose expert got tokens and at the backward's end on one whose did
    not, so the ranks' reduce-scatters come in different orders, and a unit never gathered on a rank is not
    reduced there at all. Empty when every expert lives inside a larger unit (its block's)."""
    experts = {id(m) for block in expert_blocks(model) for e in block.experts.children() for m in e.modules()}
    names = {id(m): n for n, m in model.named_modules()}
    return [names.get(id(m), type(m).__name__) for m in unit_modules if id(m) in experts]


def check_fsdp_expert_units(model) -> None:
    """Refuse a prepared FSDP2 model in which an expert is a unit of its own (:func:`experts_as_units`).

    Raises:
        UsageError (``fsdp_transformer_layer_cls_to_wrap``): naming the expert units and the fix.
    """
    from ..compat import fsdp_units
    from ..errors import UsageError

    units = experts_as_units(model, [m for m, _ in fsdp_units(model)])
    if units:
        raise UsageError("fsdp_transformer_layer_cls_to_wrap", f"makes experts FSDP2 units of their own ({units[0]}, "
                         f"... {len(units)} in all): ranks whose experts get different tokens then reduce them in "
                         "different orders, and the collectives mismatch (docs/moe.md)", "wrap the block that holds "
                         "the experts (the decoder layer, the model's _no_split_modules) instead")


class ForwardWatch:
    """Which prepared models ran a forward with gradients since the last backward and since the window's last
    boundary, so that an engine's :meth:`~accum_kit.engines.base.Engine.backward` touches only the model being
    trained (the bench prepares several, each with its engine's hooks on its parameters).

    :meth:`watch` adds a forward pre-hook to a prepared model (the wrapper ``prepare`` returned: DDP, DeepSpeed's
    engine, a compiled or plain module); :meth:`ran` is what ran since the last backward (``boundary=False``) or
    the last boundary; :meth:`backward_done` forgets them.
    """

    def __init__(self):
        self._since_backward, self._since_boundary = [], []

    def watch(self, model) -> None:
        model.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        import torch

        if torch.is_grad_enabled():
            for seen in (self._since_backward, self._since_boundary):
                if all(m is not module for m in seen):
                    seen.append(module)

    def ran(self, *, boundary: bool = False) -> list:
        return list(self._since_boundary if boundary else self._since_backward)

    def backward_done(self, boundary: bool) -> None:
        self._since_backward = []
        if boundary:
            self._since_boundary = []


def watch_prepared(engine, prepared) -> ForwardWatch:
    """``engine``'s :class:`ForwardWatch` (made on first use, kept as ``engine.forward_watch``), watching every
    ``nn.Module`` in ``prepared``."""
    import torch

    watch = getattr(engine, "forward_watch", None) or ForwardWatch()
    engine.forward_watch = watch
    for obj in prepared:
        if isinstance(obj, torch.nn.Module):
            watch.watch(obj)
    return watch
