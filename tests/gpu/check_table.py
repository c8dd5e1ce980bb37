"""The table of tests/gpu/run_checks.sh (not a test module): check, result, figures, in Markdown, printed.

    python3 tests/gpu/check_table.py OUT_DIR

Reads what run_checks.sh left in OUT_DIR: ``gpu_checks.tsv`` (check, exit status or "skipped: why", seconds),
``summary_<check>.json`` (the train jobs' ``train_summary.json``), ``gpu_tests.json`` (the figures tests/gpu
recorded, a ``failed`` entry where a test failed) and ``logs/<check>.log``. Every figure is read as it was
written; a figure that is missing reads "n/a", and nothing here raises on a partial run.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _get(d, *keys):
    for k in keys:
        if isinstance(d, dict):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return None
    return d


def _num(x, fmt="{:.3g}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else "n/a"


def job_figures(s: dict | None) -> str:
    """s/step, tokens/s, eval loss, held gradient bytes and peak against their predictions."""
    if not s:
        return "no train_summary.json"
    mem = s.get("memory") or {}
    parts = [f"{_num(s.get('seconds_per_optimizer_step'))} s/step",
             f"{_num(s.get('tokens_per_second'), '{:,.0f}')} tokens/s",
             f"eval loss {_num(s.get('eval_loss_before'), '{:.4g}')} -> {_num(s.get('eval_loss_after'), '{:.4g}')}",
             f"held gradient bytes / predicted {_num(mem.get('measured_over_predicted'))}",
             f"peak / predicted {_num(_get(mem, 'peak_measured_over_predicted_by_rank', 0))}"
             f" ({_num(_get(mem, 'process_peak_bytes_by_rank', 0), '{:,}')} B, {mem.get('process_peak_method', 'n/a')})",
             f"{s.get('mixed_precision', 'n/a')}, {s.get('per_device_train_batch_size')} x "
             f"{s.get('gradient_accumulation_steps')}, block {s.get('block_size')}"]
    if s.get("gradient_checkpointing"):
        parts.append("gradient checkpointing on")
    comp = s.get("compile")
    if comp:
        parts.append(f"compile {_num(comp.get('compile_seconds'))} s, recompiles after warm-up "
                     f"{comp.get('recompiles_after_warmup', 'n/a')}")
    return "; ".join(parts)


def pytest_figures(log: str, tests: dict | None) -> str:
    """pytest's closing counts, the failed tests by name."""
    counts = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|xfailed|error|errors|xpassed).*?)\s*=*$", log, re.M)
    text = counts[-1] if counts else "no pytest summary line"
    failed = sorted(k for k, v in (tests or {}).items() if isinstance(v, dict) and "failed" in v)
    return text + (f"; failed: {', '.join(failed)}" if failed else "")


#: one row per test figure of note: (label, gpu_tests.json entry, figures from it)
TEST_ROWS = [
    ("inductor exactness (fp32)", "inductor_exactness",
     lambda e: f"largest tolerance used: compiled {_num(max(_get(e, 'compiled', 'tolerance_used_per_step') or [0]))},"
               f" eager {_num(max(_get(e, 'eager', 'tolerance_used_per_step') or [0]))}; TF32 switched on by "
               f"Accelerate {e.get('tf32_switched_on_by_accelerate')}"),
    ("inductor recompiles", "inductor_recompiles",
     lambda e: f"compile {_num(e.get('compile_seconds'))} s, recompiles after warm-up "
               f"{e.get('recompiles_after_warmup')}"),
    ("--auto_find_batch_size under a CUDA cap", "auto_find_batch_size_settles",
     lambda e: f"cap {_num(e.get('cap_bytes'), '{:,}')} B; settled {_get(e, 'settled', 'per_device_train_batch_size')}"
               f" x {_get(e, 'settled', 'gradient_accumulation_steps')} after {len(e.get('attempts') or [])} failures;"
               f" {_num(e.get('seconds_lost'))} s lost; {_num(e.get('capped_seconds'))} s"),
    ("--auto_find_batch_size losses", "auto_find_batch_size_losses",
     lambda e: f"largest relative loss difference {_num(max(e.get('rel_diff_per_step') or [float('nan')]))}"
               f" (tolerance {_num(e.get('tolerance'))})"),
    ("FSDP2 checkpointing memory", "fsdp2_checkpointing_memory",
     lambda e: f"peak / predicted off {_num(_get(e, 'measured_over_predicted', 'off'))}, on "
               f"{_num(_get(e, 'measured_over_predicted', 'on'))}; saving / predicted {_num(e.get('saving_ratio'))}"),
]


def rows(out: Path) -> list[tuple[str, str, str]]:
    tsv = out / "gpu_checks.tsv"
    lines = tsv.read_text().splitlines()[1:] if tsv.exists() else []
    tests = _load(out / "gpu_tests.json")
    table = []
    for line in lines:
        name, status, seconds = (line.split("\t") + ["", ""])[:3]
        log_path = out / "logs" / f"{name}.log"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        if status.startswith("skipped"):
            result = status
        elif status == "0":
            result = f"pass ({seconds} s)"
        elif status in ("124", "137"):
            result = f"**timed out** ({seconds} s)"
        else:
            result = f"**fail**: exit {status} ({seconds} s)"
        try:
            if status.startswith("skipped"):
                figures = ""
            elif name == "pytest_gpu":
                figures = pytest_figures(log, tests)
            elif name == "bench_one_process":
                verdicts = [x.strip() for x in log.splitlines() if re.search(r"\b(PASS|FAIL|UNRESOLVED)\b", x)]
                figures = "; ".join(verdicts[:6]) or "no verdict lines (bench_one_process_bench.json)"
            elif name.startswith("verify_"):
                keep = [" ".join(x.split()) for x in log.splitlines() if x.strip().startswith(("tokens ", "verdict:"))]
                figures = "; ".join(keep) or "no verdict line"
            else:
                figures = job_figures(_load(out / f"summary_{name}.json"))
        except Exception as exc:  # a table with a gap beats no table
            figures = f"figures unreadable: {type(exc).__name__}: {exc}"
        table.append((name, result, figures))
        if name == "pytest_gpu" and tests:
            for label, key, fn in TEST_ROWS:
                if key in tests:
                    e = tests[key]
                    try:
                        f = fn(e)
                    except Exception as exc:
                        f = f"figures unreadable: {type(exc).__name__}: {exc}"
                    table.append((f"  tests/gpu: {label}", "**fail**" if "failed" in e else "pass", f))
    return table


def markdown(table) -> str:
    out = ["| check | result | figures |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c.replace('|', '/')} |" for a, b, c in table]
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(rows(Path(sys.argv[1]))))
