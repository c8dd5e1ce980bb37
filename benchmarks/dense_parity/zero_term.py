"""What the experts' zero-gradient term costs one backward of a dense model (benchmarks/README.md, "Dense models and
the experts' zero gradients").

The `small` preset (9 layers, d = 512, 28.6M parameters), one micro-batch of 1 x 64 tokens, one CPU thread: the
backward of the summed cross-entropy with and without ``accum_kit.engines.moe.with_zero_gradients`` (the term DDP
and ZeRO-1/2 add for a model with per-module experts), in interleaved pairs (the order alternating), after 3 pairs
of warm-up. Prints the medians and the ratio with its 95 % interval (``accum_kit.stats.ratio_interval``).

    python benchmarks/dense_parity/zero_term.py [PAIRS]   # default 20
"""

from __future__ import annotations

import sys
import time

import torch

from accum_kit.engines.moe import with_zero_gradients
from accum_kit.job.models import build_model
from accum_kit.stats import median, ratio_interval


def main(pairs: int = 20) -> None:
    torch.set_num_threads(1)
    model = build_model("small", 384, 64, seed=0)
    ids = torch.randint(0, 384, (1, 64), generator=torch.Generator().manual_seed(0))

    def backward_seconds(term: bool) -> float:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        start = time.perf_counter()
        (with_zero_gradients(loss, model.parameters()) if term else loss).backward()
        return time.perf_counter() - start

    for _ in range(3):
        backward_seconds(False), backward_seconds(True)
    plain, term, ratios = [], [], []
    for i in range(pairs):
        times = {o: backward_seconds(o) for o in ((False, True) if i % 2 == 0 else (True, False))}
        plain.append(times[False]), term.append(times[True]), ratios.append(times[True] / times[False])
    ci = ratio_interval(ratios)
    print(f"pairs {pairs}: backward without term median {median(plain) * 1e3:.1f} ms, with term "
          f"{median(term) * 1e3:.1f} ms; with / without {ci['median']:.3f} [{ci['low']:.3f}-{ci['high']:.3f}] "
          "(95 % t-interval on log ratios)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
