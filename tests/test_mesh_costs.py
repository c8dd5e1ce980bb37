"""The mesh cost table (accum_kit/engines/mesh_costs.py) and `plan --tp_size / --cp_size`, in-process, no launch.

Oracles: a plain transformers Llama split by transformers' own tp plan over a 2-process tp mesh of torch's
fake process group (one process; collectives are recorded, not run): its local parameters, the collectives
``CommDebugMode`` counts in one forward and one backward, and the tensors autograd saves; the rest by hand.
"""

from __future__ import annotations

import json
from fnmatch import fnmatch

import pytest

from accum_kit import cli
from accum_kit.engines.mesh import Mesh
from accum_kit.engines.mesh_costs import (DenseTransformer, cp_collectives, layout_meshes, mesh_costs,
                                          tp_collectives)
from accum_kit.errors import UsageError

# torch's module hooks warn about transformers' output classes when the tp plan's forwards are installed
pytestmark = pytest.mark.filterwarnings("ignore:.*backward hook:UserWarning")

# L 2, h 32, a 8 heads of d 4, a_kv 4 (k, v 16 wide), f 48, V 64, untied
CONFIG = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=48, vocab_size=64, tie_word_embeddings=False)
MODEL = DenseTransformer.from_config(CONFIG)
B, SEQ = 2, 16  # micro-batch: 2 examples of 16 tokens


def build(tp: int):
    """A seeded LlamaForCausalLM of CONFIG; with tp 2 split by its tp plan over the fake process group's mesh."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, max_position_embeddings=SEQ, attention_dropout=0.0,
                                         bos_token_id=None, eos_token_id=None, pad_token_id=None))
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        plan = {}  # the plan by concrete name: each split module's own weights, then the module (its forward)
        for pattern, style in model.tp_plan.items():
            for name, module in model.named_modules():
                if fnmatch(name, pattern):
                    plan.update({f"{name}.{p}": style for p, _ in module.named_parameters(recurse=False)})
                    plan[name] = style
        apply_tensor_parallelism(model, mesh["tp"], plan)
    return model


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@pytest.fixture(scope="module")
def measured():
    """Per tp in (1, 2): local parameters per unit, saved activation elements, collectives of one micro-batch."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group left initialized by an earlier test in this process"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    out = {}
    try:
        for tp in (1, 2):
            model = build(tp)
            params = {n: local(p).numel() for n, p in model.named_parameters()}
            layers = [sum(v for n, v in params.items() if n.startswith(f"model.layers.{i}.")) for i in range(2)]
            ptrs = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
            saved = {}

            def pack(t):
                x = local(t)
                if x.dtype.is_floating_point and x.untyped_storage().data_ptr() not in ptrs:
                    saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes() // x.element_size()
                return t

            ids = torch.randint(0, CONFIG["vocab_size"], (B, SEQ))
            with CommDebugMode() as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = model(input_ids=ids).logits
            with CommDebugMode() as bwd:
                logits.float().pow(2).mean().backward()
            counts = lambda mode: {str(k).split(".")[-1].split("'")[0]: v  # noqa: E731
                                   for k, v in mode.get_comm_counts().items()}
            out[tp] = {"params": params, "layers": layers, "saved": sum(saved.values()),
                       "forward": counts(fwd), "backward": counts(bwd)}
    finally:
        dist.destroy_process_group()
    return out


def test_local_parameters_per_unit_match_the_split_model(measured):
    for tp in (1, 2):
        units = MODEL.units(tp)
        p = measured[tp]["params"]
        assert list(units.resharded) == measured[tp]["layers"]
        # kept: head unit (lm_head + final norm), root (embedding)
        assert units.kept == (p["lm_head.weight"] + p["model.norm.weight"], p["model.embed_tokens.weight"])
        assert units.parameters == sum(p.values())
    assert MODEL.parameters == sum(measured[1]["params"].values())
    assert MODEL.units(2).parameters < MODEL.units(1).parameters  # norm weights stay whole: not exactly half
    assert 2 * MODEL.units(2).parameters - MODEL.units(1).parameters == 2 * (2 * 32) + 32  # 2 L + 1 norms of h


def test_tp_collective_counts_match_commdebugmode(measured):
    f, b = measured[2]["forward"], measured[2]["backward"]
    L = CONFIG["num_hidden_layers"]
    tp = {(c.kind, c.formula.split(":")[0]): c.calls for c in tp_collectives(MODEL, 2, B * SEQ, 1, 4)}
    assert tp[("all_reduce", "forward")] == f["all_reduce"] == 2 * L + 1
    assert tp[("all_gather", "forward")] == f["all_gather_into_tensor"] == 1
    assert tp[("all_reduce", "backward")] == b["all_reduce"] == 5 * L + 1
    assert set(b) == {"all_reduce"} and set(f) == {"all_reduce", "all_gather_into_tensor"}
    assert measured[1]["forward"] == {} and measured[1]["backward"] == {}


def test_activation_count_matches_saved_tensors_at_tp_1_and_2(measured):
    """The table's activations minus the loss's logit copies (no loss ran) = autograd's saved elements, less
    RoPE's cos and sin (1 x s x d each, left out of the table)."""
    from accum_kit.engines.activation_memory import LOGIT_COPIES

    T, rope = B * SEQ, 2 * SEQ * MODEL.head_dim
    for tp in (1, 2):
        c = mesh_costs(MODEL, Mesh(1, 1, tp=tp), policy="no_sync", accumulation_steps=2, micro_batch=B, seq=SEQ)
        elements = c.memory["activations"] / 4 - T * LOGIT_COPIES * CONFIG["vocab_size"]
        assert elements == measured[tp]["saved"] - rope
    # by hand at tp 2: per token and layer 6 h + 2 outside tp, (2 h + 2 a_kv d + a + 4 f) / 2 inside; head 3 h + 1
    assert measured[2]["saved"] - rope == T * (2 * (194 + (64 + 32 + 8 + 192) // 2) + 97)


def test_memory_per_process_by_hand_and_it_changes_with_tp_and_cp():
    # W = 8: dp only 1 x 8; dp x tp 1 x 4 x 1 x 2; dp x cp 1 x 4 x 2 x 1 (fp32, no_sync, K = 3)
    layer, norms = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 48, 2 * 32  # 7680 split by tp, 64 whole
    P1 = 2 * (layer + norms) + 2 * 64 * 32 + 32  # 19616
    P2 = 2 * (layer // 2 + norms) + 2 * 64 * 32 // 2 + 32  # 9888: the tp rank's
    kw = dict(policy="no_sync", accumulation_steps=3, micro_batch=B, seq=SEQ)
    dp, tp, cp = (mesh_costs(MODEL, Mesh(1, s, tp=t, cp=c), **kw) for s, t, c in ((8, 1, 1), (4, 2, 1), (4, 1, 2)))
    assert (P1, P2) == (MODEL.parameters, MODEL.units(2).parameters)
    assert dp.memory["parameters"] == P1 * 4 / 8 and dp.memory["optimizer_state"] == P1 * 8 / 8
    assert dp.memory["gradients"] == P1 * 4  # no_sync: the whole (tp-local) gradient until the boundary
    assert tp.memory["parameters"] == P2 * 4 / 4 and tp.memory["optimizer_state"] == P2 * 8 / 4
    assert tp.memory["gradients"] == P2 * 4 < dp.memory["gradients"]
    assert cp.memory["parameters"] == P1 * 4 / 8 and cp.memory["gradients"] == P1 * 4  # FSDP2 over S cp = 8
    inside_tp = 2 * 32 + 2 * 16 + 8 + 4 * 48  # 2 h + 2 a_kv d + a + 4 f
    per_token_layer = {1: 6 * 32 + 2 + inside_tp, 2: 6 * 32 + 2 + inside_tp / 2}
    head = 3 * 32 + 1 + 3 * 64  # the head's 3 h + 1 and 3 float32 copies of the logits (V = 64) at the loss's backward
    assert dp.memory["activations"] == B * SEQ * (2 * per_token_layer[1] + head) * 4
    assert tp.memory["activations"] == B * SEQ * (2 * per_token_layer[2] + head) * 4
    # cp: half the tokens, and the output all-to-all's copy (h) per token and layer
    assert cp.memory["activations"] == B * SEQ // 2 * (2 * (per_token_layer[1] + 32) + head) * 4
    assert tp.memory["total"] < dp.memory["total"] and cp.memory["total"] < dp.memory["total"]


def test_collectives_per_window_by_hand():
    K, e = 3, 2  # bf16 gathers and activations, fp32 reduction
    kw = dict(policy="no_sync", accumulation_steps=K, micro_batch=B, seq=SEQ, param_bytes=4, compute_bytes=2,
              reduce_bytes=4)
    c = mesh_costs(MODEL, Mesh(2, 2, tp=2, cp=2), **kw)  # R 2, S 2, cp 2, tp 2: 16 processes
    groups = {(x.group, x.kind, x.formula.split(":")[0]): x for x in c.collectives}
    Pf, P0, P = 2 * (3840 + 64), 1056 + 1024, 9888  # the tp rank's: layers, head + root
    # FSDP group dp_shard_cp = S cp = 4: no_sync all-gathers K (2 U_f + U_0), reduce-scatters once per unit
    ag, rs, ar = (x for x in c.collectives if not x.per_micro_batch)
    assert (ag.group, ag.calls, ag.bytes) == ("fsdp (4)", K * (2 * 2 + 2), K * (2 * Pf + P0) * 2)
    assert (rs.group, rs.calls, rs.bytes) == ("fsdp (4)", 4, P * 4)
    assert (ar.group, ar.calls, ar.bytes) == ("dp_replicate (2)", 4, P * 4 / 4)  # the shard all-reduced
    T = B * SEQ // 2  # cp halves the tokens per process
    fwd = groups[("tp (2)", "all_reduce", "forward")]
    assert (fwd.calls, fwd.bytes) == (K * 5, K * 5 * T * 32 * e)
    assert groups[("tp (2)", "all_gather", "forward")].bytes == K * T * 64 * e
    bwd = groups[("tp (2)", "all_reduce", "backward")]
    assert (bwd.calls, bwd.bytes) == (K * 11, K * 11 * T * 32 * e)
    a2a = [x for x in c.collectives if x.kind == "all_to_all"]
    # per layer and micro-batch: q, k, v, output forward and their gradients backward; q, output T h / tp,
    # k, v T a_kv d / tp elements per process
    assert [(x.group, x.calls, x.bytes) for x in a2a] == [("cp (2)", 8 * 2 * K,
                                                           2 * 2 * K * T * (32 + 32 + 16 + 16) / 2 * e)]
    assert cp_collectives(MODEL, 1, 2, T, K, e) == [] and tp_collectives(MODEL, 1, T, K, e) == []
    # no_sync saves the data-parallel part only
    se = mesh_costs(MODEL, Mesh(2, 2, tp=2, cp=2), **{**kw, "policy": "sync_each_batch"})
    assert c.no_sync_saves == {"fsdp (4)": (K - 1) * P * 4, "dp_replicate (2)": (K - 1) * P * 4 / 4,
                               "tp (2)": 0.0, "cp (2)": 0.0}
    assert [x.bytes for x in se.collectives if x.per_micro_batch] == \
        [x.bytes for x in c.collectives if x.per_micro_batch]


def test_layouts_on_eight_processes():
    assert layout_meshes(8, 1, 2, 2) == {"data parallel": Mesh(1, 8), "dp x tp": Mesh(1, 4, tp=2),
                                         "dp x cp": Mesh(1, 4, cp=2), "dp x cp x tp": Mesh(1, 2, tp=2, cp=2)}


@pytest.mark.parametrize("argv, flag, fix", [
    (["--tp_size", "3", "--num_processes", "6"], "--tp_size", "[1, 2, 4]"),  # 3 does not divide 8 and 4 heads
    (["--tp_size", "4", "--num_processes", "6"], "--tp_size", "product"),  # 4 does not divide 6 processes
    (["--cp_size", "3", "--num_processes", "6", "--model_preset", "llama3_8b"], "--cp_size", "[1, 2, 4, 8]"),
    (["--cp_size", "2", "--num_processes", "4", "--block_size", "15"], "--cp_size", "multiple of 2"),
    (["--tp_size", "0", "--num_processes", "4"], "--tp_size", ""),
    (["--tp_size", "2", "--num_processes", "4", "--model_preset", "small"], "--model_preset", "llama"),
    (["--tp_size", "2", "--num_processes", "4", "--parallelism_config_dp_replicate_size", "2"],
     "--parallelism_config_dp_replicate_size", "smaller"),
])
def test_bad_mesh_input_exits_2_naming_the_flag(capsys, tmp_path, argv, flag, fix):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    args = list(argv)
    if "--model_preset" not in args:
        args += ["--config_name", str(config)]
    if "--block_size" not in args:
        args += ["--block_size", str(SEQ)]
    assert cli.run("plan", args) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.startswith(f"error: {flag}:") and fix in err.err.split("Fix:")[1]


def test_mesh_flags_refused_without_tp_or_cp():
    with pytest.raises(UsageError, match="--accumulation_policy"):
        mesh_plan_args(accumulation_policy="no_sync")


def mesh_plan_args(**kw):
    from accum_kit.planning.plan_command import PlanArguments

    return PlanArguments(per_device_train_batch_size=1, **kw)


def test_plan_prints_the_comparison_side_by_side(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    argv = ["--config_name", str(config), "--num_processes", "8", "--tp_size", "2", "--cp_size", "2", "--block_size",
            str(SEQ), "--per_device_train_batch_size", str(B), "--gradient_accumulation_steps", "3"]
    assert cli.run("plan", argv) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if "data parallel" in line and "dp x tp" in line)
    assert header.split() == ["data", "parallel", "dp", "x", "tp", "dp", "x", "cp", "dp", "x", "cp", "x", "tp"]
    assert "no_sync vs sync_each_batch, dp x tp: saves the data-parallel part only" in text
    assert cli.run("plan", argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["layouts"]) == {"data parallel", "dp x tp", "dp x cp", "dp x cp x tp"}
    assert data["layouts"]["dp x tp"]["memory"]["gradients"] == 9888 * 4
    assert data["layouts"]["dp x tp"]["group_totals"]["tp (2)"]["calls"] == 3 * (5 + 1 + 11)
