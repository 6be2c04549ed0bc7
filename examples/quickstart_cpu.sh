#!/usr/bin/env bash
# Usage: bash examples/quickstart_cpu.sh
# The CPU main job, end to end with the bundled offline defaults:
#   1. set up .venv (scripts/setup_cpu_env.sh)
#   2. write the sample corpus (Python stdlib text, no download; each function, method and
#      class body a document: ~480 bytes on average, heavy-tailed)
#   3. preprocess it into a Megatron indexed dataset (byte-level tokenizer, EoD appended) and
#      show a micro-batch's documents (tools/show_layout.py)
#   4. train a tiny GPT with EoD reset on 4 CPU ranks (gloo, torchrun): CP=1 (4-way data
#      parallel), then CP=4 with each of ring, ulysses and hybrid (2 Ulysses x 2 Ring)
#   5. print the per-iteration lm losses side by side (tools/loss_table.py); the script
#      fails if a CP run differs from CP=1 by more than 1e-5 relative (float32).
# Environment (all optional):
#   WORK_DIR      where data, metrics and logs go   (default: <repo>/runs/quickstart)
#   CORPUS_BYTES  sample corpus size                (default: 4000000)
#   SEQ_LENGTH    tokens per row                    (default: 256)
#   TRAIN_ITERS   iterations per run                (default: 20)
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

bash "$ROOT/scripts/setup_cpu_env.sh"
PY="$VENV/bin/python"
mkdir -p "$WORK_DIR"

echo "== 1. sample corpus"
"$PY" "$ROOT/tools/make_sample_corpus.py" --output "$WORK_DIR/stdlib.jsonl" \
  --max-bytes "$CORPUS_BYTES" --methods-apart
echo "== 2. preprocess (byte-level tokenizer, EoD appended)"
"$PY" "$ROOT/tools/preprocess_data.py" --input "$WORK_DIR/stdlib.jsonl" \
  --output-prefix "$WORK_DIR/stdlib" --append-eod --workers 2 --log-interval 2000
rm -rf "$WORK_DIR/cache"  # megatron-core's sample indices of the data this run replaced
echo "== 3. a micro-batch of $SEQ_LENGTH-token rows and its documents"
"$PY" "$ROOT/tools/show_layout.py" --data-path "$WORK_DIR/stdlib_text_document" \
  --seq-length "$SEQ_LENGTH" --micro-batch-size 8 --eod-mask-loss \
  --data-cache-path "$WORK_DIR/cache"

MODEL=(--num-layers 2 --hidden-size 64 --num-attention-heads 4
       --group-query-attention --num-query-groups 2 --position-embedding-type rope
       --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH")
TRAIN=(--micro-batch-size 2 --global-batch-size 8 --train-iters "$TRAIN_ITERS"
       --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 2 --lr-decay-style cosine
       --weight-decay 0.01 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0
       --seed 1234)
DATA=(--data-path "$WORK_DIR/stdlib_text_document" --split 98,2,0
      --data-cache-path "$WORK_DIR/cache" --eval-interval "$TRAIN_ITERS" --eval-iters 2
      --log-interval 5)
EOD=(--reset-attention-mask --reset-position-ids --eod-mask-loss)

run() {  # run NAME FLAGS...: one training job on $NPROC CPU ranks
  local name="$1"; shift
  echo "== 4. train: $name ($NPROC CPU ranks)"
  local log="$WORK_DIR/log_$name.txt" rc=0
  rm -f "$WORK_DIR/metrics_$name.jsonl"
  : > "$log"  # empty before tail follows it (else it shows the previous run's lines first)
  OMP_NUM_THREADS=1 "$VENV/bin/torchrun" --standalone --nproc-per-node "$NPROC" \
    "$ROOT/pretrain_gpt.py" --trainer lean "${MODEL[@]}" "${TRAIN[@]}" "${DATA[@]}" "${EOD[@]}" \
    --metrics-file "$WORK_DIR/metrics_$name.jsonl" "$@" > "$log" 2>&1 &
  local pid=$!
  # Show the iteration lines as they come; the full log stays in $log.
  tail -n +1 -f --pid="$pid" "$log" | grep --line-buffered -E "iteration +[0-9]+/|validation loss|error" || true
  wait "$pid" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "run $name failed (exit $rc); the last lines of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
}

CP_EXTRA=("$@")
run cp1     --context-parallel-size 1 "${CP_EXTRA[@]}"
run ring    --context-parallel-size "$NPROC" --context-parallel-algo ring "${CP_EXTRA[@]}"
run ulysses --context-parallel-size "$NPROC" --context-parallel-algo ulysses "${CP_EXTRA[@]}"
run hybrid  --context-parallel-size "$NPROC" --context-parallel-algo hybrid \
            --ulysses-degree-in-cp 2 "${CP_EXTRA[@]}"

echo "== 5. per-iteration lm loss (CP=1 is the reference)"
"$PY" "$ROOT/tools/loss_table.py" cp1="$WORK_DIR/metrics_cp1.jsonl" \
  ring="$WORK_DIR/metrics_ring.jsonl" ulysses="$WORK_DIR/metrics_ulysses.jsonl" \
  hybrid="$WORK_DIR/metrics_hybrid.jsonl" --tolerance 1e-5
