"""The reference loop: exact gradient accumulation in plain PyTorch DDP, no Accelerate.

This is the loop a user writes by hand, the way nanoGPT's ``train.py``
(https://github.com/karpathy/nanoGPT) keeps its own: toggle
``model.require_backward_grad_sync`` so that DDP all-reduces the gradients only
in the backward of the window's last micro-batch. It is the baseline that
``accum-kit bench`` times the toolkit's loop against, and it does the same
arithmetic as :func:`accum_kit.train_loop`.

Arithmetic, for K micro-batches per process and W processes: micro-batch ``i``
on process ``r`` has summed token loss ``S_{r,i}`` and ``n_{r,i}`` target
tokens. Back-propagating the plain sums accumulates ``sum_i grad S_{r,i}`` in
``.grad`` locally; DDP's all-reduce on the last backward averages over the
processes, leaving ``sum_{r,i} grad S_{r,i} / W``. One all-reduce of
(loss sum, tokens) gives ``N = sum_{r,i} n_{r,i}``, and multiplying the
gradients by ``W / N`` leaves ``grad (sum S / N)``: the gradient of the
token-mean loss of the whole window as one big batch on one process.

Sources: PyTorch's DistributedDataParallel docs
(https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html),
``no_sync``: "Within this context, gradients will be accumulated on module
variables, which will later be synchronized in the first forward-backward pass
exiting the context"; ``no_sync`` is a context manager that sets the
``require_backward_grad_sync`` attribute set directly here (as nanoGPT does).

The same loop also runs without DDP, averaging the gradients by hand after
the window's last backward (``average_gradients``, see
:mod:`accum_kit.reference.manual_allreduce`; script flag ``--grad_sync``).

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/raw_ddp_loop.py
    torchrun --nproc_per_node 2 -m accum_kit.reference.raw_ddp [--grad_sync manual_allreduce]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from .. import checks
from ..core.callbacks import CallbackList, LoopCallback, LoopState
from ..compat import ddp_static_graph_unprimed
from ..core.loss import logits_causal_lm_loss, scale_grads_


def train_raw_ddp(model, optimizer, batches, gradient_accumulation_steps: int, max_train_steps: int, device,
                  callbacks=(), average_gradients=None) -> list[float]:
    """Train ``max_train_steps`` optimizer steps of K micro-batches each; return each step's window loss.

    Args:
        model: a ``torch.nn.parallel.DistributedDataParallel`` causal LM, or a
            plain one when ``average_gradients`` is given (the process group
            must be initialised).
        optimizer: any ``torch.optim`` optimizer over ``model``'s parameters.
        batches: an iterator of dicts of (batch, seq) tensors (``input_ids``,
            ``labels`` with -100 = ignored, optionally ``attention_mask``),
            moved to ``device`` here; it must yield K x ``max_train_steps`` dicts.
        gradient_accumulation_steps: K, micro-batches per optimizer step per process.
        max_train_steps: optimizer steps.
        device: the ``torch.device`` the model lives on.
        callbacks: :class:`accum_kit.LoopCallback` instances, called at the same
            points and with the same :class:`accum_kit.LoopState` fields as
            :func:`accum_kit.train_loop` calls them (``on_step_begin`` before the
            token all-reduce and the rescale).
        average_gradients: None for a DDP ``model``; for a plain model, a
            function ``average_gradients(parameters)`` that averages every
            ``.grad`` over the processes (e.g.
            :func:`accum_kit.reference.manual_allreduce.allreduce_per_parameter`), called
            after the backward of each window's last micro-batch, inside that
            micro-batch's backward phase (so a profiler counts it as backward time).

    Returns:
        One loss per optimizer step: token-mean over the window and all processes, nats.

    Raises:
        UsageError: K or ``max_train_steps`` below 1.
        RuntimeError: ``batches`` ran out inside the run.
    """
    checks.at_least("--gradient_accumulation_steps", gradient_accumulation_steps)
    checks.at_least("--max_train_steps", max_train_steps)
    K, world = gradient_accumulation_steps, dist.get_world_size()
    hooks, state, losses = CallbackList(callbacks), LoopState(), []
    model.train()
    hooks("on_train_begin", state)
    for _ in range(max_train_steps):
        window = torch.zeros(2, dtype=torch.float64, device=device)  # this process's (summed loss, target tokens)
        for micro in range(K):
            batch = next(batches, None)
            if batch is None:
                raise RuntimeError(f"batches ran out at optimizer step {state.step}: pass K x max_train_steps of them")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            state.boundary = state.sync = micro == K - 1
            if average_gradients is None:
                # DDP all-reduces only in the window's last backward (and in the very first one of a static-graph
                # model, which fails under no_sync before it has synchronised once; exact either way)
                state.sync = state.sync or ddp_static_graph_unprimed(model)
                model.require_backward_grad_sync = state.sync
            hooks("on_micro_batch_begin", state)
            summed_loss, n_tokens = logits_causal_lm_loss(model, batch)  # the reference keeps the logits' formula
            hooks("on_forward_end", state)
            summed_loss.backward()  # .grad += grad S locally; on the last micro-batch DDP averages over W
            if state.sync and average_gradients is not None:
                average_gradients(model.parameters())  # by hand, after the backward: nothing left to overlap
            hooks("on_backward_end", state)
            state.micro_step += 1
            window += torch.stack([summed_loss.detach().double(), n_tokens.double()])
        hooks("on_step_begin", state)
        dist.all_reduce(window)  # sums over processes: (sum S, N)
        loss_sum, tokens = window.tolist()
        scale_grads_(model.parameters(), world / max(tokens, 1.0))  # sum S / W  ->  sum S / N
        state.loss, state.window_tokens = loss_sum / max(tokens, 1.0), int(tokens)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        losses.append(state.loss)
        hooks("on_step_end", state)
    hooks("on_train_end", state)
    return losses


# --------------------------------------------------------------------------- the script around it


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--train_file", default=None, help="local .txt/.json/.csv file; default: the Python stdlib sources")
    p.add_argument("--model_preset", default="tiny", help="accum_kit.job.models.PRESETS key")
    p.add_argument("--per_device_train_batch_size", type=int, default=4, help="examples per micro-batch per process")
    p.add_argument("--gradient_accumulation_steps", type=int, default=4, help="micro-batches per optimizer step (K)")
    p.add_argument("--block_size", type=int, default=128, help="tokens per example")
    p.add_argument("--max_train_steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad_sync", default="ddp", choices=["ddp", "manual_allreduce", "manual_allreduce_flat"],
                   help="ddp: DistributedDataParallel all-reduces in the window's last backward; manual_allreduce: "
                        "no DDP, one dist.all_reduce per parameter after it (the PyTorch tutorial's loop); "
                        "manual_allreduce_flat: no DDP, one all-reduce of all gradients flattened")
    p.add_argument("--return_checks", action="store_true",
                   help="also return what the tests compare with plain PyTorch: the first window's token ids and "
                        "gradient, and the micro-batches whose backward all-reduced")
    return p.parse_args(argv)


def _init_process_group() -> bool:
    """Join the launcher's gloo group (env vars), or a one-process group; True if this call created it."""
    if dist.is_initialized():  # e.g. an earlier example in the same launch, through Accelerate
        return False
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:  # started as a plain script: a group of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def _forever(loader, sampler):
    """The loader's batches, epoch after epoch (``set_epoch`` reshuffles, as DistributedSampler asks)."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main(argv=None) -> dict:
    """Build data, model, DDP and AdamW by hand, train with :func:`train_raw_ddp`, print the final loss.

    Returns:
        ``{"world_size", "train_loss" (nats per step), "micro_batches" (per process)}``
        plus, with ``--return_checks``, ``"checks"`` (see :class:`_Recorder`).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from ..job.data import build_collator, build_tokenizer, load_raw_datasets, tokenize_datasets
    from ..errors import UsageError
    from ..job.models import build_model

    args = parse_args(argv)
    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_train_steps"):
        checks.at_least(f"--{flag}", getattr(args, flag))
    checks.at_least("--block_size", args.block_size, minimum=2)
    created = _init_process_group()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cpu")  # gloo; a GPU user would use nccl and cuda:LOCAL_RANK
        tokenizer = build_tokenizer()
        if rank != 0:
            dist.barrier()  # rank 0 tokenises first and fills the datasets cache; the others read it
        raw, _ = load_raw_datasets(train_file=args.train_file)
        train = tokenize_datasets(raw, tokenizer, block_size=args.block_size)["train"]
        if rank == 0:
            dist.barrier()
        sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        loader = DataLoader(train, batch_size=args.per_device_train_batch_size, sampler=sampler, drop_last=True,
                            collate_fn=build_collator(tokenizer))
        if len(loader) == 0:
            raise UsageError("--per_device_train_batch_size", "the train dataloader yields no batch",
                             "add data or lower the batch size")
        model = build_model(args.model_preset, len(tokenizer), n_positions=args.block_size, seed=args.seed).to(device)
        recorder = _Recorder(model) if args.return_checks else None
        average = None
        if args.grad_sync == "ddp":
            ddp = DDP(model)  # broadcasts rank 0's weights; every rank built the same ones from the seed anyway
        else:  # no DDP: start from rank 0's weights by hand, average the gradients by hand
            from .manual_allreduce import MANUAL_MODES

            for t in model.state_dict().values():
                dist.broadcast(t, src=0)
            ddp, sync = model, MANUAL_MODES[args.grad_sync]
            average = (lambda params: sync(params, on_call=recorder.record_allreduce)) if recorder is not None else sync
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.learning_rate)
        batches = _forever(loader, sampler)
        if recorder is not None:
            batches = recorder.attach(ddp, optimizer, batches, args.gradient_accumulation_steps)
        losses = train_raw_ddp(ddp, optimizer, batches, args.gradient_accumulation_steps, args.max_train_steps,
                               device, callbacks=[recorder] if recorder is not None else (), average_gradients=average)
        if rank == 0:
            print(f"final train loss {losses[-1]:.4f} (first {losses[0]:.4f}) after {len(losses)} steps "
                  f"of {args.gradient_accumulation_steps} micro-batches on {world} process(es)", flush=True)
        result = {"world_size": world, "train_loss": losses,
                  "micro_batches": args.gradient_accumulation_steps * args.max_train_steps}
        if recorder is not None:
            result["checks"] = recorder.result()
        return result
    finally:
        if created:  # a group that was there before (e.g. Accelerate's) belongs to its creator
            dist.destroy_process_group()


class _Recorder(LoopCallback):
    """``--return_checks``: what the tests compare with a plain one-process PyTorch computation.

    Records the weights' initial sum, this process's token ids of the first
    window, each parameter's gradient (L2 norm and sum) as the first optimizer
    step sees it (after the rescale), and the micro-batch index of every
    gradient all-reduce (a DDP comm hook wrapping the default all-reduce per
    bucket, or, without DDP, :meth:`record_allreduce` per hand-made all-reduce).
    """

    def __init__(self, model):
        self.initial_param_sum = sum(p.detach().double().sum().item() for p in model.parameters())
        self.first_window_input_ids, self.first_step_grads, self.allreduce_micro_steps = [], None, []
        self._micro = 0

    def attach(self, ddp, optimizer, batches, K: int):
        """Register the comm hook (DDP only) and the optimizer pre-step hook; return ``batches``, recorded."""
        self._named = list(getattr(ddp, "module", ddp).named_parameters())
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            ddp.register_comm_hook(state=None, hook=self._comm_hook)
        self._handle = optimizer.register_step_pre_hook(self._before_step)
        return self._record(batches, K)

    def _record(self, batches, K):
        for i, batch in enumerate(batches):
            if i < K:
                self.first_window_input_ids.append(batch["input_ids"].tolist())
            yield batch

    def _comm_hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.allreduce_micro_steps.append(self._micro)
        return allreduce_hook(None, bucket)

    def record_allreduce(self, nbytes, start, seconds, last):
        self.allreduce_micro_steps.append(self._micro)

    def _before_step(self, optimizer, args, kwargs):
        self.first_step_grads = {n: [p.grad.norm().item(), p.grad.sum().item()] for n, p in self._named}
        self._handle.remove()  # the first step only

    def on_micro_batch_begin(self, state: LoopState) -> None:
        self._micro = state.micro_step

    def result(self) -> dict:
        return {"initial_param_sum": self.initial_param_sum, "first_window_input_ids": self.first_window_input_ids,
                "first_step_grads": self.first_step_grads, "allreduce_micro_steps": self.allreduce_micro_steps}


if __name__ == "__main__":
    main()
