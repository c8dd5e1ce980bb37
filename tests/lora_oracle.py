"""The float64 single-process oracle of a LoRA run, shared by the exactness modules (not a test module).

A worker scenario with ``"lora"`` (tests/job_helpers.py's ``LORA``) trains a ``peft.PeftModel`` of the
GPT-2 of tests/test_exactness.py with SGD and momentum. Here the same ``PeftModel`` is built again with
plain peft and torch, loaded from the run's ``init.pt``, converted to float64, and trained one big batch
per window (the summed token loss of every micro-batch of every process, divided by the window's target
tokens), SGD with the same momentum on the trainable parameters only. No accum_kit code runs.

What a run must show (:func:`assert_lora_run`): every trainable (adapter) parameter within the project's
float32 criterion (``ATOL + RTOL |x|``) of the oracle after every step; every frozen parameter bitwise
its initial value after every step; optimizer state for the trainable parameters and for nothing else.
"""

from __future__ import annotations

import math

import torch

import job_helpers as jh
import test_exactness as ex


def _example_nll64(model, example):
    """(summed next-token NLL in float64, target tokens) of one unpadded example."""
    ids = torch.tensor([example["input_ids"]])
    labels = torch.tensor(example["labels"])[1:]
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), dim=-1)
    keep = labels != -100
    return -logp[keep].gather(1, labels[keep].unsqueeze(1)).sum(), int(keep.sum())


def oracle64(init: dict, windows, lora: dict, *, lr: float = ex.LR, momentum: float = jh.LORA_MOMENTUM,
             model_config: dict | None = None, max_grad_norm: float | None = None, rule: str = "tokens") -> list[dict]:
    """The ``PeftModel``'s state dict (float64) after each window's SGD step; see the module docstring.

    ``max_grad_norm``: clip the window's trainable gradient to this L2 norm first (``clip_grad_norm_``'s rule).
    ``rule="mean_of_means"`` is WRONG on purpose: the mean over the window's micro-batches of their token means
    (what the sensitivity checks compare against).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = jh.lora_model(GPT2LMHeadModel(GPT2Config(**(model_config or ex.MODEL_CONFIG))), lora)
        model.load_state_dict(init)
        model.double().train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(trainable, lr=lr, momentum=momentum)
        out = []
        for window in windows:
            opt.zero_grad()
            micro_parts = [[_example_nll64(model, example) for example in micro] for micro in window]
            parts = [p for micro in micro_parts for p in micro]
            loss = sum(p[0] for p in parts) / sum(p[1] for p in parts)
            if rule == "mean_of_means":
                loss = sum(sum(p[0] for p in m) / sum(p[1] for p in m) for m in micro_parts) / len(micro_parts)
            loss.backward()
            if max_grad_norm is not None:
                norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in trainable))
                for p in trainable:
                    p.grad.mul_(min(1.0, max_grad_norm / (norm + 1e-6)))
            opt.step()
            out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return out
    finally:
        torch.set_num_threads(threads)


def trainable_keys(init: dict) -> set:
    """The adapters' keys of a PeftModel state dict (peft names them ``lora_A`` / ``lora_B``)."""
    return {k for k in init if ".lora_A." in k or ".lora_B." in k}


def assert_lora_run(run: dict, world: int, label: str, **oracle_kwargs) -> float:
    """A worker's LoRA scenario against :func:`oracle64` (module docstring); returns the largest
    ``|adapter - oracle|``. ``run``: one scenario as tests/job_helpers.py's ``run_dist_worker`` loads it.
    The comparison must be able to fail: the wrong oracle (:func:`wrong_oracle`: mean of means, or no clipping for
    a clipped scenario) misses the final adapters by more than ``ex.SENSITIVITY_FACTOR`` ATOLs."""
    sc = run["scenario"]
    init, lora = run["init"], sc["lora"]
    adapters = trainable_keys(init)
    assert adapters and len(adapters) < len(init), f"{label}: not a LoRA model ({len(adapters)} adapter tensors)"
    windows = ex.run_windows(world, sc)
    want = oracle64(init, windows, lora, max_grad_norm=sc.get("max_grad_norm"), **oracle_kwargs)
    assert len(run["steps"]) == len(want) == len(windows), f"{label}: {len(run['steps'])} steps, oracle {len(want)}"
    worst = 0.0
    for s, (got, oracle) in enumerate(zip(run["steps"], want)):
        assert got.keys() == init.keys(), f"{label}: the saved state's keys changed"
        for k in init:
            if k in adapters:
                d = (got[k].double() - oracle[k]).abs()
                worst = max(worst, float(d.max()))
                excess = float((d - (ex.ATOL + ex.RTOL * oracle[k].abs())).max())
                assert excess <= 0, f"{label}: adapter {k} after step {s + 1}: {float(d.max()):.2e} from the oracle"
            else:
                assert torch.equal(got[k], init[k]), f"{label}: frozen {k} changed at step {s + 1}"
    wrong = wrong_oracle(init, windows, lora, sc, **oracle_kwargs)[-1]
    miss = max(float((run["steps"][-1][k].double() - wrong[k]).abs().max()) for k in adapters)
    assert miss > ex.SENSITIVITY_FACTOR * ex.ATOL, f"{label}: the wrong oracle is within {miss:.1e}: the check is blind"
    for info in run["ranks"]:
        names = info.get("optimizer_state_names")
        if names is not None:  # the prepared model's names: peft's, with its own prefix
            assert names and all(".lora_A." in n or ".lora_B." in n for n in names), (
                f"{label} rank {info['rank']}: optimizer state for {[n for n in names if 'lora_' not in n][:3]}")
            assert len(names) == len(adapters), f"{label}: optimizer state for {len(names)} of {len(adapters)} adapters"
    return worst


def wrong_oracle(init: dict, windows, lora: dict, sc: dict, **oracle_kwargs) -> list[dict]:
    """WRONG on purpose: a clipped scenario unclipped; any other, the mean of the micro-batches' token means."""
    if sc.get("max_grad_norm") is not None:
        return oracle64(init, windows, lora, **oracle_kwargs)
    return oracle64(init, windows, lora, rule="mean_of_means", **oracle_kwargs)
