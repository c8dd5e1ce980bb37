"""Faults under DeepSpeed ZeRO 1, 2 and 3: a killed worker, an elastic restart, a crash mid-save.

    python benchmarks/deepspeed/faults.py --work /tmp/ds_faults --out benchmarks/deepspeed/faults.json

What tests/test_fsdp_faults.py checks under FSDP2, on real ``accelerate launch`` processes
(accelerate_configs/cpu_deepspeed.yaml, ``--zero_stage N`` on the launch line, 2 CPU processes over gloo) and
real signals, for each stage N. Every launch is the train job of the FSDP2 fault tests (``jh.fsdp_job_argv``:
tiny preset, K=3, 8 optimizer steps, 200 blocks of 64 tokens, a checkpoint every 2 steps, a loss logged every
step) except ``--accumulation_policy no_sync``, the one policy a DeepSpeed run accepts (the stage decides what
a window reduces). Per stage, one launch at a time (2 processes each):

- ``reference``: uninterrupted;
- ``killed``: rank 1 gets SIGKILL as soon as a complete checkpoint exists; the launch must end non-zero, and
  torchrun's report name rank 1 and SIGKILL. Then ``resumed``: the same flags with
  ``--resume_from_checkpoint latest`` in the same folder;
- ``restarted``: the same kill under ``accelerate launch --max_restarts 1``: torchrun restarts both workers,
  which resume from ``latest`` without a flag;
- ``crashed``: every process exits (code 3) while saving ``step_4``, after its files are written and before
  the marker and the rename (the test hook ``accum_kit.core.checkpoint.CRASH_HOOK``): ``latest`` must stay
  on ``step_2``.

``resumed`` and ``restarted`` are compared with ``reference``: ``train_summary.json``'s ``train_loss`` and
``eval_loss_after``, and every tensor of the saved ``model.safetensors``, bit for bit.

Written to ``--out``: per stage the exit codes, the rank and signal torchrun's report names, the checkpoint
the kill followed and the one resumed from, whether each run equals the reference (with the largest parameter
difference of any that does not), where ``latest`` pointed after the crash and what the unfinished folder
holds; a ``table`` row per stage and fault, ``ok`` true or false. Exit code 0 when every row is ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import job_helpers as jh  # noqa: E402
from fault_launches import compare as _compare, kill_rank1_after_a_checkpoint, root_cause  # noqa: E402
from accum_kit.core.checkpoint import CRASH_HOOK, complete_checkpoints, latest_checkpoint  # noqa: E402
from accum_kit.outputs import atomic_write_json, library_versions  # noqa: E402

CONFIG = REPO / "accelerate_configs" / "cpu_deepspeed.yaml"
EVERY = 2  # --checkpointing_steps, as in tests/test_fsdp_faults.py
CRASH_AT = "step_4"
STAGES = (1, 2, 3)
POLICY = "no_sync"  # the FSDP2 job's no_sync_no_reshard is refused under DeepSpeed (docs/deepspeed.md)


def job_argv(corpus: Path, out: Path, resume: bool = False) -> list[str]:
    """The FSDP2 fault tests' train job with DeepSpeed's policy (``-m accum_kit train ...``)."""
    argv = jh.fsdp_job_argv(corpus, out, "--checkpointing_steps", EVERY, "--logging_steps", 1,
                            *(["--resume_from_checkpoint", "latest"] if resume else []))
    i = argv.index("--accumulation_policy")
    argv[i + 1] = POLICY
    return argv


def launch(work: Path, stage: int, name: str, corpus: Path, env: dict, *launcher_flags, folder: str | None = None,
           resume: bool = False, **extra_env):
    """Start one 2-process launch of the job under ZeRO-``stage``; output in ``work/zero<stage>/<folder or name>``."""
    root = work / f"zero{stage}"
    argv = job_argv(corpus, root / (folder or name), resume)
    cmd = jh.accelerate_launch_cmd("--zero_stage", stage, *launcher_flags, *argv, config=CONFIG)
    return jh.start([str(c) for c in cmd], {**env, **extra_env}, root / "logs", name)


def error_lines(stderr: str) -> list[str]:
    return re.findall(r"^error: .*$", stderr, re.M)


def compare(out: Path, reference: Path) -> dict:
    return _compare(out, reference, jh.FSDP_JOB_STEPS)


def finished(started, timeout: float) -> tuple:
    """Wait for a launch; (jh.Finished, its exit code, seconds, error lines and traceback count)."""
    res = jh.finish(started, timeout)
    return res, {"returncode": res.returncode, "seconds": round(res.seconds, 1), "errors": error_lines(res.stderr),
                 "tracebacks": res.stderr.count("Traceback (most recent call last)"),
                 "failure_report": root_cause(res.stderr) if res.returncode else None,
                 "terminate_called": res.stderr.count("terminate called")}  # a C++ abort (std::terminate)


def engine_of(out: Path, name: str) -> str | None:
    path = out / name / "loop_state.json"
    return json.loads(path.read_text()).get("engine") if path.exists() else None


def run_stage(work: Path, stage: int, corpus: Path, env: dict, timeout: float) -> dict:
    root = work / f"zero{stage}"
    t0 = time.monotonic()
    ref_res, reference = finished(launch(work, stage, "reference", corpus, env), timeout)
    ref_out = root / "reference"
    reference["zero_stage"] = json.loads((ref_out / "train_summary.json").read_text())["deepspeed"]["zero_stage"] \
        if ref_res.returncode == 0 else None
    print(f"ZeRO-{stage} reference: rc {ref_res.returncode}, {ref_res.seconds:.0f} s", flush=True)
    if ref_res.returncode != 0:
        return {"reference": reference, "reference_stderr_tail": ref_res.stderr[-3000:]}

    # (a) killed, then resumed by flag
    started = launch(work, stage, "killed", corpus, env)
    fact = kill_rank1_after_a_checkpoint(started, root / "killed", timeout)
    res, killed = finished(started, timeout)
    if "signalled_at" in fact:
        fact["ended_after_kill_s"] = round(time.monotonic() - fact.pop("signalled_at"), 1)
    killed.update(fact, root_cause=root_cause(res.stderr),
                  latest_then=getattr(latest_checkpoint(root / "killed"), "name", None),
                  summary_then=(root / "killed" / "train_summary.json").exists())
    killed["engine_of_latest"] = engine_of(root / "killed", killed["latest_then"]) if killed["latest_then"] else None
    res, resumed = finished(launch(work, stage, "resumed", corpus, env, folder="killed", resume=True), timeout)
    resumed["against_reference"] = compare(root / "killed", ref_out)
    print(f"ZeRO-{stage} killed: {killed}\n  resumed: {resumed}", flush=True)

    # (b) the same kill under --max_restarts 1
    started = launch(work, stage, "restarted", corpus, env, "--max_restarts", "1")
    fact = kill_rank1_after_a_checkpoint(started, root / "restarted", timeout)
    fact.pop("signalled_at", None)
    res, restarted = finished(started, timeout)
    resuming = re.search(r"elastic restart (\d+): resuming from (\S+)", res.stderr)
    saw = "pid" in fact and f"local_rank: 1 (pid: {fact['pid']})" in res.stderr
    restarted.update(fact, torchrun_saw_the_kill=saw,
                     resumed_line=resuming.group(0) if resuming else None,
                     against_reference=compare(root / "restarted", ref_out))
    print(f"ZeRO-{stage} restarted: {restarted}", flush=True)

    # (c) every process exits while saving step_4
    res, crashed = finished(launch(work, stage, "crashed", corpus, env, **{CRASH_HOOK: CRASH_AT}), timeout)
    out = root / "crashed"
    latest = latest_checkpoint(out)
    partial = out / f".{CRASH_AT}.incomplete"
    crashed.update(exitcode_3=bool(re.search(r"exitcode\s*:\s*3\b", res.stderr)),
                   complete=[p.name for p in complete_checkpoints(out)],
                   latest_after=latest.name if latest else None,
                   listing=sorted(p.name for p in out.iterdir()) if out.is_dir() else [],
                   incomplete_files=sorted(str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file())
                   if partial.is_dir() else None,
                   marker_in_incomplete=(partial / "checkpoint_complete").exists())
    if latest is not None:
        from accum_kit.core.checkpoint_files import check_checkpoint_files
        from accum_kit.errors import UsageError

        try:
            check_checkpoint_files(latest)
            crashed["latest_files_pass_the_resume_check"] = True
        except UsageError as e:
            crashed["latest_files_pass_the_resume_check"] = str(e)
    print(f"ZeRO-{stage} crashed: {crashed}", flush=True)
    return {"reference": reference, "killed": killed, "resumed": resumed, "restarted": restarted, "crashed": crashed,
            "seconds": round(time.monotonic() - t0, 1)}


def verdicts(stage: int, r: dict) -> list[dict]:
    """One row per fault: ok, and a one-line result."""
    if "killed" not in r:
        return [{"stage": stage, "fault": f, "ok": False, "result": "the reference failed"} for f in "abc"]
    k, res, rs, c = r["killed"], r["resumed"], r["restarted"], r["crashed"]
    ra, rb = res["against_reference"], rs["against_reference"]
    a_ok = ("pid" in k and k["returncode"] not in (0, -9) and k["root_cause"]["rank"] == 1
            and k["root_cause"]["signal"] == "SIGKILL" and not k["summary_then"] and res["returncode"] == 0
            and ra.get("bitwise_equal") is True and ra.get("resumed_from_step") == int(k["latest_then"].split("_")[1]))
    b_ok = ("pid" in rs and rs["returncode"] == 0 and rs["torchrun_saw_the_kill"] and rs["resumed_line"] is not None
            and rb.get("bitwise_equal") is True)
    n = int(CRASH_AT.split("_")[1])
    c_ok = (c["returncode"] not in (0, -9) and c["exitcode_3"] and c["latest_after"] == f"step_{n - EVERY}"
            and c["complete"] == [f"step_{s}" for s in range(EVERY, n, EVERY)]
            and f".{CRASH_AT}.incomplete" in c["listing"] and CRASH_AT not in c["listing"]
            and "train_summary.json" not in c["listing"] and not c["marker_in_incomplete"]
            and c.get("latest_files_pass_the_resume_check") is True)

    def eq(cmp):
        if not cmp.get("finished"):
            return "did not finish"
        return "bitwise equal" if cmp["bitwise_equal"] else (
            f"differs (losses equal {cmp['train_loss_equal']}, {cmp['tensors_differing']} tensors, "
            f"max {cmp['max_abs_difference']:.2e})")

    return [
        {"stage": stage, "fault": "a", "ok": a_ok,
         "result": f"kill after {k.get('checkpoint_then')}: launch rc {k['returncode']}, report names rank "
                   f"{k['root_cause']['rank']} {k['root_cause']['signal']}; resume rc {res['returncode']} from "
                   f"step {ra.get('resumed_from_step')}: {eq(ra)}"},
        {"stage": stage, "fault": "b", "ok": b_ok,
         "result": f"kill after {rs.get('checkpoint_then')}: rc {rs['returncode']}"
                   f"{f' (failure report: {fr})' if (fr := rs.get('failure_report')) else ''}, "
                   f"{rs['resumed_line'] or 'no resume line'}: {eq(rb)}"},
        {"stage": stage, "fault": "c", "ok": c_ok,
         "result": f"rc {c['returncode']} (hook exit 3: {c['exitcode_3']}); latest {c['latest_after']}, "
                   f"{CRASH_AT} left as .{CRASH_AT}.incomplete: {f'.{CRASH_AT}.incomplete' in c['listing']}"},
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="scratch folder (created; the runs' outputs and logs)")
    p.add_argument("--out", type=Path, required=True, help="the results JSON")
    p.add_argument("--stages", type=int, nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch before it is stopped")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = jh.write_corpus(args.work / "corpus.txt")
    env = jh.clean_env(HF_DATASETS_CACHE=str(args.work / "hf_datasets_cache"))  # tokenised once, shared
    t0 = time.time()
    stages = {}
    for stage in args.stages:
        stages[str(stage)] = run_stage(args.work, stage, corpus, env, args.timeout)
    table = [row for stage in args.stages for row in verdicts(stage, stages[str(stage)])]
    import deepspeed

    result = {"command": "python benchmarks/deepspeed/faults.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "config": str(CONFIG.relative_to(REPO)), "processes": 2, "job": job_argv(Path("CORPUS"), Path("OUT"))[3:],
              "checkpointing_steps": EVERY, "crash_at": CRASH_AT,
              "versions": {**library_versions(), "deepspeed": deepspeed.__version__},
              "cpus": os.cpu_count(), "load_average_end": os.getloadavg(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "seconds": round(time.time() - t0, 1),
              "table": table, "stages": stages}
    atomic_write_json(args.out, result)
    for row in table:
        print(f"ZeRO-{row['stage']} ({row['fault']}) {'ok  ' if row['ok'] else 'FAIL'} {row['result']}")
    return 0 if all(row["ok"] for row in table) else 1


if __name__ == "__main__":
    sys.exit(main())
