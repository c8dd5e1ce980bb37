"""The router's load-balancing loss under accumulation (accum_kit.core.router_loss), in one process.

Oracle: one forward of the whole window as one padded batch on one process, its token-mean cross-entropy
plus ``router_aux_loss_coef`` times transformers' own ``load_balancing_loss_func`` on that batch's router
logits and attention mask (the function Mixtral's forward uses), back-propagated; SGD. The loop runs the
same window as K micro-batches through ``accum_kit.train_loop`` with :class:`RouterAuxLoss`.
"""

from __future__ import annotations

import json

import pytest
import torch

import job_helpers as jh
import test_exactness as ex

MOE = dict(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0, num_local_experts=4,
           num_experts_per_tok=2, router_aux_loss_coef=0.5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
N_EX = 16  # examples per run: one per micro-batch, K of them per window
# Small steps: top-k routing is discontinuous, so two computations that differ by rounding (the loop's and the
# oracle's sums run in different orders) may route a token near a tie differently once the parameters have
# drifted apart by that rounding; at lr 0.5 that happened after a few steps (a 7.7e-6 jump).
LR = 0.1


def _model():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**MOE))


def _big_batch_oracle(model, windows, lr):
    """Parameters after each window's step: CE token mean + coef x load_balancing_loss_func on the big batch."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out, aux_values = [], []
    for window in windows:
        batch = jh.pad_collate(ex.PAD_ID)(window)
        res = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
        logits, labels = res.logits[:, :-1].float(), batch["labels"][:, 1:]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                               ignore_index=-100, reduction="sum") / (labels != -100).sum()
        aux = load_balancing_loss_func(res.router_logits, MOE["num_local_experts"], MOE["num_experts_per_tok"],
                                       batch["attention_mask"])
        opt.zero_grad()
        (ce + MOE["router_aux_loss_coef"] * aux).backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in model.named_parameters()})
        aux_values.append(aux.item())
    return out, aux_values


def _loop(accelerator, k, scope, lr):
    from torch.utils.data import DataLoader

    from accum_kit import train_loop
    from accum_kit.core.router_loss import RouterAuxLoss, RouterWindowRecords

    acc = accelerator(k)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loader = DataLoader(ex.EXAMPLES[:N_EX], batch_size=1, shuffle=False, collate_fn=jh.pad_collate(ex.PAD_ID))
    pmodel, popt, ploader = acc.prepare(model, opt, loader)
    loss = RouterAuxLoss(acc, pmodel, scope=scope)
    steps = []

    class Keep:
        def on_step_end(self, state):
            steps.append({n: p.detach().clone() for n, p in pmodel.named_parameters()})

    train_loop(acc, pmodel, popt, ploader, num_train_epochs=1, loss_fn=loss,
               callbacks=[RouterWindowRecords(loss), Keep()], progress=False)
    return steps, loss.windows


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_the_window_definition_is_the_big_batch(accelerator, one_process, k):
    """scope="window": every step within 1e-6 of the big batch's CE + coef x aux for K in 1, 2, 4, 8; the
    recorded window aux is transformers' value on the big batch."""
    lr = LR
    steps, records = _loop(accelerator, k, "window", lr)
    windows = [ex.EXAMPLES[i: i + k] for i in range(0, N_EX, k)]
    want, aux = _big_batch_oracle(_model(), windows, lr)
    ex.assert_params_match(steps, want, f"window K={k}")
    assert [r["aux_loss_window"] for r in records] == pytest.approx(aux, rel=1e-6)
    assert all(sum(r["tokens_per_expert"]) > 0 for r in records)


def test_the_micro_batch_definition_drifts_from_the_window_one_as_k_grows(accelerator, one_process):
    """scope="micro_batch" is the big batch at K=1 and moves away from it for K > 1 (its fractions are each
    micro-batch's): the comparison can fail, and the deviation is what docs/moe.md reports."""
    lr = LR
    deviation = {}
    for k in (1, 4):
        steps, _ = _loop(accelerator, k, "micro_batch", lr)
        windows = [ex.EXAMPLES[i: i + k] for i in range(0, N_EX, k)]
        want, _ = _big_batch_oracle(_model(), windows, lr)
        deviation[k] = max((a[n] - b[n]).abs().max().item() for a, b in zip(steps, want) for n in b)
    assert deviation[1] < ex.ATOL
    assert deviation[4] > ex.SENSITIVITY_FACTOR * ex.ATOL, deviation


# --------------------------------------------------------------------------- two processes, DDP and FSDP2

TWO_PROCESS = [
    {"name": "window_k3", "K": 3, "policy": "no_sync", "router_aux_loss_scope": "window"},
    {"name": "micro_batch_k3", "K": 3, "policy": "no_sync", "router_aux_loss_scope": "micro_batch"},
]
FSDP_ONLY = [
    {"name": "window_k3_no_reshard", "K": 3, "policy": "no_sync_no_reshard", "router_aux_loss_scope": "window"},
    {"name": "window_k3_bf16", "K": 3, "policy": "no_sync", "router_aux_loss_scope": "window",
     "mixed_precision": "bf16"},
]
POOL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def pooled(tmp_path_factory, ddp_pool, fsdp_pool):
    """tests/mesh_worker.py's Mixtral scenarios on the session's 2-process DDP and FSDP2 pools (no launch of
    their own): ``{"ddp"|"fsdp": {name: {"init", "steps", "ranks"}}}``."""
    root = tmp_path_factory.mktemp("router_loss")
    submitted = {}
    for kind, pool, scenarios in (("ddp", ddp_pool, TWO_PROCESS), ("fsdp", fsdp_pool, TWO_PROCESS + FSDP_ONLY)):
        spec = {"model_class": "mixtral", "model_config": MOE, "seed": 0, "lr": LR, "pad_id": ex.PAD_ID,
                "examples": ex.EXAMPLES, "scenarios": scenarios}
        (root / f"{kind}.json").write_text(json.dumps(spec))
        submitted[kind] = (pool.submit("mesh_worker", [root / f"{kind}.json", root / kind],
                                       script=jh.REPO / "tests" / "mesh_worker.py"), scenarios)
    verify = ddp_pool.submit("verify", ["--model_preset", "moe_tiny", "--gradient_accumulation_steps", "2",
                                        "--trainer_row", "false", "--json", root / "verify.json"])
    out = {}
    for kind, (cmd, scenarios) in submitted.items():
        res = cmd.result(POOL_TIMEOUT_S)
        if res.returncode != 0:
            pytest.fail(f"{kind} worker failed\n{res.describe()}", pytrace=False)
        out[kind] = {sc["name"]: {"init": torch.load(root / kind / sc["name"] / "init.pt", weights_only=True),
                                  "steps": torch.load(root / kind / sc["name"] / "steps.pt", weights_only=True),
                                  "ranks": [json.loads((root / kind / sc["name"] / f"rank{r}.json")
                                                                     .read_text()) for r in range(2)]}
                     for sc in scenarios}
    res = verify.result(POOL_TIMEOUT_S)
    assert res.returncode == 0, res.describe()
    out["verify"] = (json.loads((root / "verify.json").read_text()), res.stdout)
    return out


def _oracle_from(init, k):
    model = _model()
    model.load_state_dict(init, strict=False)
    windows = [[e for micro in w for e in micro] for w in ex.windows_for(2, k, 1)]
    return _big_batch_oracle(model, windows, LR)


@pytest.mark.parametrize("kind,name", [("ddp", "window_k3"), ("fsdp", "window_k3"), ("fsdp", "window_k3_no_reshard")])
def test_the_window_definition_over_two_processes_is_the_big_batch(pooled, kind, name):
    """The window's fractions summed over both ranks: every step within 1e-6 of the big batch of both ranks'
    micro-batches (K=3 with a partial last window); both ranks record the same window values."""
    run = pooled[kind][name]
    want, aux = _oracle_from(run["init"], 3)
    ex.assert_params_match(run["steps"], want, f"{kind} {name}")
    for info in run["ranks"]:
        assert [w["aux_loss_window"] for w in info["router_windows"]] == pytest.approx(aux, rel=1e-6)
    assert run["ranks"][0]["router_windows"] == run["ranks"][1]["router_windows"]


def test_the_micro_batch_definition_over_two_processes_is_not_the_big_batch(pooled):
    run = pooled["ddp"]["micro_batch_k3"]
    want, _ = _oracle_from(run["init"], 3)
    worst = max((a[n] - b[n]).abs().max().item() for a, b in zip(run["steps"], want) for n in b)
    assert worst > ex.SENSITIVITY_FACTOR * ex.ATOL
    assert pooled["fsdp"]["micro_batch_k3"]["ranks"][0]["train_loss"] == \
        pytest.approx(run["ranks"][0]["train_loss"], rel=1e-6)


def test_bf16_under_fsdp2_runs_and_stays_near_the_big_batch(pooled):
    """bf16 autocast with FSDP2's fp32 reduction: no crash (the fused experts of Mixtral get a gradient slice
    every micro-batch), the logged losses within 1e-2 relative of fp32's."""
    got, fp32 = pooled["fsdp"]["window_k3_bf16"], pooled["fsdp"]["window_k3"]
    assert got["ranks"][0]["train_loss"] == pytest.approx(fp32["ranks"][0]["train_loss"], rel=1e-2)


def test_verify_reports_the_per_micro_batch_deviation_on_the_users_model(pooled):
    """accum-kit verify on moe_tiny (2 DDP processes, K=2): the tokens row passes (the LM gradient is exact on a
    mixture of experts), and the router finding gives, per window, both aux values and how far the
    per-micro-batch definition moves the aux gradient from the window's (far: its micro-batches are 2 tiny
    examples)."""
    report, stdout = pooled["verify"]
    assert report["passed"] and report["rows"]["tokens"]["passed"]
    router = report["router"]
    assert router["experts"] == 4 and router["top_k"] == 2 and len(router["windows"]) == 2
    assert [w["micro_batches"] for w in router["windows"]] == [4, 2]  # K x 2 processes, then the partial window
    assert all(w["gradient_rel_diff"] > 0.01 and w["aux_window"] != w["aux_micro_batch_mean"] for w in router["windows"])
    assert "router aux loss (4 experts, top-2" in stdout


def test_an_expert_parallel_model_is_refused(accelerator, one_process):
    """A model whose config carries transformers' DistributedConfig with ep_size > 1 is refused in prepare, naming
    ep_size and the fix; the same model without it prepares."""
    from types import SimpleNamespace

    from accum_kit import UsageError

    acc = accelerator(2)
    model = _model()
    model.config.distributed_config = SimpleNamespace(ep_size=2)
    with pytest.raises(UsageError) as err:
        acc.prepare(model)
    assert err.value.flag == "ep_size" and "distributed_config" in err.value.fix
    model.config.distributed_config = None
    acc.prepare(model)
