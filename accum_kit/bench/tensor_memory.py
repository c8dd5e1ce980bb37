"""The peak of the tensor memory one run allocates on the CPU: what CUDA's ``max_memory_allocated`` gives on a GPU.

The resident set (:class:`accum_kit.bench.peak_memory.PeakMemory`) counts what the C allocator keeps as well as the
tensors, so on 2 CPU cores its peaks scatter from run to run (measured: the rise of one arm over 24 runs at
vocabulary 50257, 1 x 64 tokens, spread over 27 to 123 MB), by more than one float32 copy of a micro-batch's
logits (12 MB there). :func:`tensor_peak` counts the tensors themselves, with a ``TorchDispatchMode`` that sees
every tensor an operator returns (in the forward, the backward, which autograd runs on the calling thread on
the CPU, and the optimizer step): it adds the bytes of each storage that is new (not the memory of one of the
operator's inputs, as views and in-place results are) once, and takes them off when the storage is freed (a
``weakref.finalize`` on it; PyTorch keeps a storage's Python object alive as long as the storage, so the
finalizer runs when the memory goes). The peak of that sum repeats exactly from run to run. It slows every
operator, so the one-process bench runs it once per arm, untimed, next to the timed runs.
"""

from __future__ import annotations

import weakref

#: How :func:`tensor_peak` measures, as the report states it.
METHOD = "peak bytes of the tensors made during one untimed run per arm (a dispatch mode counting storages)"


def tensor_peak(run) -> float:
    """Call ``run()`` and return the peak, over the call, of the bytes of the tensors it made that were still
    alive, MB (2**20 bytes). Tensors that existed before (weights, an optimizer's state) are not counted;
    tensors made by operators are (a kernel's internal scratch is not)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.seen: set[int] = set()  # data pointers of the storages counted and not yet freed

        def free(self, key: int, nbytes: int) -> None:  # the finalizer of a counted storage
            self.seen.discard(key)
            self.live -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            # an output in an input's memory (a view, an in-place or out= result) is no new tensor: this also
            # keeps out what existed before the run (weights updated in place, the optimizer's state)
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            out = func(*args, **kwargs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if storage.nbytes() and key not in inputs and key not in self.seen:
                        self.seen.add(key)
                        self.live += storage.nbytes()
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(storage, self.free, key, storage.nbytes())
            return out

    mode = LiveBytes()
    with mode:
        run()
    return mode.peak / 2**20
