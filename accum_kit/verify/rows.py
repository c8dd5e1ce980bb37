"""Main process: the oracle per window, and one row per way of computing the gradient (see :mod:`accum_kit.verify`)."""

from __future__ import annotations

import math

import torch

from ..compat.transformers_moe import eager_experts
from . import batchnorm
from .compare import compare_gradients, scaled_residual
from .mesh import MISCOUNT_BUGS
from .oracle import big_batch_gradient, dataparallel_sum_gradient
from .report import Row, VerifyReport, WindowInfo
from .settings import Captured, RunSettings
from .trainer import trainer_summary
from .workload import Workload

#: row name -> (how our gradient is computed, which oracle gradient it is compared with)
HOW = {
    "tokens": ('train_loop(loss_normalization="tokens")', "big-batch token mean"),
    "mean-of-means": ('train_loop(loss_normalization="mean")', "big-batch token mean"),
    "sum": ("reduction=sum loss, loss.backward() in accumulate", "big-batch sum"),
    "batchnorm (train mode)": ('train_loop(loss_normalization="tokens"), BatchNorm in training mode',
                               "big batch, BatchNorm in training mode"),
}
BATCHNORM_ROW = "batchnorm (train mode)"


def evaluate(s: RunSettings, cap: Captured, oracle_model) -> VerifyReport:
    """Main process: oracle per window, row comparisons, ratios."""
    device, wl = s.device, s.workload
    oracle_model = oracle_model.double().to(device).eval()
    eager_experts(oracle_model)  # a mixture of experts' default grouped matmul has no float64 kernel
    K, r, n_windows = s.gradient_accumulation_steps, s.partial_micro_batches, s.windows
    oracle_cache: dict = {}

    def oracle(indices):
        key = tuple(indices)
        if key not in oracle_cache:
            oracle_cache[key] = big_batch_gradient(oracle_model, wl.window(indices), device, wl.collate_fn,
                                                   wl.oracle_loss)
        return oracle_cache[key]

    windows = []
    for w in range(n_windows):
        idx = cap.window_indices("tokens", w)
        sum_grad, n_tok = oracle(idx)
        mean_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in sum_grad.values())) / max(n_tok, 1)
        windows.append(WindowInfo(
            index=w + 1, partial=w == 1, micro_batches_per_process=K if w == 0 else r, examples=len(idx),
            target_tokens=n_tok, oracle_grad_norm=mean_norm, oracle_sum_grad_norm=mean_norm * n_tok,
            input_ids=[e["input_ids"] for e in wl.window(idx)] if wl.token_data else [], indices=idx))

    rows, sum_pairs = [], []
    for j, name in enumerate(cap.names):
        if name == BATCHNORM_ROW:
            continue
        miscount = name in MISCOUNT_BUGS  # tp / cp: a public miscount run for real, informational
        how, compared = HOW.get(name) or (f'train_loop(loss_normalization="tokens"), {name}', "big-batch token mean")
        row = Row(name, how, compared if wl.token_data else compared.replace("token mean", "item mean"),
                  informational=miscount)
        row.rank_spread = _rank_spread(cap, j, n_windows)
        dots = sqs = 0.0
        for w in range(n_windows):
            sum_grad, n_tok = oracle(cap.window_indices(name, w))
            if name == "sum":  # atol is stated for token-mean gradients; the sum gradient is N times larger
                want, row_atol = sum_grad, s.atol * n_tok
            else:
                want, row_atol = {k: v / max(n_tok, 1) for k, v in sum_grad.items()}, s.atol
            c = compare_gradients(cap.grads[name][w], want, s.rtol, row_atol, s.normwise)
            if name == "sum":
                sum_pairs.append((cap.grads[name][w], want, c))
            row.add_window(w + 1, c)
            dots, sqs = dots + c["dot"], sqs + c["want_sq"]
        row.conclude(s.rtol)
        if miscount:
            row.summary = {"reproduces": MISCOUNT_BUGS[name], "factor": dots / sqs if sqs else float("nan")}
        rows.append(row)

    ratio = residual = None
    if sum_pairs:
        ratio = sum(c["dot"] for *_, c in sum_pairs) / sum(c["want_sq"] for *_, c in sum_pairs)
        residual = scaled_residual([(g, o) for g, o, _ in sum_pairs], ratio)
    else:  # the engine owns the backward (DeepSpeed): it divides every loss by K and averages over the processes
        skipped = Row("sum", HOW["sum"][0], HOW["sum"][1])
        skipped.skipped = ("under DeepSpeed every backward goes through the engine, which divides the loss by K "
                           "and averages over the processes: there is no plain loss.backward() to measure")
        rows.append(skipped)

    n_gpu = torch.cuda.device_count()
    dp_row = Row("sum (DataParallel)", "reduction=sum loss, nn.DataParallel, one process", "big-batch sum")
    dp_ratio = None
    use_dataparallel = s.dataparallel if s.dataparallel is not None else n_gpu >= 2
    if use_dataparallel:
        dots, sqs = 0.0, 0.0
        for w in range(n_windows):
            idx = cap.window_indices("tokens", w)
            want, n_tok = oracle(idx)
            got = dataparallel_sum_gradient(oracle_model, wl.window(idx), collate_fn=wl.collate_fn,
                                            loss_fn=wl.oracle_loss)
            c = compare_gradients(got, want, s.rtol, s.atol * n_tok, s.normwise)
            dots, sqs = dots + c["dot"], sqs + c["want_sq"]
            dp_row.add_window(w + 1, c)
        dp_row.conclude()
        dp_ratio = dots / sqs
    else:
        dp_row.skipped = (f"needs >= 2 CUDA GPUs, found {n_gpu} (on fewer, DataParallel runs the module "
                          "unchanged, so it would measure nothing)")
    rows.append(dp_row)
    if cap.trainer is not None:
        rows.append(_trainer_row(s, cap, _examples_oracle(oracle_model, wl, device)))
    finding = None
    if BATCHNORM_ROW in cap.grads:
        bn_row, finding = _batchnorm_row(s, cap, oracle_model)
        rows.append(bn_row)
    from .oracle import to_oracle
    from .router import router_finding

    router = router_finding(oracle_model, [wl.window(cap.window_indices("tokens", w)) for w in range(n_windows)],
                            s.per_device_train_batch_size, wl.collate_fn, lambda b: to_oracle(b, device))

    mp = s.parallel
    return VerifyReport(
        world_size=s.world_size, distributed_type=s.distributed_type, gradient_accumulation_steps=K,
        per_device_train_batch_size=s.per_device_train_batch_size, seed=s.seed, model=s.model,
        partial_window=s.partial_window, windows=windows, rows=rows, rtol=s.rtol, atol=s.atol,
        selected=s.loss_normalization, ddp_sum_ratio=ratio, ddp_sum_residual=residual,
        dataparallel_sum_ratio=dp_ratio, mixed_precision=s.mixed_precision, normwise=s.normwise,
        autocast=s.autocast, data={"description": wl.description, "items": wl.items, "token_data": wl.token_data},
        batchnorm=finding, router=router, accumulation_policy=s.accumulation_policy, engine=s.engine, casts_model=s.casts_model,
        data_parallel_size=mp.data_parallel_size, token_ranks=mp.token_ranks,
        gradient_mean_size=mp.gradient_mean_size, mesh=mp.mesh,
        oracle={"dtype": "float64", "device": str(device),
                "grad_norm": [w.oracle_grad_norm for w in windows],
                "sum_grad_norm": [w.oracle_sum_grad_norm for w in windows]},
    )


def _rank_spread(cap: Captured, j: int, n_windows: int) -> float:
    """Largest relative difference of row ``j``'s gradient norms between ranks (0: all ranks hold the same)."""
    per_rank = cap.norms[:, j * n_windows:(j + 1) * n_windows]
    return float(((per_rank - per_rank[0]).abs() / per_rank[0].clamp(min=1e-30)).max())


def _examples_oracle(oracle_model, wl: Workload, device):
    """``examples -> (summed-loss gradient, N)`` for the trainer row (it records examples, not indices)."""
    cache: dict = {}

    def oracle(examples):
        key = tuple(tuple(e["input_ids"]) for e in examples)
        if key not in cache:
            cache[key] = big_batch_gradient(oracle_model, examples, device, wl.collate_fn, wl.oracle_loss)
        return cache[key]

    return oracle


def _batchnorm_row(s: RunSettings, cap: Captured, oracle_model) -> tuple[Row, dict]:
    """The informational BatchNorm row and finding: train-mode update against the train-mode big batch."""
    wl, n_windows = s.workload, s.windows
    j = cap.names.index(BATCHNORM_ROW)
    row = Row(BATCHNORM_ROW, *HOW[BATCHNORM_ROW], informational=True)
    row.rank_spread = _rank_spread(cap, j, n_windows)
    comps = []
    with batchnorm.big_batch_statistics(oracle_model):
        for w in range(n_windows):
            sum_grad, n = big_batch_gradient(oracle_model, wl.window(cap.window_indices(BATCHNORM_ROW, w)),
                                             s.device, wl.collate_fn, wl.oracle_loss)
            c = compare_gradients(cap.grads[BATCHNORM_ROW][w], {k: v / max(n, 1) for k, v in sum_grad.items()},
                                  s.rtol, s.atol, s.normwise)
            row.add_window(w + 1, c)
            comps.append(c)
    row.conclude(s.rtol)
    return row, batchnorm.summarize(list(s.batchnorm_layers), comps)


def _trainer_row(s: RunSettings, cap: Captured, oracle) -> Row:
    """The informational ``trainer`` row from :func:`_capture_trainer`'s result (main process)."""
    run = cap.trainer
    row = Row("trainer", f"transformers {run.get('transformers', '')} Trainer, average_tokens_across_devices, "
              "max_grad_norm=0".replace("  ", " "), "big-batch token mean", informational=True)
    if "skipped" in run:
        row.skipped = run["skipped"]
        return row
    n_windows = len(run["grads"])
    if n_windows != s.windows:
        row.skipped = f"Trainer made {n_windows} optimizer steps, expected {s.windows}"
        return row
    windows = [[e for per_rank in run["examples"] for e in per_rank[w]] for w in range(n_windows)]
    comps, summary = trainer_summary(run, windows, oracle)
    for w, c in enumerate(comps):
        row.add_window(w + 1, c)
    per_rank = run["norms"]
    row.rank_spread = float(((per_rank - per_rank[0]).abs() / per_rank[0].clamp(min=1e-30)).max())
    row.conclude(s.rtol)
    summary.update(same_examples_as_tokens_row=all(
        windows[w] == cap.window_examples("tokens", w) for w in range(n_windows)),
        loss_type=run["loss_type"], loss_shifts_labels=run["loss_shifts_labels"], model_class=run["model_class"])
    row.summary = summary
    return row
