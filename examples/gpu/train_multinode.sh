#!/usr/bin/env bash
# Usage, on every node: bash examples/gpu/train_multinode.sh {ring|ulysses|hybrid} [flags]
# Several nodes with 8 GPUs each, torchrun's c10d rendezvous. Default CP spans all GPUs:
# 16 on 2 nodes; hybrid puts Ulysses (degree 8, all-to-all over NVLink) inside each node and
# Ring across nodes, which is what hybrid is for.
# Environment:
#   MASTER_ADDR     the rendezvous host (any node reachable by all)   (required)
#   MASTER_PORT     rendezvous port                                    (29500)
#   NNODES          number of nodes                                    (2)
#   NPROC           GPUs per node                                      (8)
#   RDZV_ID         job id shared by all nodes                         (megatron-eod)
#   and everything gpt_flags.sh lists (CP_SIZE, ULYSSES_DEGREE, DATA_PATH, ...).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ALGO="${1:?usage: $0 ring|ulysses|hybrid [flags]}"; shift
: "${MASTER_ADDR:?set MASTER_ADDR to the rendezvous host}"
NNODES="${NNODES:-2}"
NPROC="${NPROC:-8}"
CP_SIZE="${CP_SIZE:-$((NNODES * NPROC))}"
ULYSSES_DEGREE="${ULYSSES_DEGREE:-$NPROC}"
source "$ROOT/examples/gpu/gpt_flags.sh"

launch torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
  --rdzv-id "${RDZV_ID:-megatron-eod}" \
  "$ROOT/pretrain_gpt.py" "${GPT_FLAGS[@]}" "$@"
