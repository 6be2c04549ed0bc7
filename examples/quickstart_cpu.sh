#!/usr/bin/env bash
# Usage: bash examples/quickstart_cpu.sh
# The CPU main job, end to end with the bundled offline defaults: set up .venv, write the
# sample corpus (Python stdlib text), preprocess it into a Megatron indexed dataset with EoD
# tokens, then draw a GPTDataset micro-batch and show its EoD document layout.
# (Training a tiny GPT with CP on 4 CPU ranks joins this script with the trainer.)
#   WORK_DIR     where data goes      (default: <repo>/runs/quickstart)
#   CORPUS_BYTES sample corpus size   (default: 4000000)
#   SEQ_LENGTH   tokens per row       (default: 1024)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_EOD_VENV:-$ROOT/.venv}"
WORK_DIR="${WORK_DIR:-$ROOT/runs/quickstart}"
CORPUS_BYTES="${CORPUS_BYTES:-4000000}"
SEQ_LENGTH="${SEQ_LENGTH:-1024}"

bash "$ROOT/scripts/setup_cpu_env.sh"
PY="$VENV/bin/python"
mkdir -p "$WORK_DIR"

echo "== 1. sample corpus"
"$PY" "$ROOT/tools/make_sample_corpus.py" --output "$WORK_DIR/stdlib.jsonl" \
  --max-bytes "$CORPUS_BYTES"
echo "== 2. preprocess (byte-level tokenizer, EoD appended)"
"$PY" "$ROOT/tools/preprocess_data.py" --input "$WORK_DIR/stdlib.jsonl" \
  --output-prefix "$WORK_DIR/stdlib" --append-eod --workers 2 --log-interval 2000
echo "== 3. a GPTDataset micro-batch and its document layout"
"$PY" "$ROOT/tools/show_layout.py" --data-path "$WORK_DIR/stdlib_text_document" \
  --seq-length "$SEQ_LENGTH" --micro-batch-size 2 --eod-mask-loss \
  --data-cache-path "$WORK_DIR/cache" "$@"
