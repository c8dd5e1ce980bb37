"""Collectives counted by mesh dimension (accum_kit/profiler/mesh_collectives.py).

One 2-process gloo launch (forked, accum_kit.notebook.launch) runs two cases, each against counts
derived without the counter:

- tensor parallel: torch's own ``parallelize_module`` (ColwiseParallel then RowwiseParallel) on a 1-D
  "tp" mesh of 2. Per micro-batch the forward all-reduces the row-wise layer's output (B x D_OUT) once
  and the backward all-reduces the column-wise layer's input gradient (B x D_HID) once (the Megatron
  f / g pair, Shoeybi et al. 2019, section 3); torch's ``CommDebugMode`` counts the same pass
  independently. None of them is deferred by a no-sync micro-batch.
- data parallel on a 2-D ("dp_shard", "tp") = (2, 1) mesh: a plain model in DDP over the dp_shard
  group, one no-sync and one sync micro-batch per window: the sync backward all-reduces every
  gradient (one bucket: the parameters' bytes), the no-sync one nothing; a scalar all-reduce between
  the last backward and the end of the step is classed ``step``.

The same launch runs ``train_loop`` with ``CommProfiler(by_mesh_dim=True)`` on a DDP model without a mesh:
the gradient all-reduces it counts are those the profiler's DDP comm hook recorded.
"""

from __future__ import annotations

import os

import pytest
import torch

import job_helpers as jh

B, D_IN, D_HID, D_TP, D_OUT = 4, 3, 6, 8, 5
K = 2  # micro-batches per window; the first is no-sync, the last syncs


def _window(counter, step: int, micro_batch, sync_of, step_phase=None) -> None:
    """One window of K micro-batches through the counter's loop hooks (what train_loop calls)."""
    from accum_kit.core.callbacks import LoopState

    state = LoopState(step=step)
    for i in range(K):
        state.micro_step, state.sync = step * K + i, sync_of(i)
        counter.on_micro_batch_begin(state)
        loss = micro_batch(i)
        counter.on_forward_end(state)
        loss.backward()
        counter.on_backward_end(state)
    counter.on_step_begin(state)
    if step_phase is not None:
        step_phase()
    state.step += 1
    counter.on_step_end(state)


def _tensor_parallel() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from types import SimpleNamespace

    from accum_kit.profiler.mesh_collectives import mesh_collective_counter

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID), torch.nn.Linear(D_HID, D_TP), torch.nn.ReLU(),
                                torch.nn.Linear(D_TP, D_OUT))  # the first layer stays plain: its output needs a grad
    parallelize_module(model, mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})
    xs = [torch.randn(B, D_IN) for _ in range(K)]
    counter = mesh_collective_counter(SimpleNamespace(torch_device_mesh=mesh))
    _window(counter, 0, lambda i: model(xs[i]).square().sum(), lambda i: i == K - 1)
    with CommDebugMode() as oracle:  # torch's own count of one forward and backward
        model(xs[0]).square().sum().backward()
    return {"summary": counter.summary(), "records": [r.counts for r in counter.micro_batches],
            "oracle_calls": oracle.get_total_counts(),
            "oracle_kinds": sorted(str(k) for k in oracle.get_comm_counts()),
            "tp_group": mesh.get_group().group_name, "world_group": dist.group.WORLD.group_name,
            "figures": counter.step_figures(0)}


def _data_parallel() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel
    from types import SimpleNamespace

    from accum_kit.profiler.mesh_collectives import mesh_collective_counter

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID), torch.nn.Tanh(), torch.nn.Linear(D_HID, D_OUT))
    model = DistributedDataParallel(plain, process_group=mesh.get_group("dp_shard"))
    counter = mesh_collective_counter(SimpleNamespace(torch_device_mesh=mesh))
    x = torch.randn(B, D_IN) + dist.get_rank()

    def micro_batch(i):
        if i == K - 1:
            return model(x).square().sum()
        with model.no_sync():  # forward and backward under it
            loss = model(x).square().sum()
            loss.backward()
        return loss.detach().requires_grad_()  # the counter's backward phase then runs nothing

    def step_phase():
        dist.all_reduce(torch.ones(()))  # e.g. the window's loss, on the default group

    for step in range(3):  # DDP rebuilds its buckets after the first synced backward: two windows not counted
        counter.labels.enabled = step == 2
        _window(counter, step, micro_batch, lambda i: i == K - 1, step_phase)
    return {"summary": counter.summary(), "records": [r.counts for r in counter.micro_batches],
            "windows": len(counter.windows), "figures": counter.step_figures(2),
            "param_bytes": sum(p.numel() * p.element_size() for p in plain.parameters()),
            "dp_group": mesh.get_group("dp_shard").group_name, "world_group": dist.group.WORLD.group_name}


def _profiled_ddp() -> dict:
    import accum_kit
    from accum_kit.profiler import CommProfiler, format_table

    acc = accum_kit.build_accelerator(K, cpu=True)  # forms the process group
    model, opt, loader = jh.prepared_tiny_lm(acc, n_examples=16)  # 4 micro-batches per process: 2 windows
    default_off = CommProfiler(acc, model).mesh is None
    prof = CommProfiler(acc, model, by_mesh_dim=True)
    accum_kit.train_loop(acc, model, opt, loader, profiler=prof, progress=False)
    summary = prof.summary()  # collective
    return {"summary": summary, "table": format_table(summary), "default_off": default_off,
            "left_active": prof.mesh._active}


def _all_cases() -> dict:
    torch.set_num_threads(1)
    return {"profiler": _profiled_ddp(), "tp": _tensor_parallel(), "dp": _data_parallel()}


@pytest.fixture(scope="module")
def launched():
    from accum_kit.notebook import launch

    return launch(_all_cases, num_processes=2, timeout=60)


def test_tensor_parallel_all_reduces_counted_on_tp(launched):
    got = launched["tp"]
    fwd, bwd = B * D_OUT * 4, B * D_HID * 4  # the row-wise output, the column-wise input gradient (float32)
    assert got["oracle_calls"] == 2 and got["oracle_kinds"] == ["c10d_functional.all_reduce"], got
    for counts in got["records"]:  # every micro-batch, sync or not
        assert counts == {("tp", "all_reduce", "forward"): [1, fwd], ("tp", "all_reduce", "backward"): [1, bwd]}
    s = got["summary"]
    assert s["mesh"] == {"tp": 2} and s["windows"] == 1 and s["micro_batches"] == K
    tp = s["by_dim"]["tp"]
    assert tp["calls_per_window"] == 2 * K and tp["bytes_per_window"] == K * (fwd + bwd)
    assert tp["calls_per_sync_micro_batch"] == tp["calls_per_no_sync_micro_batch"] == 2
    assert tp["calls_per_window_min"] == tp["calls_per_window_max"] == 2 * K
    assert set(tp["by_class"]) == {"tensor_parallel"} and set(tp["by_phase"]) == {"forward", "backward"}
    scope = s["no_sync_scope"]
    assert scope["every_micro_batch_dims"] == ["tp"] and scope["saved_dims"] == []
    assert scope["not_saved_calls_per_window"] == 2 * K and scope["gradient_sync_calls_saved_per_window"] == 0
    assert "data-parallel part only" in scope["note"] and "tp" in scope["note"]
    assert got["figures"] == {"mesh_tp_calls": 2 * K, "mesh_tp_bytes": K * (fwd + bwd)}


def test_data_parallel_all_reduce_is_gradient_sync(launched):
    got = launched["dp"]
    grads = got["param_bytes"]
    assert got["windows"] == 1  # the two disabled windows left no record
    no_sync, sync = got["records"]
    assert no_sync == {} and sync == {("dp_shard", "all_reduce", "backward"): [1, grads]}
    s = got["summary"]
    assert s["mesh"] == {"dp_shard": 2, "tp": 1}
    dp = s["by_dim"]["dp_shard"]
    assert dp["calls_per_sync_micro_batch"] == 1 and dp["calls_per_no_sync_micro_batch"] == 0
    assert dp["bytes_per_sync_micro_batch"] == grads
    assert dp["by_class"] == {"gradient_sync": {"calls_per_window": 1, "bytes_per_window": grads},
                              "step": {"calls_per_window": 1, "bytes_per_window": 4}}
    assert s["by_dim"]["tp"]["calls_per_window"] == 0
    scope = s["no_sync_scope"]
    assert scope["saved_dims"] == ["dp_shard"] and scope["gradient_sync_calls_saved_per_window"] == 1
    assert scope["gradient_sync_bytes_saved_per_window"] == grads and scope["not_saved_calls_per_window"] == 0
    assert got["figures"] == {"mesh_dp_shard_calls": 2, "mesh_dp_shard_bytes": grads + 4,
                              "mesh_tp_calls": 0, "mesh_tp_bytes": 0}


def test_profiler_counts_ddp_by_mesh_dim_as_its_comm_hook_does(launched):
    """No mesh: every collective on "dp"; the sync backwards' all-reduces are the gradient synchronisation the
    profiler's DDP comm hook recorded in the same run (another mechanism), and no_sync defers all of them."""
    got = launched["profiler"]
    s, block = got["summary"], got["summary"]["by_mesh_dim"]
    assert got["default_off"] and block["mesh"] is None and set(block["by_dim"]) <= {"dp"}
    assert block["windows"] == s["optimizer_steps"] and block["micro_batches"] == s["micro_batches"]
    grad = block["by_class"]["gradient_sync"]
    assert s["allreduce_calls"] > 0 and grad["dims"] == ["dp"]
    assert grad["calls_per_window"] == s["allreduce_calls_per_step"]
    assert grad["bytes_per_window"] == s["allreduce_bytes_per_step"]
    assert grad["calls_per_sync_micro_batch"] == s["allreduce_calls_per_sync"]
    assert grad["calls_per_no_sync_micro_batch"] == 0
    scope = block["no_sync_scope"]
    saved = s["allreduce_calls_per_sync"] * s["skipped_syncs"] / s["optimizer_steps"]  # every no-sync skips them all
    assert scope["gradient_sync_calls_saved_per_window"] == saved
    assert s["no_sync_saving_scope"] == scope["note"] and "no tensor- or context-parallel dimension" in scope["note"]
    assert "mesh dim (2 windows)" in got["table"] and not got["left_active"]


def test_counter_is_on_by_default_only_for_a_model_parallel_mesh():
    from types import SimpleNamespace

    from accum_kit.profiler.mesh_collectives import wants_mesh_counter

    def mesh(*names):
        return SimpleNamespace(torch_device_mesh=SimpleNamespace(mesh_dim_names=names) if names else None)

    assert wants_mesh_counter(mesh("dp_shard", "tp"), None) and wants_mesh_counter(mesh("dp_shard", "cp"), None)
    assert not wants_mesh_counter(mesh("dp_replicate", "dp_shard"), None) and not wants_mesh_counter(mesh(), None)
    assert not wants_mesh_counter(mesh("tp"), False) and wants_mesh_counter(mesh(), True)
