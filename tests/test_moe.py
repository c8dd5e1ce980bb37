"""Mixture-of-experts models under accumulation: no crash or hang whatever the routing, and the big batch's update.

tests/moe_model.py's model has one module per expert and routes by token id, so the data decides which
micro-batch of a window, and which rank, sends tokens to an expert: one expert per routing pattern (only the
window's first / middle / last micro-batch, only rank 0's first / last, never). tests/moe_worker.py trains it
under every policy and precision of an engine in one run per engine: a script run of conftest.py's
``fsdp_pool`` (FSDP2) and ``ddp_pool`` (DDP); HSDP (tests/test_hsdp.py) and DeepSpeed ZeRO 1/2/3
(tests/test_deepspeed.py) run it inside their own launches and check it with the functions here.

Expected values come from a plain single-process PyTorch loop (no Accelerate, no accum_kit): one big batch
per window (every rank's micro-batches of the window), the summed next-token cross-entropy over the window's
tokens, SGD with weight decay. A parameter that no token of the window reached has no gradient there (``.grad`` is
None) and SGD skips it: weight decay does not move it. fp32 runs equal the oracle within the suite's tolerance
(tests/test_exactness.py); an expert that never gets a token does not move at all, in every precision; a bf16
run's update of each pattern's expert is the fp32 oracle's up to bf16's rounding. Under DeepSpeed ZeRO, whose
optimizer steps flat partitions, such a parameter steps with a zero gradient instead (it moves by weight decay
alone): there the oracle gives it a zero gradient too.

The dense model of tests/moe_model.py (no experts, one parameter no forward uses) checks that a dense model is left
to the engine: under DDP with ``find_unused_parameters`` and under FSDP2 the unused parameter does not move and the
rest equals the oracle; under DDP without it the run stops with a UsageError naming ``--ddp_find_unused_parameters``
before any optimizer step.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

import job_helpers as jh
import moe_model as mm

ATOL, RTOL = 1e-6, 1e-5  # tests/test_exactness.py's fp32 criterion
BF16_UPDATE_RTOL = 0.05  # a bf16 update within 5 % of the fp32 oracle's (a dropped micro-batch misses by 1/K or more)
SPEC = {"B": 2, "windows": 2, "tail": 1, "lr": 0.5, "weight_decay": 0.1, "seed": 0}
K = 3
POOL_TIMEOUT_S = 300
FSDP_POLICIES = ("sync_each_batch", "no_sync", "no_sync_no_reshard_after_backward", "no_sync_no_reshard")


def cell(name, policy="no_sync", precision="no", top_k=1, **kw) -> dict:
    return {"name": name, "K": K, "policy": policy, "precision": precision, "top_k": top_k, **kw}


FSDP_CELLS = [cell(f"{p}_{prec}_top{k}", p, prec, k) for p in FSDP_POLICIES for prec in ("no", "bf16") for k in (1, 2)]
FSDP_CELLS += [cell(f"user_loop_{prec}", precision=prec, user_loop=True) for prec in ("no", "bf16")]
FSDP_CELLS += [cell("dense_no_sync", model="dense")]
DDP_CELLS = [cell(f"{p}_{prec}", p, prec) for p in ("sync_each_batch", "no_sync") for prec in ("no", "bf16")]
DDP_CELLS += [cell("no_sync_top2", top_k=2), cell("user_loop", user_loop=True),
              cell("find_unused", ddp_kwargs={"find_unused_parameters": True}),
              cell("static_graph", ddp_kwargs={"static_graph": True}),
              cell("dense_find_unused", model="dense", ddp_kwargs={"find_unused_parameters": True})]
DDP_ERROR_CELLS = [cell("dense_unused", model="dense", expect_usage_error=True)]
HSDP_CELLS = [cell(f"no_sync_{prec}", precision=prec) for prec in ("no", "bf16")] + [
    cell("no_sync_no_reshard_bf16", "no_sync_no_reshard", "bf16")]
ZERO_CELLS = [cell(f"zero{s}_{prec}", precision=prec, zero_stage=s) for s in (1, 2, 3) for prec in ("no", "bf16")]
ZERO_CELLS += [cell("zero2_no_top2", top_k=2, zero_stage=2)]


def example_script(cells: list, work) -> dict:
    """tests/examples_worker.py's entry for a launch that runs ``cells`` (tests/moe_worker.py), writing under ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "moe_spec.json").write_text(json.dumps({**SPEC, "cells": cells}))
    return {"name": "moe", "path": str(jh.REPO / "tests" / "moe_worker.py"), "argv": [str(work / "moe_spec.json"), str(work / "moe")]}


def load(work, cells: list) -> dict:
    """``{name: {"init": {param: tensor}, "steps": [{param: tensor}, ...]}}`` of a finished run of :func:`example_script`."""
    return {c["name"]: torch.load(work / "moe" / f"{c['name']}.pt", weights_only=True) for c in cells}


def run_on_pool(pool, cells: list, work) -> dict:
    entry = example_script(cells, work)
    res = pool.submit("moe", entry["argv"], script=jh.REPO / "tests" / "moe_worker.py").result(POOL_TIMEOUT_S)
    assert res.returncode == 0, res.describe()
    return load(work, cells)


# ---- the oracle: one process, plain PyTorch --------------------------------------------------------------------
def _batch(examples):
    return torch.tensor([e["input_ids"] for e in examples]), torch.tensor([e["labels"] for e in examples])


@functools.lru_cache(maxsize=None)
def oracle(top_k: int, W: int, user_loop: bool = False, zero_fill: bool = False, model: str = "moe") -> list[dict]:
    """Parameters after each optimizer step of the big-batch run: one window = the K micro-batches of all W ranks.

    ``user_loop``: Accelerate's guide instead of the token mean, i.e. each micro-batch's mean loss divided by K
    and averaged over the ranks, which on these equal-length micro-batches is the window's token mean times
    (the window's micro-batches / K): the partial window weighs 1/K. ``zero_fill``: a parameter no token of the
    window reached steps with a zero gradient (DeepSpeed's flat partitions) instead of none. ``model``: a key of
    tests/moe_model.py's ``MODELS``.
    """
    torch.manual_seed(SPEC["seed"])
    model = mm.MODELS[model](top_k)
    opt = torch.optim.SGD(model.parameters(), lr=SPEC["lr"], weight_decay=SPEC["weight_decay"])
    examples = mm.pattern_examples(list(mm.PATTERNS), K=K, W=W, B=SPEC["B"], windows=SPEC["windows"],
                                   tail=SPEC["tail"], seed=SPEC["seed"])
    per_window = [K] * SPEC["windows"] + ([SPEC["tail"]] if SPEC["tail"] else [])
    steps, start = [], 0
    for k in per_window:
        n = k * W * SPEC["B"]
        ids, labels = _batch(examples[start: start + n])
        start += n
        logits = model(ids).logits[:, :-1]
        target = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="sum")
        loss = loss / target.numel() * (k / K if user_loop else 1)
        loss.backward()
        for p in model.parameters():  # under zero_fill, a parameter no token reached: a zero gradient (decay applies)
            if zero_fill and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return steps


def decayed(init: torch.Tensor, steps: int) -> torch.Tensor:
    """A parameter with a zero gradient after ``steps`` SGD steps with weight decay: ``p (1 - lr wd)^steps``."""
    return init * (1 - SPEC["lr"] * SPEC["weight_decay"]) ** steps


def oracle_of(c: dict, W: int) -> list[dict]:
    """:func:`oracle` for cell ``c``: its top-k, loop and model; zero gradients for unreached parameters under ZeRO."""
    return oracle(c["top_k"], W, bool(c.get("user_loop")), bool(c.get("zero_stage")), c.get("model", "moe"))


def unreached_names(c: dict) -> list[str]:
    """The parameters of cell ``c``'s model that no token ever reaches."""
    return mm.UNUSED_NAMES if c.get("model") == "dense" else mm.expert_names(mm.EXPERT_OF["never"])


# ---- the checks (also called by tests/test_hsdp.py and tests/test_deepspeed.py) ----------------------------------
def check_exact(run: dict, c: dict, W: int) -> float:
    """fp32: every parameter after every step equals the big batch's within the suite's tolerance; the gap."""
    want = oracle_of(c, W)
    assert len(run["steps"]) == len(want)
    gap = 0.0
    for got_step, want_step in zip(run["steps"], want):
        for name, w in want_step.items():
            g = got_step[name]
            gap = max(gap, (g - w).abs().max().item())
            assert torch.allclose(g, w, atol=ATOL, rtol=RTOL), (c["name"], name, (g - w).abs().max().item())
    return gap


def check_unreached(run: dict, c: dict) -> None:
    """The parameters no token ever reaches (the never-used expert; the dense model's unused layer): unchanged, bit
    for bit, after every step (no gradient, so SGD's weight decay skips them), in every precision; under DeepSpeed
    ZeRO ``p (1 - lr wd)^s`` after step ``s`` (a zero gradient; DeepSpeed bf16 hands back its bf16 weights: within
    their rounding)."""
    bf16_weights = c["precision"] == "bf16" and c.get("zero_stage")
    for s, step in enumerate(run["steps"], 1):
        for name in unreached_names(c):
            if not c.get("zero_stage"):
                assert torch.equal(step[name], run["init"][name]), (c["name"], name, s)
                continue
            want = decayed(run["init"][name], s)
            tol = dict(atol=1e-3, rtol=1e-2) if bf16_weights else dict(atol=ATOL, rtol=RTOL)
            assert torch.allclose(step[name], want, **tol), (c["name"], name, s)


def check_bf16_follows(run: dict, c: dict, W: int) -> dict:
    """bf16: each pattern's expert moved, over the run, by the fp32 oracle's update within :data:`BF16_UPDATE_RTOL`
    of it (relative, in the norm); ``{pattern: relative gap}``."""
    want = oracle_of(c, W)[-1]
    gaps = {}
    for pattern, e in mm.EXPERT_OF.items():
        if pattern == "never":
            continue
        names = mm.expert_names(e)
        moved = torch.cat([(want[n] - run["init"][n]).flatten() for n in names])
        off = torch.cat([(run["steps"][-1][n] - want[n]).flatten() for n in names])
        gaps[pattern] = (off.norm() / moved.norm()).item()
        assert gaps[pattern] <= BF16_UPDATE_RTOL, (c["name"], pattern, gaps[pattern])
    return gaps


def check_cell(run: dict, c: dict, W: int) -> None:
    check_unreached(run, c)
    if c["precision"] == "no":
        check_exact(run, c, W)
    else:
        check_bf16_follows(run, c, W)


# ---- the pools' runs ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, fsdp_pool):
    return run_on_pool(fsdp_pool, FSDP_CELLS, tmp_path_factory.mktemp("moe_fsdp"))


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, ddp_pool):
    return run_on_pool(ddp_pool, DDP_CELLS + DDP_ERROR_CELLS, tmp_path_factory.mktemp("moe_ddp"))


def test_the_oracle_sees_every_routing_pattern():
    """The data does what the patterns say: each pattern's expert gets a nonzero update from the big batch beyond
    weight decay but the never-used one, which does not move at all (no gradient; with ``zero_fill`` weight decay
    alone moves it); top-1 and top-2 differ."""
    torch.manual_seed(SPEC["seed"])
    init = {n: p.detach().clone() for n, p in mm.TinyMoE(1).named_parameters()}
    last, filled, steps = oracle(1, 2)[-1], oracle(1, 2, zero_fill=True)[-1], len(oracle(1, 2))
    for pattern, e in mm.EXPERT_OF.items():
        moved = max((last[n] - decayed(init[n], steps)).abs().max().item() for n in mm.expert_names(e))
        assert pattern == "never" or moved > 100 * ATOL, (pattern, moved)
    for n in mm.expert_names(mm.EXPERT_OF["never"]):
        assert torch.equal(last[n], init[n])
        assert torch.allclose(filled[n], decayed(init[n], steps), atol=ATOL, rtol=RTOL)
        assert (filled[n] - init[n]).abs().max() > 100 * ATOL
    assert not torch.allclose(oracle(1, 2)[-1]["block.router.weight"], oracle(2, 2)[-1]["block.router.weight"])


@pytest.mark.parametrize("c", FSDP_CELLS, ids=lambda c: c["name"])
def test_fsdp2_trains_every_routing_pattern_without_crash_and_exactly(fsdp_runs, c):
    """FSDP2, each policy x precision x top-k and the user's own loop: every step ran (no crash, no hang); fp32
    equals the big batch; the never-used expert moves only by weight decay; bf16 follows fp32."""
    run = fsdp_runs[c["name"]]
    assert len(run["steps"]) == SPEC["windows"] + 1
    check_cell(run, c, 2)


@pytest.mark.parametrize("c", DDP_CELLS, ids=lambda c: c["name"])
def test_ddp_trains_every_routing_pattern_without_crash_and_exactly(ddp_runs, c):
    """DDP with and without ``find_unused_parameters`` and ``static_graph``, both policies, both precisions; the dense
    model with ``find_unused_parameters``."""
    run = ddp_runs[c["name"]]
    assert len(run["steps"]) == SPEC["windows"] + 1
    check_cell(run, c, 2)


def test_a_dense_model_with_an_unused_parameter_under_ddp_is_told_to_find_unused_parameters(ddp_runs):
    """Dense model, DDP without ``find_unused_parameters``, a parameter no forward uses: the window's first
    synchronising backward raises a UsageError naming ``--ddp_find_unused_parameters`` and the unused parameters,
    on every rank, before any optimizer step (DDP alone would step on unreduced gradients, then fail at the next
    forward with "Expected to have finished reduction in the prior iteration")."""
    run = ddp_runs["dense_unused"]
    err = run["error"]
    assert err is not None and err["flag"] == "--ddp_find_unused_parameters", err
    assert all(n in err["problem"] for n in mm.UNUSED_NAMES) and "mix.weight" not in err["problem"], err
    assert "--ddp_find_unused_parameters" in err["fix"] and run["steps"] == []


def test_one_process_leaves_every_unreached_parameter_without_gradient(accelerator, tmp_path):
    """One process (no DDP), in this process: the big batch's update exactly, and the never-used expert unchanged."""
    import moe_worker

    c = cell("one_process")
    moe_worker.run_cell(SPEC, c, tmp_path)
    run = torch.load(tmp_path / "one_process.pt", weights_only=True)
    assert len(run["steps"]) == SPEC["windows"] + 1
    check_cell(run, c, 1)


def test_the_zero_gradient_term_adds_nothing_but_a_gradient_for_every_parameter():
    """accum_kit.engines.moe.with_zero_gradients: same loss value, same gradients where the forward reached, a zero
    gradient (not None) for the expert it did not reach."""
    from accum_kit.engines.moe import with_zero_gradients

    torch.manual_seed(0)
    model = mm.TinyMoE(1)
    ids = torch.randint(0, mm.COMMON, (2, mm.SEQ))
    loss = model(ids).logits.square().sum()
    plain = {n: g for n, g in zip(dict(model.named_parameters()), torch.autograd.grad(loss, list(model.parameters()), allow_unused=True))}
    loss = model(ids).logits.square().sum()
    both = with_zero_gradients(loss, model.parameters())
    assert both.item() == loss.item()
    both.backward()
    for n, p in model.named_parameters():
        if plain[n] is None:
            assert p.grad is not None and not p.grad.any(), n
        else:
            assert torch.equal(p.grad, plain[n]), n
    assert any(plain[n] is None for n in mm.expert_names(mm.EXPERT_OF["never"]))


def test_the_reached_parameters_are_those_autograd_gives_a_gradient():
    """accum_kit.engines.reached.reached_leaves against autograd itself (``torch.autograd.grad(..., allow_unused=True)``
    gives None exactly for the parameters a loss does not reach): top-1 and top-2 routing, a micro-batch reaching the
    common experts only and one reaching a pattern's expert too; the zero-gradient term reaches every parameter."""
    from accum_kit.engines.moe import with_zero_gradients
    from accum_kit.engines.reached import reached_leaves

    for top_k in (1, 2):
        torch.manual_seed(0)
        model = mm.TinyMoE(top_k)
        params = dict(model.named_parameters())
        for ids in (torch.randint(0, mm.COMMON, (2, mm.SEQ)), torch.tensor([[0, 1, mm.COMMON + 2, 3, 4, 5]])):
            loss = model(ids).logits.square().sum()
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, retain_graph=True)
            want = {n for n, g in zip(params, grads) if g is not None}
            got = {n for n, p in params.items() if id(p) in reached_leaves(loss)}
            assert got == want and want != set(params), (top_k, sorted(set(params) - want))
            every = reached_leaves(with_zero_gradients(loss, params.values()))
            assert {n for n, p in params.items() if id(p) in every} == set(params)
    assert reached_leaves(torch.ones(2)) == set()


def test_reentrant_checkpointing_of_experts_is_refused_where_their_zero_gradient_cannot_be_added():
    """DDP and ZeRO-1/2 put the zero-gradient term in the loss; reentrant checkpointing would give a checkpointed
    parameter two gradient-hook calls, so the term is left out then, and a model with experts is refused (the
    flag and the fix named); the same model without reentrant, on one process, or under ZeRO-3 is not."""
    from types import SimpleNamespace

    from accum_kit import UsageError
    from accum_kit.engines.ddp import DDPEngine
    from accum_kit.engines.deepspeed import ZeroEngine
    from accum_kit.engines.moe import expert_blocks, reentrant_checkpointing

    def acc(reentrant, processes=2):
        plan = SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return SimpleNamespace(run_plan=plan, num_processes=processes, ddp_handler=None)

    assert [type(b).__name__ for b in expert_blocks(mm.TinyMoE())] == ["MoEBlock"]
    assert reentrant_checkpointing(acc(True)) and not reentrant_checkpointing(acc(False))
    engines = [DDPEngine(), ZeroEngine(SimpleNamespace(zero_stage=1)), ZeroEngine(SimpleNamespace(zero_stage=2))]
    for engine in engines:
        with pytest.raises(UsageError) as err:
            engine.apply_activation_checkpointing(acc(True), mm.TinyMoE())
        assert err.value.flag == "--gradient_checkpointing_kwargs" and "drop use_reentrant" in err.value.fix
        for ok in (acc(False), acc(True, processes=1)):
            engine.apply_activation_checkpointing(ok, mm.TinyMoE())
    ZeroEngine(SimpleNamespace(zero_stage=3)).apply_activation_checkpointing(acc(True), mm.TinyMoE())


def test_an_expert_made_an_fsdp2_unit_of_its_own_is_named():
    """engines/moe.experts_as_units: the experts (and modules inside one) among FSDP2's unit modules, by name; the
    block that holds them, the root and the dense modules are not."""
    from accum_kit.engines.moe import experts_as_units

    model = mm.TinyMoE()
    experts = model.block.experts
    assert experts_as_units(model, [model, model.block, model.head]) == []
    assert experts_as_units(model, [model.block, experts[1], experts[3].up]) == ["block.experts.1", "block.experts.3.up"]
