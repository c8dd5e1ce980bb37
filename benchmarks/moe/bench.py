"""Mixture of experts: how far the per-micro-batch router aux loss is from the window's, and what the window costs.

    python benchmarks/moe/bench.py --work /tmp/moe_bench --out benchmarks/moe/results.json

1. Deviation (one process, no launch): ``moe_tiny`` (Mixtral, 4 experts, top-2), one window of
   ``--window`` sequences of ``--block_size`` tokens from the default corpus (the Python standard library),
   split into K micro-batches for K in 1, 2, 4, 8, 16. For each K: the window definition's aux loss (one
   big batch: transformers' ``load_balancing_loss_func``), the per-micro-batch definition (each
   micro-batch's, averaged), their relative difference, and the relative difference of the gradient of
   ``coef x aux`` and of the whole loss (LM token mean + coef x aux) between the two definitions.
2. Cost: the train job on ``moe_tiny`` under 2-process DDP (accelerate_configs/cpu_ddp.yaml), K=8,
   ``--router_aux_loss_scope window`` against ``micro_batch``, in pairs whose order alternates; per run the
   median seconds per optimizer step after the first two; the ratio window / micro_batch per pair and its
   95 % t-interval on the log scale (accum_kit.stats.ratio_interval).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import job_helpers as jh  # noqa: E402
from accum_kit.outputs import atomic_write_json  # noqa: E402
from accum_kit.stats import median, ratio_interval  # noqa: E402


def deviation(args) -> list[dict]:
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from accum_kit.job.data import build_tokenizer, load_raw_datasets, tokenize_datasets
    from accum_kit.job.models import build_model

    torch.manual_seed(0)
    tok = build_tokenizer(None)
    raw, _ = load_raw_datasets(None, None, None, 5)
    lm = tokenize_datasets(raw, tok, args.block_size)["train"]
    ids = torch.tensor(lm.select(range(args.window))["input_ids"])
    model = build_model("moe_tiny", len(tok), args.block_size, seed=0)
    cfg = model.config
    E, k_top, coef = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.router_aux_loss_coef

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])

    def losses(chunks, per_micro: bool):
        ce_sum, n, aux_terms = 0.0, 0, []
        for c in chunks:
            out = model(input_ids=c, output_router_logits=True)
            logits = out.logits[:, :-1].float()
            ce_sum = ce_sum + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                                c[:, 1:].reshape(-1), reduction="sum")
            n += c[:, 1:].numel()
            aux_terms.append(load_balancing_loss_func(out.router_logits, E, k_top))
        return ce_sum / n, sum(aux_terms) / len(aux_terms)

    lm_w, aux_w = losses([ids], False)
    g_aux_w, g_all_w = grads(coef * aux_w), None
    lm_w, aux_w = losses([ids], False)
    g_all_w = grads(lm_w + coef * aux_w)
    rows = []
    for K in (1, 2, 4, 8, 16):
        chunks = list(ids.chunk(K))
        lm_m, aux_m = losses(chunks, True)
        g_aux_m = grads(coef * aux_m)
        lm_m, aux_m = losses(chunks, True)
        g_all_m = grads(lm_m + coef * aux_m)
        rows.append({"K": K, "micro_batch_sequences": args.window // K, "aux_window": aux_w.item(),
                     "aux_micro_batch_mean": aux_m.item(),
                     "aux_rel_diff": abs(aux_m.item() - aux_w.item()) / aux_w.item(),
                     "aux_grad_rel_diff": ((g_aux_m - g_aux_w).norm() / g_aux_w.norm()).item(),
                     "total_grad_rel_diff": ((g_all_m - g_all_w).norm() / g_all_w.norm()).item()})
        print(rows[-1], flush=True)
    return rows


def cost(args) -> dict:
    corpus = jh.write_corpus(args.work / "corpus.txt")
    runs = []
    for i in range(args.pairs):
        for scope in (("window", "micro_batch") if i % 2 == 0 else ("micro_batch", "window")):
            out = args.work / f"{scope}_{i}"
            cmd = jh.accelerate_launch_cmd("-m", "accum_kit", "train", "--train_file", str(corpus), "--model_preset",
                                           "moe_tiny", "--block_size", str(args.block_size), "--max_train_steps",
                                           str(args.steps), "--per_device_train_batch_size", "2",
                                           "--gradient_accumulation_steps", "8", "--max_eval_samples", "8",
                                           "--router_aux_loss_scope", scope, "--output_dir", str(out))
            res = jh.run([str(c) for c in cmd], jh.clean_env(HF_DATASETS_CACHE=str(args.work / "hf_cache")),
                         args.work / "logs", f"{scope}_{i}", timeout=900)
            if res.returncode != 0:
                raise SystemExit(f"{scope} {i} failed:\n{res.describe()}")
            s = json.loads((out / "train_summary.json").read_text())
            runs.append({"scope": scope, "pair": i, "median_step_seconds": median(s["step_seconds"][2:]),
                         "step_seconds": s["step_seconds"]})
            print(runs[-1]["scope"], i, runs[-1]["median_step_seconds"], flush=True)
    by = {(r["scope"], r["pair"]): r["median_step_seconds"] for r in runs}
    ratios = [by[("window", i)] / by[("micro_batch", i)] for i in range(args.pairs)]
    return {"runs": runs, "window_over_micro_batch": {"ratios": ratios, **ratio_interval(ratios)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--window", type=int, default=32, help="sequences per window (divisible by 16)")
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip_cost", action="store_true")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    result = {"settings": {k: str(v) for k, v in vars(args).items()}, "deviation": deviation(args)}
    if not args.skip_cost:
        result["cost"] = cost(args)
        print(result["cost"]["window_over_micro_batch"])
    atomic_write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
