#!/usr/bin/env bash
# Usage: bash examples/moe_cpu.sh [extra pretrain_gpt.py flags]
# The quickstart's runs (examples/quickstart_cpu.sh: CP=1, CP=4 ring / ulysses / hybrid, a
# CP=4 checkpoint resumed at CP=2, each checked against CP=1 to 1e-5) with a tiny
# mixture-of-experts GPT: 8 experts, top-2, megatron-core's MoE layer in both layers, its
# load-balancing loss and all-to-all dispatcher, on 4 CPU ranks. On 8 GPUs:
#   NUM_EXPERTS=8 EP_SIZE=2 CP_SIZE=4 ULYSSES_DEGREE=2 bash examples/gpu/train_1node.sh ring
# Environment: as quickstart_cpu.sh (WORK_DIR default <repo>/runs/moe).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export WORK_DIR="${WORK_DIR:-$ROOT/runs/moe}"
exec bash "$ROOT/examples/quickstart_cpu.sh" --num-experts 8 --moe-router-topk 2 \
  --moe-ffn-hidden-size 128 --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall \
  --disable-bias-linear "$@"
