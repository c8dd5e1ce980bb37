"""The loop from a Jupyter notebook: several processes, ready-made pieces, tables and plots.

- :func:`launch` runs a function defined in a notebook cell on N processes that
  form one process group (gloo on CPU, NCCL on GPUs) and returns rank 0's result.
- :func:`lm_dataloaders`: the default corpus (or a local file) as tokenised
  train / validation dataloaders; models come from :func:`accum_kit.job.models.build_model`.
- :func:`ab_compare`: the same windows with and without ``no_sync``, timed side by side.
- :func:`loss_frame`, :func:`comm_frame`: a :class:`accum_kit.LoopResult` and a
  profiler summary as pandas DataFrames; :func:`plot_loss`, :func:`plot_comm`.

``examples/notebooks/accumulation.ipynb`` uses all of them.
"""

from .launcher import LaunchError, launch
from .pieces import ab_compare, comm_frame, lm_dataloaders, loss_frame, plot_comm, plot_loss

__all__ = ["LaunchError", "ab_compare", "comm_frame", "launch", "lm_dataloaders", "loss_frame", "plot_comm", "plot_loss"]
