"""The reference loop in plain PyTorch DDP, without Accelerate: read accum_kit/reference/raw_ddp.py.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/raw_ddp_loop.py
    torchrun --nproc_per_node 2 examples/raw_ddp_loop.py

Open ``accum_kit/reference/raw_ddp.py``: ``train_raw_ddp`` is the one-screen loop
(nanoGPT's ``require_backward_grad_sync`` toggle, summed token losses, one
all-reduce of the token count and the W / N rescale at each window's end) and
``main`` builds the data, the model, DDP and AdamW by hand around it. Compare
with ``examples/custom_loop.py``, which gets the same update from
``accum_kit.train_loop`` on Accelerate. This script only runs that ``main``.
"""

from accum_kit.reference.raw_ddp import main as _main


def main(argv=None) -> dict:
    """Run :func:`accum_kit.reference.raw_ddp.main` (same flags; ``--help`` lists them) and return its results."""
    return _main(argv)


if __name__ == "__main__":
    main()
