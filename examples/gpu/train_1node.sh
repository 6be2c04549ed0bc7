#!/usr/bin/env bash
# Usage: bash examples/gpu/train_1node.sh {ring|ulysses|hybrid} [extra pretrain_gpt.py flags]
# One node, 8 GPUs (NCCL): the ~1.2B GPT of gpt_flags.sh at 32k tokens per row with EoD reset,
# CP=8 by default (hybrid: 4-way Ulysses x 2-way Ring). Install the GPU extras first
# (`pip install -e .[gpu]`); without flash-attn, PyTorch's varlen kernel is used.
# Environment: NPROC (default 8) and everything gpt_flags.sh lists.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ALGO="${1:?usage: $0 ring|ulysses|hybrid [flags]}"; shift
NPROC="${NPROC:-8}"
CP_SIZE="${CP_SIZE:-$NPROC}"
ULYSSES_DEGREE="${ULYSSES_DEGREE:-4}"
source "$ROOT/examples/gpu/gpt_flags.sh"

launch torchrun --standalone --nproc-per-node "$NPROC" \
  "$ROOT/pretrain_gpt.py" "${GPT_FLAGS[@]}" "$@"
