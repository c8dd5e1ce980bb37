"""Train a GPT-2-style model with exact, no_sync gradient accumulation.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/train.py --output_dir runs/demo

Takes the flags of transformers' run_clm_no_trainer.py (see --help). The job
itself is accum_kit/job/train.py; to write your own loop around the same pieces,
see examples/custom_loop.py.
"""

import sys

from accum_kit.cli import run

if __name__ == "__main__":
    sys.exit(run("train"))
