"""BatchNorm under gradient accumulation, measured: image_classification.py's CNN on the digits, 2 processes.

    pip install -e ".[vision]"   # scikit-learn, for its bundled digits data set
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/by_feature/batchnorm.py

This is ``examples/by_feature/image_classification.py`` with the measurements
of docs/batchnorm.md added (marked ``# New Code #``). It prints:

1. **The deviation table.** For BatchNorm, SyncBatchNorm's arithmetic and
   GroupNorm, and for each K of ``--accumulation_steps`` at the same
   effective batch (``--effective_batch_size`` = B x K x processes), the
   relative distance ``||g - g_big|| / ||g_big||`` between the update the
   loop accumulates and one big batch's on one process, from
   ``accum_kit.verify.verify_accumulation`` (its BatchNorm finding; for
   GroupNorm its exact ``tokens`` row), at initialisation and again after
   ``--num_train_epochs`` of training. ``torch.nn.SyncBatchNorm`` refuses CPU
   tensors (and DDP refuses it on CPU modules), so on CPU the
   ``syncbatchnorm`` model uses :class:`CrossProcessBatchNorm2d`, which
   computes what SyncBatchNorm computes: mean and variance over every
   process's part of the forward, back-propagated through the all-reduce.
2. **The running statistics under DDP.** The BatchNorm model trains with the
   loop (K from ``--gradient_accumulation_steps``) while a counter wraps
   ``torch.distributed._broadcast_coalesced`` (what DDP calls to copy rank 0's
   buffers to every process with ``broadcast_buffers=True``) and a forward
   pre-hook on the first BatchNorm layer records each process's running mean
   just before each forward, after any broadcast. Then: broadcasts per
   window and at which micro-batch, the same with ``sync_each_batch``, each
   process's final running statistics, the saved model's
   (``accelerator.save_model``), and two replays of BatchNorm's update rule
   over the recorded per-micro-batch statistics (rank 0's micro-batches only,
   or rank 1's last window on top of rank 0's history) to say whose they are.
"""

import argparse
import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import get_scheduler

from accum_kit import build_accelerator, train_loop
from accum_kit import classification_loss, optimizer_steps_per_epoch
from accum_kit.verify import verify_accumulation

# New Code #
from accum_kit import LoopCallback, UsageError
from accum_kit.compat import set_accumulation_steps, set_sync_each_batch

NORMS = ("batchnorm", "syncbatchnorm", "groupnorm")  # New Code #


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--validation_split_percentage", type=int, default=20, help="held-out share of the 1797 images")
    p.add_argument("--gradient_accumulation_steps", type=int, default=4, help="K of the running-statistics run")
    p.add_argument("--num_train_epochs", type=int, default=3, help="epochs of the training runs")
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    # New Code #
    p.add_argument("--norms", nargs="+", default=list(NORMS), choices=NORMS, help="models of the deviation table")
    p.add_argument("--accumulation_steps", nargs="+", type=int, default=[1, 4], help="K values of the table")
    p.add_argument("--effective_batch_size", type=int, default=128, help="B x K x processes of every setting")
    p.add_argument("--windows", type=int, default=3, help="disjoint windows of examples per table cell (median, range)")
    p.add_argument("--batchnorm_momentum", type=float, default=0.1, help="BatchNorm's momentum (PyTorch's default)")
    return p.parse_args(argv)


def load_digits_splits(validation_split_percentage: int = 20, seed: int = 0):
    """(train, held-out) lists of ``{"pixel_values": float32 (1, 8, 8) in [0, 1], "labels": int64}``, stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()  # pixel intensities 0..16
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, eval_idx = train_test_split(list(range(len(y))), test_size=validation_split_percentage / 100,
                                           random_state=seed, stratify=digits.target)
    return ([{"pixel_values": x[i], "labels": y[i]} for i in train_idx],
            [{"pixel_values": x[i], "labels": y[i]} for i in eval_idx])


# New Code #
class _AllReduceSum(torch.autograd.Function):
    """Sum over processes; its gradient is the sum over processes too (each process's loss depends on every input)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


# New Code #
class CrossProcessBatchNorm2d(torch.nn.BatchNorm2d):
    """SyncBatchNorm's arithmetic on CPU: in training, the statistics of this forward over all processes.

    Mean and biased variance over (batch, height, width) of every process's
    input, from one all-reduce of (sum, sum of squares, count); the running
    variance gets the unbiased one (count / (count - 1)), as in
    ``torch.nn.SyncBatchNorm``. In eval mode, or on one process, it is BatchNorm2d.
    """

    def forward(self, x):
        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        c = x.size(1)
        local = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), x.new_full((1,), x.numel() / c)])
        total = _AllReduceSum.apply(local)
        n = total[-1]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * n / (n - 1))
        shape = (1, c, 1, 1)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape)


class DigitsCNN(torch.nn.Module):
    """Two 3x3 convolutions (16 and 32 channels), each followed by ``norm`` and ReLU, a 2x2 max-pool, a linear head."""

    def __init__(self, norm: str = "batchnorm", num_classes: int = 10, momentum: float = 0.1):
        super().__init__()

        def norm_layer(channels):
            return {"groupnorm": lambda: torch.nn.GroupNorm(4, channels),
                    "batchnorm": lambda: torch.nn.BatchNorm2d(channels, momentum=momentum),
                    "syncbatchnorm": lambda: CrossProcessBatchNorm2d(channels, momentum=momentum)}[norm]()  # New Code #

        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), norm_layer(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1), norm_layer(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.classifier = torch.nn.Linear(32 * 4 * 4, num_classes)

    def forward(self, pixel_values):
        return self.classifier(self.features(pixel_values).flatten(1))


@torch.no_grad()
def evaluate(accelerator, model, dataloader) -> tuple[float, float]:
    """(mean cross-entropy in nats, accuracy) over the whole held-out split, every process's shard gathered."""
    model.eval()
    logits, labels = [], []
    for batch in dataloader:
        out = model(batch["pixel_values"])
        out, lab = accelerator.gather_for_metrics((out, batch["labels"]))  # drops the padding of the last batch
        logits.append(out)
        labels.append(lab)
    model.train()
    logits, labels = torch.cat(logits), torch.cat(labels)
    loss = torch.nn.functional.cross_entropy(logits.float(), labels).item()
    return loss, (logits.argmax(-1) == labels).float().mean().item()


def train(accelerator, args, model, train_data, eval_data, k: int, callbacks=()):
    """``--num_train_epochs`` of the loop at K = ``k`` with micro-batches of effective_batch_size / (k x processes)."""
    set_accumulation_steps(accelerator, k)  # New Code #: one Accelerator, several K (between windows only)
    batch_size = args.effective_batch_size // (k * accelerator.num_processes)
    train_dl = DataLoader(train_data, batch_size=batch_size, shuffle=True)
    eval_dl = DataLoader(eval_data, batch_size=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    micro_batches = -(-len(train_data) // (batch_size * accelerator.num_processes))
    steps = args.num_train_epochs * optimizer_steps_per_epoch(micro_batches, k)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0,
                              num_training_steps=steps * accelerator.num_processes)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
    _, acc_before = evaluate(accelerator, model, eval_dl)
    result = train_loop(accelerator, model, optimizer, train_dl, lr_scheduler=scheduler,
                        num_train_epochs=args.num_train_epochs, max_grad_norm=1.0,
                        loss_fn=classification_loss, callbacks=callbacks, progress=False)
    return model, optimizer, train_dl, eval_dl, result, acc_before


# New Code #
def deviation(accelerator, args, model, train_data, k: int) -> dict:
    """verify_accumulation at K = ``k`` (same effective batch) on ``--windows`` disjoint windows of examples.

    Per window: the relative distance of the accumulated update from the big
    batch's (BatchNorm of any kind: verify's finding, a train-mode pass; no
    BatchNorm: verify's exact ``tokens`` row, which is then the training arithmetic).
    """
    set_accumulation_steps(accelerator, k)
    batch_size = args.effective_batch_size // (k * accelerator.num_processes)
    rels, passed = [], True
    for w in range(args.windows):
        window = train_data[w * args.effective_batch_size:(w + 1) * args.effective_batch_size]
        report = verify_accumulation(accelerator, model=model, loss_fn=classification_loss, dataset=window,
                                     per_device_train_batch_size=batch_size, seed=args.seed, partial_window=False)
        rels.append(report.batchnorm["rel_error"] if report.batchnorm else report.row("tokens").rel_error)
        passed = passed and report.passed
    return {"K": k, "B": batch_size, "rel_error": sorted(rels)[len(rels) // 2], "min": min(rels), "max": max(rels),
            "windows": rels, "exact_rows_pass": passed}


# New Code #
class BufferWatch(LoopCallback):
    """Counts DDP's buffer broadcasts and records each forward's BatchNorm statistics, per window and micro-batch.

    ``broadcasts``: ``(window, micro-batch in window, tensors)`` per call of
    ``torch.distributed._broadcast_coalesced`` (DDP's buffer broadcast; the
    wrapper is in place between ``on_train_begin`` and ``on_train_end``).
    ``forwards``: per forward of ``layer`` ``(window, micro-batch, running
    mean before the forward, the input's mean and unbiased variance per channel)``.
    """

    def __init__(self, layer: torch.nn.Module):
        self.layer, self.window, self.micro, self.broadcasts, self.forwards = layer, -1, 0, [], []
        self._original, self._handle = None, None

    def on_train_begin(self, state):
        self._original = dist._broadcast_coalesced

        def counted(group, tensors, buffer_size, src=0):
            self.broadcasts.append((self.window, self.micro, len(tensors)))
            return self._original(group, tensors, buffer_size, src)

        dist._broadcast_coalesced = counted  # DDP looks it up on torch.distributed at every call
        self._handle = self.layer.register_forward_pre_hook(self._record)

    def on_micro_batch_begin(self, state):  # before the forward, so before DDP's pre-forward broadcast
        self.window, self.micro = state.step, (self.micro + 1 if state.step == self.window else 0)

    def on_train_end(self, state):
        dist._broadcast_coalesced = self._original
        self._handle.remove()

    def _record(self, module, args):
        x = args[0].detach().double()
        self.forwards.append((self.window, self.micro, module.running_mean.double().tolist(),
                              x.mean((0, 2, 3)).tolist(), x.var((0, 2, 3), unbiased=True).tolist()))


# New Code #
def replay(start_mean, start_var, stats, momentum):
    """BatchNorm's running-statistics rule ``r <- (1 - m) r + m s`` over ``stats`` [(mean, var), ...]; float64."""
    mean, var = torch.as_tensor(start_mean).double(), torch.as_tensor(start_var).double()
    for m, v in stats:
        mean = (1 - momentum) * mean + momentum * torch.as_tensor(m).double()
        var = (1 - momentum) * var + momentum * torch.as_tensor(v).double()
    return mean, var


def _max_diff(a, b) -> float:
    return float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max())


# New Code #
def running_statistics(accelerator, args, train_data, eval_data) -> dict:
    """Train the BatchNorm CNN at K = --gradient_accumulation_steps; whose running statistics end up where."""
    from accelerate.utils import broadcast_object_list, gather_object
    from safetensors.torch import load_file

    k, m = args.gradient_accumulation_steps, args.batchnorm_momentum
    torch.manual_seed(args.seed)
    model = DigitsCNN("batchnorm", momentum=m)
    bn = model.features[1]  # the first BatchNorm layer (16 channels); the second behaves alike
    start = (bn.running_mean.tolist(), bn.running_var.tolist())
    watch = BufferWatch(bn)
    model, optimizer, train_dl, eval_dl, result, _ = train(accelerator, args, model, train_data, eval_data, k, [watch])
    final = {"mean": bn.running_mean.tolist(), "var": bn.running_var.tolist(),
             "num_batches_tracked": int(bn.num_batches_tracked)}
    with tempfile.TemporaryDirectory() as tmp:  # the saved model: what accelerator.save_model writes (main process)
        path = broadcast_object_list([tmp])[0]  # the main process's directory
        accelerator.save_model(model, path)
        accelerator.wait_for_everyone()
        saved = load_file(os.path.join(path, "model.safetensors"))
        accelerator.wait_for_everyone()
    saved = {"mean": saved["features.1.running_mean"].tolist(), "var": saved["features.1.running_var"].tolist(),
             "num_batches_tracked": int(saved["features.1.num_batches_tracked"])}
    loss, accuracy = evaluate(accelerator, model, eval_dl)  # a forward after training: DDP broadcasts once more
    after_eval = bn.running_mean.tolist()

    # sync_each_batch: every micro-batch all-reduces, so every forward follows a synchronised one
    each = BufferWatch(bn)
    set_sync_each_batch(accelerator, True)
    train_loop(accelerator, model, optimizer, train_dl, max_train_steps=2, loss_fn=classification_loss,
               callbacks=[each], progress=False)
    set_sync_each_batch(accelerator, False)
    # K=1: every micro-batch is a window of its own and synchronises
    one = BufferWatch(bn)
    set_accumulation_steps(accelerator, 1)
    train_loop(accelerator, model, optimizer, train_dl, max_train_steps=3, loss_fn=classification_loss,
               callbacks=[one], progress=False)
    set_accumulation_steps(accelerator, k)

    ranks = gather_object([{"forwards": watch.forwards, "broadcasts": watch.broadcasts, "final": final,
                            "after_eval": after_eval, "sync_each_batch_broadcasts": each.broadcasts,
                            "k1_broadcasts": one.broadcasts}])
    r0, r1 = ranks[0], ranks[1] if len(ranks) > 1 else ranks[0]
    steps = result.optimizer_steps
    per_window = [sum(1 for w, _, _ in r0["broadcasts"] if w == s) for s in range(steps)]
    at_micro = sorted({mb for _, mb, _ in r0["broadcasts"]})
    # Buffers before each forward, rank 0 vs rank 1: equal right after a broadcast, apart otherwise.
    equal_at = sorted({(f0[1]) for f0, f1 in zip(r0["forwards"], r1["forwards"]) if _max_diff(f0[2], f1[2]) == 0.0})
    # Replays of r <- (1 - m) r + m s over the recorded per-forward statistics.
    rank0_only = replay(*start, [(f[3], f[4]) for f in r0["forwards"]], m)
    last_window = steps - 1
    rank0_before_last = replay(*start, [(f[3], f[4]) for f in r0["forwards"] if f[0] < last_window], m)
    rank1_last = replay(*rank0_before_last, [(f[3], f[4]) for f in r1["forwards"] if f[0] == last_window], m)
    interleaved = replay(*start, [(f[3], f[4]) for pair in zip(r0["forwards"], r1["forwards"]) for f in pair], m)
    sync_each = [sum(1 for w, _, _ in r0["sync_each_batch_broadcasts"] if w == s) for s in range(2)]
    k1 = [sum(1 for w, _, _ in r0["k1_broadcasts"] if w == s) for s in range(3)]
    return {
        "K": k, "optimizer_steps": steps, "forwards_per_process": len(r0["forwards"]),
        "micro_batches_per_process": result.micro_batches,
        "broadcasts_per_window": per_window, "broadcast_at_micro_batch": at_micro,
        "broadcast_tensors": sorted({n for _, _, n in r0["broadcasts"]}),
        "buffers_equal_across_ranks_at_micro_batch": equal_at,
        "sync_each_batch_broadcasts_per_window": sync_each, "k1_broadcasts_per_window": k1,
        "final_rank0": r0["final"], "final_rank1": r1["final"], "saved": saved,
        "saved_vs_rank0": max(_max_diff(saved["mean"], r0["final"]["mean"]), _max_diff(saved["var"], r0["final"]["var"])),
        "saved_vs_rank1": max(_max_diff(saved["mean"], r1["final"]["mean"]), _max_diff(saved["var"], r1["final"]["var"])),
        "rank0_vs_replay_rank0_only": max(_max_diff(r0["final"]["mean"], rank0_only[0]),
                                          _max_diff(r0["final"]["var"], rank0_only[1])),
        "rank1_vs_replay_rank0_then_own_last_window": max(_max_diff(r1["final"]["mean"], rank1_last[0]),
                                                          _max_diff(r1["final"]["var"], rank1_last[1])),
        "rank0_vs_replay_every_rank": max(_max_diff(r0["final"]["mean"], interleaved[0]),
                                          _max_diff(r0["final"]["var"], interleaved[1])),
        "after_eval_rank1_vs_rank0": _max_diff(r0["after_eval"], r1["after_eval"]),
        "eval_loss": loss, "accuracy": accuracy, "momentum": m,
        "weight_of_last_window": 1 - (1 - m) ** k, "weight_without_accumulation": m,
        "momentum_for_same_horizon": 1 - (1 - m) ** (1 / k),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    accelerator = build_accelerator(args.gradient_accumulation_steps)  # cpu=True when needed, process-count check
    train_data, eval_data = load_digits_splits(args.validation_split_percentage, args.seed)
    W = accelerator.num_processes
    for k in args.accumulation_steps:  # New Code #: every setting must split the effective batch evenly
        if k < 1 or args.effective_batch_size % (k * W):
            raise UsageError("--effective_batch_size", f"{args.effective_batch_size} is not a multiple of K x "
                             f"processes = {k * W} (K={k})", f"pass a multiple of {k * W}, and K >= 1")
    if args.windows < 1 or args.windows * args.effective_batch_size > len(train_data):
        raise UsageError("--windows", f"{args.windows} windows of {args.effective_batch_size} examples do not fit in "
                         f"the {len(train_data)} training images", "pass fewer windows or a smaller effective batch")

    # New Code #: 1. the deviation table, at initialisation and after training
    table = []
    for norm in args.norms:
        torch.manual_seed(args.seed)
        model = DigitsCNN(norm, momentum=args.batchnorm_momentum)
        at_init = [deviation(accelerator, args, model, train_data, k) for k in args.accumulation_steps]
        with warnings_off():
            trained, _, _, eval_dl, result, _ = train(accelerator, args, model, train_data, eval_data,
                                                      max(args.accumulation_steps))
        eval_loss, accuracy = evaluate(accelerator, trained, eval_dl)
        after = [deviation(accelerator, args, accelerator.unwrap_model(trained), train_data, k)
                 for k in args.accumulation_steps]
        table.append({"norm": norm, "at_init": at_init, "trained": after, "accuracy": accuracy, "eval_loss": eval_loss,
                      "trained_steps": result.optimizer_steps})
        accelerator.free_memory()
    head = " | ".join(f"K={d['K']} (B={d['B']}) {when}" for d in table[0]["at_init"] for when in ("init", "trained"))
    accelerator.print(f"\nrelative distance of the accumulated update from the big batch's, median [min, max] over "
                      f"{args.windows} windows (effective batch {args.effective_batch_size}, {W} processes)\n"
                      f"| norm | {head} | held-out accuracy |\n|---|" + "---|" * (2 * len(args.accumulation_steps) + 1))
    for row in table:
        cells = " | ".join(f"{d['rel_error']:.1e} [{d['min']:.1e}, {d['max']:.1e}]"
                           for pair in zip(row["at_init"], row["trained"]) for d in pair)
        accelerator.print(f"| {row['norm']} | {cells} | {row['accuracy']:.3f} |")

    # New Code #: 2. the running statistics of the BatchNorm model
    set_accumulation_steps(accelerator, args.gradient_accumulation_steps)
    stats = running_statistics(accelerator, args, train_data, eval_data)
    accelerator.print(
        f"\nBatchNorm, K={stats['K']}, {stats['optimizer_steps']} optimizer steps on {W} processes:\n"
        f"  DDP buffer broadcasts per window: {stats['broadcasts_per_window']} (at micro-batch "
        f"{stats['broadcast_at_micro_batch']} of each window); with sync_each_batch: "
        f"{stats['sync_each_batch_broadcasts_per_window']}; at K=1: {stats['k1_broadcasts_per_window']}\n"
        f"  buffers equal across ranks before the forward of micro-batch {stats['buffers_equal_across_ranks_at_micro_batch']}\n"
        f"  saved model vs rank 0: {stats['saved_vs_rank0']:.1e}, vs rank 1: {stats['saved_vs_rank1']:.1e}\n"
        f"  rank 0 vs replay over rank 0's micro-batches only: {stats['rank0_vs_replay_rank0_only']:.1e}; "
        f"vs replay over every rank's: {stats['rank0_vs_replay_every_rank']:.1e}\n"
        f"  rank 1 vs replay (rank 0's history, then its own last window): "
        f"{stats['rank1_vs_replay_rank0_then_own_last_window']:.1e}\n"
        f"  num_batches_tracked {stats['saved']['num_batches_tracked']} = micro-batches per process "
        f"({stats['micro_batches_per_process']}, K per full window); last window's weight in the running statistics "
        f"{stats['weight_of_last_window']:.3f} (one update per step: {stats['weight_without_accumulation']:.3f}; "
        f"momentum {stats['momentum_for_same_horizon']:.4f} per micro-batch keeps the per-step horizon)\n"
        f"  held-out accuracy {stats['accuracy']:.3f}")
    return {"world_size": W, "effective_batch_size": args.effective_batch_size, "table": table, "running": stats}


# New Code #
@contextlib.contextmanager
def warnings_off():
    """The loop's BatchNorm warning is the subject here: silence it for the table's training runs."""
    import warnings

    from accum_kit.core.batchnorm import BatchNormAccumulationWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchNormAccumulationWarning)
        yield


if __name__ == "__main__":
    try:
        main()
    except UsageError as exc:  # New Code #: the toolkit's convention for bad flags
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
