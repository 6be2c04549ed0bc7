#!/usr/bin/env bash
# Usage: bash examples/quickstart_cpu.sh
# The CPU main job, end to end with the bundled offline defaults, through Megatron-LM's own
# trainer (pretrain_gpt.py -> megatron.training.pretrain with our providers):
#   1. set up .venv (scripts/setup_cpu_env.sh: Python 3.12, megatron-core 0.19.2)
#   2. write the sample corpus (Python stdlib text, no download; each function, method and
#      class body a document: ~480 bytes on average, heavy-tailed)
#   3. preprocess it into a Megatron indexed dataset (byte-level tokenizer, EoD appended) and
#      show a micro-batch's documents (tools/show_layout.py)
#   4. train a tiny GPT with EoD reset on 4 CPU ranks (gloo, torchrun): CP=1 (4-way data
#      parallel), then CP=4 with each of ring, ulysses and hybrid (2 Ulysses x 2 Ring), and
#      CP=4 ring saved halfway (torch_dist) and resumed at CP=2 x 2-way data parallel
#   5. print the per-iteration lm losses side by side (tools/loss_table.py, from
#      --metrics-file); the script fails if a run differs from CP=1 by more than 1e-5
#      relative (float32).
# Environment (all optional):
#   WORK_DIR      where data, checkpoints, metrics and logs go   (default: <repo>/runs/quickstart)
#   CORPUS_BYTES  sample corpus size                (default: 4000000)
#   SEQ_LENGTH    tokens per row                    (default: 256)
#   TRAIN_ITERS   iterations per run, even          (default: 20)
#   NPROC         CPU ranks per run                 (default: 4)
# Extra arguments go to every pretrain_gpt.py run, e.g. `--num-layers 4`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_EOD_VENV:-$ROOT/.venv}"
WORK_DIR="${WORK_DIR:-$ROOT/runs/quickstart}"
CORPUS_BYTES="${CORPUS_BYTES:-4000000}"
SEQ_LENGTH="${SEQ_LENGTH:-256}"
TRAIN_ITERS="${TRAIN_ITERS:-20}"
NPROC="${NPROC:-4}"
[ $((TRAIN_ITERS % 2)) -eq 0 ] || { echo "TRAIN_ITERS must be even (saved halfway)" >&2; exit 2; }

bash "$ROOT/scripts/setup_cpu_env.sh"
PY="$VENV/bin/python"
mkdir -p "$WORK_DIR"

echo "== 1. sample corpus"
"$PY" "$ROOT/tools/make_sample_corpus.py" --output "$WORK_DIR/stdlib.jsonl" \
  --max-bytes "$CORPUS_BYTES" --methods-apart
echo "== 2. preprocess (byte-level tokenizer, EoD appended)"
"$PY" "$ROOT/tools/preprocess_data.py" --input "$WORK_DIR/stdlib.jsonl" \
  --output-prefix "$WORK_DIR/stdlib" --append-eod --workers 2 --log-interval 2000
rm -rf "$WORK_DIR/cache" "$WORK_DIR/ckpt"  # what the previous job left of this data
echo "== 3. a micro-batch of $SEQ_LENGTH-token rows and its documents"
"$PY" "$ROOT/tools/show_layout.py" --data-path "$WORK_DIR/stdlib_text_document" \
  --seq-length "$SEQ_LENGTH" --micro-batch-size 8 --eod-mask-loss \
  --data-cache-path "$WORK_DIR/cache"

# A Megatron-LM GPT launch script's flags (no tokenizer flags: the data's metadata says it is
# byte-level) ...
MODEL=(--num-layers 2 --hidden-size 64 --num-attention-heads 4
       --group-query-attention --num-query-groups 2 --position-embedding-type rope
       --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
       --hidden-dropout 0 --attention-dropout 0)
TRAIN=(--micro-batch-size 2 --global-batch-size 8 --train-iters "$TRAIN_ITERS"
       --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 2 --lr-decay-style cosine
       --weight-decay 0.01 --clip-grad 1.0 --seed 1234 --use-distributed-optimizer)
DATA=(--data-path "$WORK_DIR/stdlib_text_document" --split 98,2,0
      --data-cache-path "$WORK_DIR/cache" --eval-interval "$TRAIN_ITERS" --eval-iters 2
      --log-interval 5)
# ... on CPUs: gloo, Megatron-LM's local layers, no Apex fusion, the data read in each rank
# (loader worker processes only slow a 2-core machine down) ...
CPU=(--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion
     --num-workers 0)
# ... and the lines that make it EoD reset (ours: --metrics-file and the CP algorithm).
EOD=(--reset-attention-mask --reset-position-ids --eod-mask-loss)

run() {  # run NAME FLAGS...: one training job on $NPROC CPU ranks, its metrics appended
  local name="$1"; shift
  echo "== 4. train: $name ($NPROC CPU ranks)"
  local log="$WORK_DIR/log_$name.txt" rc=0
  : > "$log"  # empty before tail follows it (else it shows the previous run's lines first)
  OMP_NUM_THREADS=1 "$VENV/bin/torchrun" --standalone --nproc-per-node "$NPROC" \
    "$ROOT/pretrain_gpt.py" "${MODEL[@]}" "${TRAIN[@]}" "${DATA[@]}" "${CPU[@]}" "${EOD[@]}" \
    --metrics-file "$WORK_DIR/metrics_$name.jsonl" "$@" > "$log" 2>&1 &
  local pid=$!
  # Show the iteration lines as they come; the full log stays in $log.
  tail -n +1 -f --pid="$pid" "$log" | grep --line-buffered -E \
    " iteration +[0-9]+/|validation loss|error:|megatron-eod:" || true
  wait "$pid" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "run $name failed (exit $rc); the last lines of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
}

CP_EXTRA=("$@")
rm -f "$WORK_DIR"/metrics_*.jsonl
run cp1     --context-parallel-size 1 "${CP_EXTRA[@]}"
run ring    --context-parallel-size "$NPROC" --cp-comm-type p2p "${CP_EXTRA[@]}"
run ulysses --context-parallel-size "$NPROC" --cp-comm-type a2a "${CP_EXTRA[@]}"
run hybrid  --context-parallel-size "$NPROC" --cp-comm-type a2a+p2p \
            --hierarchical-context-parallel-sizes 2 $((NPROC / 2)) "${CP_EXTRA[@]}"
run resumed --context-parallel-size "$NPROC" --cp-comm-type p2p --save "$WORK_DIR/ckpt" \
            --exit-interval $((TRAIN_ITERS / 2)) "${CP_EXTRA[@]}"
run resumed --context-parallel-size $((NPROC / 2)) --cp-comm-type p2p --load "$WORK_DIR/ckpt" \
            "${CP_EXTRA[@]}"

echo "== 5. per-iteration lm loss (CP=1 is the reference; 'resumed' was saved at CP=$NPROC" \
     "after iteration $((TRAIN_ITERS / 2)) and resumed at CP=$((NPROC / 2)))"
"$PY" "$ROOT/tools/loss_table.py" cp1="$WORK_DIR/metrics_cp1.jsonl" \
  ring="$WORK_DIR/metrics_ring.jsonl" ulysses="$WORK_DIR/metrics_ulysses.jsonl" \
  hybrid="$WORK_DIR/metrics_hybrid.jsonl" resumed="$WORK_DIR/metrics_resumed.jsonl" \
  --tolerance 1e-5
