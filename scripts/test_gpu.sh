#!/usr/bin/env bash
# Usage: bash scripts/test_gpu.sh [pytest args...]
# On a CUDA machine: set up the GPU environment (scripts/setup_gpu_env.sh) and run the tests
# marked `gpu` (kernels vs a float64 reference, simulated CP in bf16, CUDA layouts, and the
# functional bf16 training runs of tests/functional/test_gpu_training.py). CP parity runs
# need as many GPUs as ranks (up to 8) and are reported as skipped on smaller machines (-rs).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_EOD_GPU_VENV:-$ROOT/.venv-gpu}"
bash "$ROOT/scripts/setup_gpu_env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q -rs -m gpu "$@"
