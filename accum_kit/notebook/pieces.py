"""Ready-made pieces that keep a notebook short; each reuses the toolkit's own modules."""

from __future__ import annotations


def lm_dataloaders(accelerator, *, block_size: int = 128, per_device_train_batch_size: int = 4,
                   per_device_eval_batch_size: int = 8, max_eval_samples: int | None = 64,
                   train_file: str | None = None, packing: bool = True, seed: int = 0):
    """Tokenised train / validation dataloaders of the default corpus (or ``train_file``), not yet prepared.

    The same pipeline as the train job (:mod:`accum_kit.job.data`): the Python
    standard library sources by default, byte-level tokenizer, packed blocks of
    ``block_size`` tokens (or one padded example per piece of text with
    ``packing=False``). Tokenisation runs on the main process first and is
    cached by ``datasets``.

    Args:
        accelerator: the run's Accelerator (for ``main_process_first``).
        block_size: tokens per example.
        per_device_train_batch_size, per_device_eval_batch_size: examples per micro-batch per process.
        max_eval_samples: keep the first N validation examples (None: all).
        train_file: a local .txt/.json/.jsonl/.csv file instead of the default corpus.
        packing: pack blocks (True) or variable-length padded examples (False).
        seed: seeds the train dataloader's shuffling.

    Returns:
        ``(tokenizer, train_dataloader, eval_dataloader)``.

    Raises:
        UsageError: a missing or unreadable ``train_file``, an empty dataset.
    """
    import torch
    from torch.utils.data import DataLoader

    from ..job.data import build_collator, build_tokenizer, load_raw_datasets, tokenize_datasets
    from ..job.tracking import quiet_other_processes

    quiet_other_processes(accelerator)  # one set of datasets progress bars
    tokenizer = build_tokenizer()
    with accelerator.main_process_first():
        raw, _ = load_raw_datasets(train_file=train_file)
        data = tokenize_datasets(raw, tokenizer, block_size=block_size, packing=packing)
    valid = data["validation"]
    if max_eval_samples is not None:
        valid = valid.select(range(min(max_eval_samples, len(valid))))
    collate = build_collator(tokenizer, packing)
    train_dl = DataLoader(data["train"], batch_size=per_device_train_batch_size, shuffle=True, collate_fn=collate,
                          generator=torch.Generator().manual_seed(seed))
    eval_dl = DataLoader(valid, batch_size=per_device_eval_batch_size, collate_fn=collate)
    return tokenizer, train_dl, eval_dl


def ab_compare(accelerator, model, optimizer, train_dataloader, *, windows: int = 3, warmup_steps: int = 1,
               **loop_kwargs):
    """Train the same run with windows alternating between ``sync_each_batch`` and ``no_sync``; time both.

    After ``warmup_steps`` optimizer steps, ``2 x windows`` windows alternate
    (:class:`accum_kit.profiler.ABSwitch`), so machine drift hits both modes
    alike; the update is the same either way, only the moment of the
    all-reduce changes. Collective: call it on every process.

    Args:
        accelerator, model, optimizer, train_dataloader: prepared objects, as for :func:`accum_kit.train_loop`.
        windows: optimizer steps measured in each mode.
        warmup_steps: steps run first and not measured.
        **loop_kwargs: more :func:`accum_kit.train_loop` arguments (``lr_scheduler``, ``max_grad_norm``, ...).

    Returns:
        ``(table, result, comm)``: a DataFrame with one row per mode (``mode``,
        ``windows`` measured, ``s/step`` median seconds per optimizer step,
        ``all-reduces/step`` gradient-bucket all-reduces per measured step on
        this process, ``speedup`` = sync_each_batch s/step over this mode's), the
        :class:`accum_kit.LoopResult`, and the profiler's ``comm`` summary of
        the no_sync windows with the A/B figures and ``ab_window_modes`` (the
        mode of each measured window, in order). The speedup of so few windows
        is a first look, not a measurement with an interval: ``accum-kit bench``
        gives those.
    """
    import pandas as pd

    from ..core.loop import train_loop
    from ..profiler import ABSwitch, CommProfiler

    prof = CommProfiler(accelerator, model)
    ab = ABSwitch(accelerator, windows, prof, warmup_steps=warmup_steps)
    result = train_loop(accelerator, model, optimizer, train_dataloader, max_train_steps=warmup_steps + 2 * windows,
                        profiler=prof, callbacks=[ab], progress=False, **loop_kwargs)
    ab_figures = ab.summary()
    comm = {**prof.summary(), **ab_figures, "ab_window_modes": list(ab.sequence)}
    seconds = {"sync_each_batch": ab_figures["seconds_per_step_sync_each_batch"],
               "no_sync": ab_figures["seconds_per_step_no_sync"]}
    rows = []
    for mode in ("sync_each_batch", "no_sync"):
        rec = prof.records(mode=mode)  # the measured windows only: the warm-up runs before DDP settles its buckets
        steps = {st.step for st in rec.steps if st.step >= warmup_steps}
        rows.append({"mode": mode, "windows": len(ab.times[mode]), "s/step": seconds[mode],
                     "all-reduces/step": sum(c.step in steps for c in rec.calls) / max(len(steps), 1),
                     "speedup": seconds["sync_each_batch"] / seconds[mode]})
    return pd.DataFrame(rows), result, comm


def loss_frame(result):
    """A :class:`accum_kit.LoopResult` as a DataFrame: one row per optimizer step.

    Columns: ``step`` (1-based), ``loss`` (nats, the window's token mean),
    ``tokens`` (target tokens of the window, all processes), ``seconds`` (wall
    time of the step).
    """
    import pandas as pd

    return pd.DataFrame({"step": range(1, len(result.train_loss) + 1), "loss": result.train_loss,
                         "tokens": result.step_tokens, "seconds": result.step_seconds})


def comm_frame(summary: dict):
    """A profiler summary (``CommProfiler.summary()``) as a DataFrame: one row per figure.

    Columns: ``figure`` (the summary key), ``main`` (the main process's value),
    and ``min`` / ``median`` / ``max`` over processes where the summary has them.
    Units are in the key names (``_seconds``, ``_bytes``, ``_GBps``).
    """
    import pandas as pd

    spread = summary.get("spread", {})
    rows = []
    for key, value in summary.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        s = spread.get(key) or {}
        rows.append({"figure": key, "main": value, "min": s.get("min"), "median": s.get("median"), "max": s.get("max")})
    return pd.DataFrame(rows)


def plot_loss(result, ax=None, label: str | None = None):
    """Training loss per optimizer step (nats) of a LoopResult; returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(result.train_loss) + 1), result.train_loss, marker=".", label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats / target token)")
    ax.grid(alpha=0.3)
    if label:
        ax.legend()
    return ax


def plot_comm(table, ax=None):
    """Seconds per optimizer step by mode, from an A/B table (a DataFrame with ``mode`` and ``s/step``); returns the Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3))
    ax.bar(table["mode"], table["s/step"], color=["tab:red", "tab:green"][: len(table)])
    ax.set_ylabel("seconds per optimizer step")
    for x, y in zip(table["mode"], table["s/step"]):
        ax.annotate(f"{y:.3f}", (x, y), ha="center", va="bottom")
    return ax
