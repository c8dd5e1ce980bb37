#!/usr/bin/env bash
# The GPU checks in one command, on a machine with one CUDA GPU, from the repository's root:
#
#     OUT=/some/folder bash tests/gpu/run_checks.sh
#
# Ends within GPU_CHECKS_LIMIT_S (480 s): each check has its own time limit and runs only while enough of the
# budget is left; a failing check is recorded and the next one runs. In order of importance:
#   pytest_gpu           python3 -m pytest tests/gpu (its launches end 140 s after they start; figures in
#                        $OUT/gpu_tests.json)
#   main_job             the train job on CUDA as the README runs it (gpu_ddp.yaml, one process, bf16, `small`)
#   bench_one_process    `accum-kit bench` on one process: runs when the bench has its one-process part
#                        (accum_kit.bench.parts.PARTS["one_process"]), else recorded as skipped
#   zero2_job            the train job under DeepSpeed ZeRO-2 (gpu_deepspeed.yaml): held gradient bytes vs predicted
#   fp32_job, fp32_checkpointing_job   the train job in fp32 at 16 x 1024 tokens per micro-batch, without and with
#                        --gradient_checkpointing: measured peak vs the activation memory model's prediction
#   compile_job          the train job with --torch_compile (inductor): compile seconds, recompiles after warm-up
#   fsdp2_job            the train job under FSDP2 (gpu_fsdp.yaml) with --profile_comm
#   verify_fp16          accum-kit verify --mixed_precision fp16 (Accelerate's GradScaler exists only on CUDA)
# Results in $OUT (default /tmp/gpu_checks): gpu_checks.md (the table: check, result, figures; also printed),
# gpu_checks.tsv (check, exit status or "skipped", seconds), logs/<check>.log, summary_<check>.json.
#
# Packages the GPU machine lacks (datasets, deepspeed, ...) are installed from wheels in .gpu/whl when that
# folder exists (docs/gpu_tests.md says how to fill it); nothing is fetched from the network.
# GPU_CHECKS_DRY_RUN=1: the same steps on a CPU with small settings and the CPU configs (tests/gpu in its dry
# run), to try the script itself; its figures say nothing about a GPU.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT/logs"
R=$(mktemp -d "${TMPDIR:-/tmp}/gpu_runs.XXXXXX")
tsv=$OUT/gpu_checks.tsv
printf 'check\tstatus\tseconds\n' >"$tsv"
HARD=${GPU_CHECKS_LIMIT_S:-480}
BUDGET=$((HARD - 30))  # no check may run past this: a killed check's grace period and the table come after
DRY=${GPU_CHECKS_DRY_RUN:-0}

site=""
if compgen -G ".gpu/whl/*.whl" >/dev/null; then
  site=${TMPDIR:-/tmp}/gpu_site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    .gpu/whl/*.whl >"$OUT/logs/install.log" 2>&1 || echo "wheel install failed: see logs/install.log"
fi
export PYTHONPATH=$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OUT

versions="import torch, accelerate, transformers as t; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.is_available(), 'accelerate', accelerate.__version__, 'transformers', t.__version__)"
{ nvidia-smi -L; python3 -c "$versions"; git log -1 --format='commit %h %s'; } >"$OUT/logs/environment.log" 2>&1

check() {  # check NAME LIMIT_S COMMAND...: runs within what is left of BUDGET, else records "skipped"
  local name=$1 lim=$2; shift 2
  local t0=$SECONDS left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then printf '%s\tskipped\t0\n' "$name" >>"$tsv"; return; fi
  [ "$lim" -gt "$left" ] && lim=$left
  echo "\$ $*" >"$OUT/logs/$name.log"
  timeout -k 15 "$lim" "$@" >>"$OUT/logs/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$tsv"
  echo "$name: exit $rc after $((SECONDS - t0)) s"
  [ -f "$R/$name/train_summary.json" ] && cp "$R/$name/train_summary.json" "$OUT/summary_$name.json"
  return 0
}

AL="python3 -m accelerate.commands.launch --num_processes 1 --num_machines 1"
ALS=$AL  # FSDP2 and ZeRO: one process on the one GPU (the dry run: 2, accum-kit refuses them on one CPU process)
if [ "$DRY" = 1 ]; then
  export GPU_TESTS_DRY_RUN=1
  ALS="python3 -m accelerate.commands.launch --num_processes 2 --num_machines 1"
  DDP=accelerate_configs/cpu_single.yaml; FSDP=accelerate_configs/cpu_fsdp.yaml; ZERO=accelerate_configs/cpu_deepspeed.yaml
  stdlib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
  cat "$stdlib/textwrap.py" "$stdlib/shlex.py" >"$R/corpus.txt"  # not the whole standard library: seconds, not minutes
  data=(--train_file "$R/corpus.txt" --block_size 64 --max_train_samples 64 --max_eval_samples 8)
  small=(--model_preset tiny "${data[@]}" --max_train_steps 4 --gradient_accumulation_steps 2 --per_device_train_batch_size 2)
  fp32=(--model_preset tiny "${data[@]}" --max_train_steps 2 --gradient_accumulation_steps 2 --per_device_train_batch_size 4)
  bench_args=(--quick --model_presets tiny)
  verify_precision=bf16  # fp16 autocast and its GradScaler are CUDA's
else
  DDP=accelerate_configs/gpu_ddp.yaml; FSDP=accelerate_configs/gpu_fsdp.yaml; ZERO=accelerate_configs/gpu_deepspeed.yaml
  small=(--model_preset small --max_train_steps 30 --gradient_accumulation_steps 4 --per_device_train_batch_size 8)
  fp32=(--model_preset small --block_size 1024 --max_train_steps 6 --gradient_accumulation_steps 4
        --per_device_train_batch_size 16)
  # the shape of the measured GPU table: GPT-2 124M, 8 x 1024 tokens, K 8, bf16, fused AdamW, clipping 1.0
  bench_args=(--model_presets gpt2 --vocab_size 50257 --block_size 1024 --per_device_train_batch_size 8
              --accumulation_steps 8 --mixed_precision bf16 --optim adamw_torch_fused --max_grad_norm 1.0
              --repeats 3 --warmup_steps 1 --steps 2)
  verify_precision=fp16
fi
bench_args=("${bench_args[@]}" ${GPU_CHECKS_BENCH_ARGS:-})

# 1. the project's CUDA tests
check pytest_gpu 180 python3 -m pytest -q -p no:cacheprovider tests/gpu
# 2. the main job, as the README runs it on a GPU
check main_job 150 $AL --config_file $DDP -m accum_kit train "${small[@]}" --output_dir "$R/main_job"
# 3. THE ONE-PROCESS BENCH (slot): runs once `accum-kit bench` has a one-process part; until then "skipped"
if python3 -c "from accum_kit.bench.parts import PARTS; raise SystemExit(0 if 'one_process' in PARTS else 1)" 2>/dev/null
then
  check bench_one_process 120 python3 -m accum_kit bench "${bench_args[@]}" --output_dir "$R/bench_one_process"
  for f in bench.json bench.csv; do [ -f "$R/bench_one_process/$f" ] && cp "$R/bench_one_process/$f" "$OUT/bench_one_process_$f"; done
else
  printf 'bench_one_process\tskipped: no one-process part in accum_kit.bench.parts.PARTS\t0\n' >>"$tsv"
fi
# 4. DeepSpeed ZeRO-2: the held gradient bytes against the prediction
if python3 -c "import deepspeed" >/dev/null 2>&1; then
  check zero2_job 120 $ALS --config_file $ZERO -m accum_kit train "${small[@]}" --output_dir "$R/zero2_job"
else
  printf 'zero2_job\tskipped: deepspeed is not installed\t0\n' >>"$tsv"
fi
# 5. the activation memory model in fp32, without and with gradient checkpointing
check fp32_job 90 $AL --config_file $DDP --mixed_precision no -m accum_kit train "${fp32[@]}" --output_dir "$R/fp32_job"
check fp32_checkpointing_job 90 $AL --config_file $DDP --mixed_precision no -m accum_kit train "${fp32[@]}" \
  --gradient_checkpointing --output_dir "$R/fp32_checkpointing_job"
# 6. inductor, FSDP2 with the profiler, fp16 with Accelerate's GradScaler
check compile_job 150 $AL --config_file $DDP -m accum_kit train "${small[@]}" --torch_compile --output_dir "$R/compile_job"
check fsdp2_job 120 $ALS --config_file $FSDP -m accum_kit train "${small[@]}" --profile_comm --output_dir "$R/fsdp2_job"
check verify_$verify_precision 90 $AL --config_file $DDP -m accum_kit verify --mixed_precision $verify_precision

python3 tests/gpu/check_table.py "$OUT" | tee "$OUT/gpu_checks.md"
echo "done in ${SECONDS} s (limit ${HARD} s); results in $OUT"
rm -rf "$R"
