"""A plain ``nn.Module`` under FSDP2 with activation checkpointing (not a test module: run as an example script by
tests/test_fsdp.py's shared launch, tests/examples_worker.py's ``main(argv) -> dict`` format).

Accelerate's FSDP2 checkpointing wraps only the classes its auto-wrap policy matches (``_no_split_modules`` or the
config's ``fsdp_transformer_layer_cls_to_wrap``). ``main`` prepares the same stack of blocks twice with
``build_accelerator(gradient_checkpointing=True)``: without ``_no_split_modules`` (it must be refused), and with
the block class named there (each block checkpointed; one backward's sharded gradient, gathered, against the same
model unsharded and without checkpointing on both processes' batches).
"""

from __future__ import annotations

import torch

from test_activation_checkpointing import Stack  # the worker runs from tests/


class NamedStack(Stack):
    _no_split_modules = ["Block"]


def main(argv) -> dict:
    import copy

    from accum_kit import UsageError, build_accelerator
    from accum_kit.compat import full_tensor
    from accum_kit.compat.torch_checkpoint import is_checkpoint_wrapper
    from job_helpers import reset_accelerate_state

    out = {}
    for cls in (Stack, NamedStack):
        reset_accelerate_state()
        acc = build_accelerator(1, gradient_checkpointing=True)
        torch.manual_seed(0)
        model = cls()
        plain = copy.deepcopy(model)
        try:
            model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # FSDP2: both at once
        except UsageError as err:
            out[cls.__name__] = {"refused": str(err)}
            continue
        ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(acc.process_index))
        every = acc.gather(ids)  # both processes' batches: the big batch of the window
        model(ids).sum().backward()
        plain(every).sum().backward()
        grads = {n.replace("_checkpoint_wrapped_module.", ""): full_tensor(p.grad) for n, p in model.named_parameters()}
        diffs = {n: (grads[n] * acc.num_processes - p.grad).abs() for n, p in plain.named_parameters()}
        out[cls.__name__] = {"wrappers": sum(is_checkpoint_wrapper(m) for m in model.modules()),
                             "max_grad_gap": max(d.max().item() for d in diffs.values()),
                             # the suite's fp32 criterion (tests/test_exactness.py): |g - o| <= 1e-6 + 1e-5 |o|
                             "max_grad_excess": max((d - 1e-6 - 1e-5 * p.grad.abs()).max().item()
                                                    for (n, d), p in zip(diffs.items(), plain.parameters()))}
    return out
