"""The causal LM's output layer computing the summed loss instead of the logits, inside the model's own forward.

:class:`accum_kit.core.loss.CausalLMLoss` hands the shifted labels to the output layer
(``model.get_output_embeddings()``, a ``torch.nn.Linear``) and calls the model as usual; the layer then
returns the summed cross-entropy of its input hidden states (:mod:`accum_kit.core.linear_cross_entropy`)
instead of the (batch, seq, V) logits, and the model returns that scalar as ``.logits``. Because the
loss is computed where the logits would have been, everything the engine wrapped around the forward sees
it: DDP's forward, FSDP2's gathered root parameters and pre-backward hooks, DeepSpeed ZeRO-3's gather of
the output layer's weight around that layer's forward, Accelerate's autocast and its float32 output cast.
Reading ``lm_head.weight`` outside the forward instead would see FSDP2's shard or ZeRO-3's empty
placeholder.

The layer keeps its normal forward whenever no labels were handed to it (generation, a user's own
calls). The switch is an instance attribute ``forward`` (a bound method, so ``copy.deepcopy`` of the model
binds it to the copy); parameters, state dict and module tree are unchanged. It runs outside
``torch.compile``'s graph (``torch.compiler.disable``): a compiled model breaks its graph there, and the
loss runs eagerly. That break is harmless for a model compiled alone or per block (FSDP2's regional
compilation leaves the output layer out of the graphs), but inside DDP compiled as a whole it made
non-boundary micro-batches all-reduce (torch 2.13, 2 gloo processes), so such a model keeps the logits.

A model is served when its output layer is a ``torch.nn.Linear`` (tied to the input embedding or not,
with or without bias) whose result the model returns unchanged, not inside DDP compiled as a whole
(:func:`compiled_ddp`): :func:`unsupported_reason` refuses the
config settings that change it (Gemma 2's ``final_logit_softcapping``, Cohere's ``logit_scale``,
Granite's ``logits_scaling``), a weight sharded over the vocabulary (tensor parallel, whose plan gathers
the logits), and the first forward with gradients of every model is checked: the scalar the model returned must be
the layer's result passed on through casts, views or the engines' own autograd functions only
(:func:`returns_anchor_unchanged`, no host read; a compiled region on the way: the values compared, one
host read per model and run).
"""

from __future__ import annotations

import types
import weakref

import torch

from ..errors import UsageError

FLAG = "--fused_linear_cross_entropy"
#: Config fields that make a model change its output layer's result before returning it.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scale")


def inner_model(model):
    """The module ``prepare`` wrapped (DDP, DeepSpeed's engine, ``torch.compile``), via Accelerate's
    ``extract_model_from_parallel``; FSDP2 modules are the model itself."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def output_layer(model):
    """``(layer, None)`` for a model whose output layer can compute the loss, else ``(None, why not)``."""
    if compiled_ddp(model):
        return None, ("the model is DDP compiled as a whole: the loss runs outside the graph (a graph break in the "
                      "compiled DDP forward), and with that break DDP all-reduced on micro-batches inside no_sync "
                      "(measured, torch 2.13)")
    inner = inner_model(model)
    get = getattr(inner, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    if layer is None:
        return None, f"{type(inner).__name__} has no output layer (get_output_embeddings() is None)"
    why = unsupported_reason(inner, layer)
    return (None, why) if why else (layer, None)


def compiled_ddp(model) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper around a DistributedDataParallel module."""
    inner = getattr(model, "_orig_mod", None)
    return inner is not None and isinstance(inner, torch.nn.parallel.DistributedDataParallel)


def unsupported_reason(model, layer) -> str | None:
    """Why ``layer`` (the output layer of ``model``) cannot return the loss, or None when it can."""
    if not isinstance(layer, torch.nn.Linear):
        kind = f"{type(layer).__module__}.{type(layer).__qualname__}"
        if kind.startswith("peft."):  # an adapter on the output layer: its result is the layer's plus the adapter's
            return f"its output layer carries a peft adapter ({kind}), not a plain torch.nn.Linear"
        return f"its output layer is a {kind}, not a torch.nn.Linear"
    config = getattr(model, "config", None)
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 0, 0.0, 1, 1.0, False):
            return f"its config sets {name}={value}: the model changes the logits after the output layer"
    if split_over_tp(layer.weight):
        return ("its output layer is split over the vocabulary (tensor parallel): the tp plan gathers the logits, "
                "and a loss over vocabulary shards would need the log-sum-exp reduced over the tp group")
    return None


def split_over_tp(weight) -> bool:
    """Whether ``weight`` is a DTensor sharded on a mesh dimension named ``tp`` (Accelerate's tensor-parallel mesh).
    FSDP2's shards are DTensors too, on the data-parallel dimensions: the layer is whole again inside the forward."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return False
    names = weight.device_mesh.mesh_dim_names or ()
    return any(name == "tp" and isinstance(p, Shard) for name, p in zip(names, weight.placements))


@torch.compiler.disable
def _switched_forward(module, hidden_states):
    """The output layer's forward while a :class:`FusedHead` is installed: the loss when labels were handed over,
    else the layer's own forward. Looks the switch up on ``module`` (nothing captured), so that a deep copy of
    the model switches its own layer."""
    switch = module._accum_kit_switch
    target, switch.target = switch.target, None
    if target is None:
        return type(module).forward(module, hidden_states)
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    if flat.shape[0] != target.numel():
        raise RuntimeError(f"{FLAG}: the output layer got {flat.shape[0]} positions for {target.numel()} "
                           "labels (the model keeps only some logits?)")
    switch.computed = switch.implementation(flat, module.weight, target.reshape(-1), module.bias, chunk=switch.chunk)
    return _Anchor.apply(switch.computed)


class _Anchor(torch.autograd.Function):
    """A copy of the loss that the model returns as its logits, through which no gradient flows back.

    The engines attach their backward hooks to what the model returns (FSDP2's pre-backward, ZeRO-3's
    gather, DDP's output traversal) and may cast it (FSDP2 casts the outputs to bf16 under a bf16
    MixedPrecisionPolicy: a summed loss of 20.7672 came back as 20.75). :meth:`FusedHead.loss` therefore
    takes the value and the gradient from the layer's own float32 result, and adds the returned copy minus
    itself (zero) so that the backward still passes the engines' hooks first.
    """

    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


class FusedHead:
    """The switch on one output layer: :meth:`loss` runs the model with the layer returning the summed loss.

    Installed once per layer (kept as ``layer._accum_kit_switch``; the layer's ``forward`` becomes a bound
    ``_switched_forward``).

    Args:
        layer: the model's output layer (``torch.nn.Linear``, weight (V, h)).
        implementation: ``(hidden (N, h), weight (V, h), target (N,), bias, chunk=) -> scalar``
            (:data:`accum_kit.core.linear_cross_entropy.IMPLEMENTATIONS`).
        chunk: tokens per chunk (None: the implementation's default for V).
    """

    def __init__(self, layer, implementation, chunk: int | None = None):
        self.implementation, self.chunk = implementation, chunk
        self.vocab = layer.out_features  # V
        self.checked = False
        self.target = None  # (N,) labels for the layer's next forward
        self.computed = None  # the scalar the layer returned, until the model's forward returned
        layer._accum_kit_switch = self
        layer.forward = types.MethodType(_switched_forward, layer)

    @classmethod
    def on(cls, layer, implementation, chunk: int | None = None) -> "FusedHead":
        """The layer's switch (installed now if it has none), set to ``implementation`` and ``chunk``."""
        switch = getattr(layer, "_accum_kit_switch", None)
        if switch is None:
            return cls(layer, implementation, chunk)
        switch.implementation, switch.chunk = implementation, chunk
        return switch

    def loss(self, model, inputs: dict, target: torch.Tensor, **kwargs):
        """``(summed loss, model output)``: ``model(**inputs, **kwargs)`` with the layer returning the loss.

        Args:
            model: the prepared model (its engine's wrapper) whose output layer holds this switch.
            inputs: the model's inputs, (batch, seq) tensors.
            target: (batch, seq) int64 labels aligned with the positions (already shifted), -100 ignored.

        Returns:
            the float32 scalar (nats, summed over the targets) the layer computed, its backward passing through
            the model's returned ``.logits`` (see :class:`_Anchor`), and the model's output.

        Raises:
            UsageError (``--fused_linear_cross_entropy``): on the first call, the model returned something other
                than the layer's result (it post-processes the logits).
        """
        self.target = target
        try:
            out = model(**inputs, **kwargs)
            returned, computed = out.logits, self.computed
        finally:
            self.target, self.computed = None, None  # the computed scalar must not outlive the step: it holds gradients
        if not self.checked and torch.is_grad_enabled():  # the model may change the layer's result (softcapping...)
            same = (computed is not None and torch.is_tensor(returned) and returned.numel() == 1
                    and returns_anchor_unchanged(returned))
            if same is None:  # a graph it cannot read (a compiled region): compare the values, one host read
                same = torch.equal(returned.detach().reshape(()), computed.detach().to(returned.dtype))
            if not same:
                got = f"{tuple(returned.shape)} {returned.dtype}" if torch.is_tensor(returned) else type(returned).__name__
                raise UsageError(FLAG, f"{type(inner_model(model)).__name__} does not return its output layer's result "
                                 f"unchanged as its logits (the layer returned the summed loss {computed!r}, the model "
                                 f"{got}: {returned!r}), so the loss cannot be computed inside that layer",
                                 f"pass {FLAG} off")
            self.checked = True
        # the layer's float32 value and gradient; the returned copy adds zero and routes the backward through the
        # engine's hooks on the model's output
        return computed + (returned - returned.detach()).reshape(()).to(computed.dtype), out


#: Autograd nodes that pass a value on unchanged (up to its dtype or shape): casts, views, copies.
_UNCHANGED = {"ToCopyBackward0", "CloneBackward0", "AliasBackward0", "ViewBackward0", "UnsafeViewBackward0",
              "ReshapeAliasBackward0", "SqueezeBackward0", "SqueezeBackward1", "UnsqueezeBackward0",
              "BackwardHookFunctionBackward"}


def returns_anchor_unchanged(returned, depth: int = 16) -> bool | None:
    """Whether the model's ``returned`` logits are the layer's :class:`_Anchor` passed on unchanged: every autograd
    node from ``returned`` back to it is a cast, a view or a copy (:data:`_UNCHANGED`) or an engine's own
    ``torch.autograd.Function`` (DDP's ``_DDPSink``, DeepSpeed's pre-backward function...), and none computes
    (``MulBackward0``, ``TanhBackward0``...: False). Reads no tensor. None when the path runs through a node it
    cannot judge (a compiled graph's ``CompiledFunctionBackward``): the caller compares values instead.
    """
    unknown = False
    stack = [(returned.grad_fn, 0)]
    while stack:  # a path of pass-through nodes to the anchor; a computing node ends its branch
        node, d = stack.pop()
        if node is None or d > depth:
            continue
        forward_cls = getattr(node, "_forward_cls", None)
        if forward_cls is _Anchor:
            return True
        name = type(node).__name__
        if name.startswith("Compiled"):
            unknown = True
        elif name in _UNCHANGED or forward_cls is not None:
            stack.extend((n, d + 1) for n, _ in node.next_functions)
    return None if unknown else False


_LAYERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def fused_head(model, implementation, chunk: int | None = None):
    """``(FusedHead | None, why not)`` for ``model`` (a prepared causal LM): its output layer's switch, installed on
    first use; None with the reason when :func:`output_layer` refuses the model. The layer found is remembered
    per model (weakly), so later calls cost one dictionary look-up."""
    found = _LAYERS.get(model)
    if found is None:
        found = output_layer(model)
        _LAYERS[model] = found
    layer, why = found
    return (FusedHead.on(layer, implementation, chunk) if layer is not None else None), why
