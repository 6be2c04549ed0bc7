#!/usr/bin/env bash
# Usage: bash scripts/gpu_checks.sh [--list] [STAGE ...]
# The GPU checks and benchmarks, stage by stage, each under a time limit with its own log, and
# a summary of the figures docs/BENCHMARKS.md records. Made for a GPU machine that may have no
# package index and limited time (the GPU machine lent to our sessions: 10 minutes a command):
# it uses the Python it finds (which must have CUDA torch) and, when the wheels of
# scripts/fetch_offline_wheels.sh are beside the repository (.device/), installs them first with
# pip --no-index. Stages (no STAGE: all, in this order, until the budget runs out):
#   env           versions, the GPU, the attention backend, the imports the others need
#   kernels       every `gpu`-marked test except the two below: kernels vs float64, simulated
#                 CP in bf16, no host syncs in ring/hybrid steps, CUDA layouts
#   multiprocess  2-4 processes sharing the GPU run the real context_parallel_attention
#                 (bf16 vs float64 and vs CP=1: sets BF16_TOL)
#   training      pretrain_gpt.py (Megatron-LM's trainer) in bf16: CP=1 vs the CPU golden
#                 losses, CP=N on N GPUs, CP=2/4 processes sharing one GPU vs CP=1 (sets
#                 CP_TOL and GOLDEN_TOL)
#   bench-cp      tools/bench_cp_gpu.py: busiest CP rank vs ideal, ring and hybrid
#   profile       tools/profile_cp_step.py: that rank's time, forward alone and forward+backward,
#                 split into attention kernels, glue kernels and idle device, and its
#                 costliest glue kernels
#   e2e           tools/bench_e2e.py --preset 1b: EoD reset vs causal tokens/s and TFLOP/s,
#                 ~1.2B GPT, 32k tokens, through Megatron-LM's trainer
# and, run only when named, the open rows of issue 11 with their baselines, for a short lease:
#   bench-open    bench-cp's rows of ours and the ideal only (no reference layouts, no forced
#                 split, no "(one call)" rows: their figures of 2026-11-28 stand): batched,
#                 concurrent, the fused kernels' rows and their whole-row calls, 2 rows per
#                 mix; a row that fails is NaN, its traceback in the log
#   profile-open  profile's batched rows, with and without --cp-concurrent-calls, and fused
#   training-open training's runs of CP=2 ring and CP=4 hybrid as processes sharing the GPU,
#                 with the defaults (fused forward, concurrent calls) and without, against
#                 the CP=1 run (itself with the defaults); the MoE, MTP and MLA GPTs and
#                 pretrain_hybrid.py's '*-*-' at CP=2
#                 against their CP=1 runs
#   bench-default the issue-52 table: the busiest rank over the ideal with the defaults on GPUs
#                 (fused forward + concurrent calls, training/gpu_defaults.py) beside the
#                 batched rows without them, 2 rows per mix
#   magi          the same rows at MagiAttention's published setting: GQA 64:8, head dim 128,
#                 8k tokens per GPU at CP 8 (64k), documents at most a quarter of the row
#                 (`--mixes capped`), with useful TFLOP/s per GPU of the busiest rank
#   backward-sweep tools/sweep_fused_backward.py: the fused backward's time over PyTorch's at
#                 the launch shapes that spill no register on sm_90 at head dim 128 under
#                 Triton 3.6.0 (ptxas, 2026-11-28), the default first, then dq by atomic
#                 adds, in one process
# A lease of 15 device minutes (the machine's start included; 10 minutes a command) fits two
# calls, the second at once while the machine is warm (~30 s):
#   1. bash scripts/gpu_checks.sh env kernels bench-open profile-open multiprocess
#   2. GPU_CHECKS_BUDGET=<seconds left - 60> bash scripts/gpu_checks.sh env training
# The next lease (docs/BENCHMARKS.md "Still to run"), issue 52's deciding figures first: the
# defaults' table and MagiAttention's setting, then training parity with the defaults:
#   1. GPU_CHECKS_BUDGET=540 bash scripts/gpu_checks.sh env bench-default magi training-open
#   2. GPU_CHECKS_BUDGET=<seconds left - 60> bash scripts/gpu_checks.sh env backward-sweep \
#      profile-open
# --list prints each stage and its command, runs nothing.
#   GPU_CHECKS_OUT     logs and summary.md (default: $OUT when set, else <repo>/runs/gpu_checks)
#   GPU_CHECKS_BUDGET  seconds for all stages together (default: 560); a stage runs under what
#                      is left (or its own limit, if smaller) and is not started with < 30 s
#   OFFLINE_DIR        wheels/ to use (default: <repo>/.device)
#   PYTHON             the interpreter (default: python3)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OFFLINE_DIR="${OFFLINE_DIR:-$ROOT/.device}"
WORK="${TMPDIR:-/tmp}/megatron-eod-gpu-checks"
PYTEST="$PYTHON -m pytest -q -rs -s -m gpu"

ORDER=(env kernels multiprocess training bench-cp profile e2e)
NAMED_ONLY=(bench-open profile-open training-open bench-default magi backward-sweep)
declare -A COMMAND LIMIT
COMMAND[env]="$PYTHON tools/gpu_env_report.py"
COMMAND[kernels]="$PYTEST tests --ignore=tests/attention/test_multiprocess_gpu.py --ignore=tests/functional/test_gpu_training.py"
COMMAND[multiprocess]="$PYTEST tests/attention/test_multiprocess_gpu.py"
COMMAND[training]="$PYTEST tests/functional/test_gpu_training.py"
COMMAND[bench-cp]="$PYTHON tools/bench_cp_gpu.py"
COMMAND[profile]="$PYTHON tools/profile_cp_step.py"
COMMAND[e2e]="$PYTHON tools/bench_e2e.py --preset 1b --work-dir $WORK/bench_e2e"
COMMAND[bench-open]="${COMMAND[bench-cp]} --samples 2 --only '^ours (ring|hybrid u=2)( \\((concurrent|fused.*)\\))?\$|fused kernel'"
COMMAND[training-open]="${COMMAND[training]} -k 'sharing_one_gpu and (ring2 or hybrid4 or moe or mtp or mla or hybrid_model)'"
DEFAULT_ROWS="--only '^ours (ring|hybrid u=2)( \\(fused, concurrent\\))?\$'"
COMMAND[bench-default]="${COMMAND[bench-cp]} --samples 2 $DEFAULT_ROWS"
COMMAND[magi]="${COMMAND[bench-cp]} --samples 2 --mixes capped --configs 65536:8 --heads 64 --kv-heads 8 --head-dim 128 $DEFAULT_ROWS"
COMMAND[profile-open]="${COMMAND[profile]} --only '^ours (ring|hybrid u=2)( \((concurrent|fused).*\))?\$'"
# DQ_BLOCK_N:DKDV_BLOCK_M:WARPS:STAGES[:DKDV_WARPS][@KEYS per dk/dv tile], default first
# (its dk/dv spills 88 bytes under the machine's Triton 3.6.0, none under 3.7.1), then the
# shapes whose kernels spill nothing on sm_90 under Triton 3.6.0 (ptxas, 2026-11-28); `atomic:`
# shapes: dq by the dk/dv kernel's atomic adds (no dq kernel).
BACKWARD_SHAPES="32:32:8:2,32:16:8:2,64:16:8:2,32:16:8:2@128,32:32:8:2@32,32:16:8:2:4@32,atomic:16:8:2,atomic:32:8:2@32,atomic:16:4:2@32"
COMMAND[backward-sweep]="$PYTHON tools/sweep_fused_backward.py --shapes $BACKWARD_SHAPES"
LIMIT=([env]=120 [kernels]=300 [multiprocess]=420 [training]=540 [bench-cp]=480
       [profile]=240 [e2e]=540 [bench-open]=360 [profile-open]=180 [training-open]=540
       [backward-sweep]=300 [bench-default]=300 [magi]=180)

if [ "${1:-}" = "--list" ]; then
  for stage in "${ORDER[@]}" "${NAMED_ONLY[@]}"; do
    printf '%s\t%s\n' "$stage" "${COMMAND[$stage]}"
  done
  exit 0
fi
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=("${ORDER[@]}")
for stage in "${STAGES[@]}"; do
  [ -n "${COMMAND[$stage]:-}" ] || {
    echo "[gpu-checks] unknown stage '$stage'; stages: ${ORDER[*]} ${NAMED_ONLY[*]}" >&2
    exit 2
  }
done

OUT_DIR="${GPU_CHECKS_OUT:-${OUT:-$ROOT/runs/gpu_checks}}"
mkdir -p "$OUT_DIR" "$WORK"
SUMMARY="$OUT_DIR/summary.md"
START=$SECONDS
BUDGET="${GPU_CHECKS_BUDGET:-560}"

# Offline wheels: into a private target folder put first on PYTHONPATH (the machine's own
# torch stays); megatron-core's wheel carries Megatron-LM's trainer.
if compgen -G "$OFFLINE_DIR/wheels/*.whl" >/dev/null; then
  SITE="$WORK/site"
  echo "[gpu-checks] installing $(ls "$OFFLINE_DIR"/wheels/*.whl | wc -l) wheels from $OFFLINE_DIR/wheels"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target "$SITE" "$OFFLINE_DIR"/wheels/*.whl || {
    echo "[gpu-checks] offline install failed (wheels for another Python? re-run" \
         "scripts/fetch_offline_wheels.sh with OFFLINE_PYTHON_VERSION)" >&2
    exit 1
  }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$ROOT"

# summary.md = the table of stages, then each stage's figures; rewritten after every stage so
# that a run cut off from outside still leaves the finished stages' figures.
TABLE="$WORK/table.md"
FIGURES="$WORK/figures.md"
{
  echo "# GPU checks, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "| stage | result | seconds |"
  echo "|---|---|---|"
} > "$TABLE"
: > "$FIGURES"
write_summary() { cat "$TABLE" "$FIGURES" > "$SUMMARY"; }
status=0
env_failed=0
for stage in "${STAGES[@]}"; do
  left=$((BUDGET - (SECONDS - START)))
  limit=$(( left < LIMIT[$stage] ? left : LIMIT[$stage] ))
  if [ "$env_failed" = 1 ] || [ "$limit" -lt 30 ]; then
    why="${left}s of the budget left"
    [ "$env_failed" = 1 ] && why="the env stage failed"
    echo "| $stage | not started: $why | 0 |" >> "$TABLE"
    write_summary
    status=1
    continue
  fi
  log="$OUT_DIR/$stage.log"
  echo "[gpu-checks] $stage (limit ${limit}s): ${COMMAND[$stage]}"
  began=$SECONDS
  # timeout signals the stage's whole process group (torchrun's workers too).
  timeout --kill-after=10 "$limit" bash -c "${COMMAND[$stage]}" > "$log" 2>&1
  rc=$?
  took=$((SECONDS - began))
  case $rc in
    0) result=passed ;;
    124|137) result="TIMED OUT after ${limit}s"; status=1 ;;
    *) result="FAILED (exit $rc)"; status=1 ;;
  esac
  [ "$stage" = env ] && [ "$rc" != 0 ] && env_failed=1
  echo "[gpu-checks] $stage: $result in ${took}s (log: $log)"
  echo "| $stage | $result | $took |" >> "$TABLE"
  {
    echo
    echo "## $stage"
    echo
    case $stage in
      env|bench-cp|profile|bench-open|profile-open|backward-sweep) grep -v '^USDT' "$log" ;;
      e2e) tail -n 5 "$log" ;;
      *) grep -o '\[figure\].*' "$log" | sed 's/^\[figure\] /- /'
         grep -E '^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 20 ;;
    esac
    # A stage can pass and still have run slower than it should: attention/lse.py's fused
    # merge falling back to eager (a compile failure, dynamo's recompile limit) says so once.
    grep -o -m 3 'fused log-sum-exp merge unavailable.*' "$log" | sed 's/^/- WARNING: /'
  } >> "$FIGURES"
  write_summary
done
write_summary
echo "[gpu-checks] summary: $SUMMARY ($((SECONDS - START))s)"
cat "$SUMMARY"
exit $status
