#!/usr/bin/env bash
# Usage: bash examples/gpu/train_moe_1node.sh {ring|ulysses|hybrid} [extra pretrain_gpt.py flags]
# One node, 8 GPUs (NCCL): the GPT of gpt_flags.sh with a mixture of experts in every layer
# (8 experts, top-2, megatron-core's MoE layer) at 32k tokens per row with EoD reset: CP=4
# (hybrid: 2-way Ulysses x 2-way Ring) x 2-way data parallel, the experts over 2
# expert-parallel ranks. Environment: NPROC (8), CP_SIZE (4), ULYSSES_DEGREE (2),
# NUM_EXPERTS (8), EP_SIZE (2) and everything gpt_flags.sh lists.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ALGO="${1:?usage: $0 ring|ulysses|hybrid [flags]}"; shift
NPROC="${NPROC:-8}"
CP_SIZE="${CP_SIZE:-4}"
ULYSSES_DEGREE="${ULYSSES_DEGREE:-2}"
NUM_EXPERTS="${NUM_EXPERTS:-8}"
EP_SIZE="${EP_SIZE:-2}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/moe_${ALGO}}"
source "$ROOT/examples/gpu/gpt_flags.sh"

launch torchrun --standalone --nproc-per-node "$NPROC" \
  "$ROOT/pretrain_gpt.py" "${GPT_FLAGS[@]}" "$@"
