#!/usr/bin/env bash
# Usage: bash scripts/test_cpu.sh [pytest args...]
# Sets up the CPU environment (scripts/setup_cpu_env.sh) and runs the test suite; GPU tests
# are skipped on a machine without CUDA. Extra arguments go to pytest ("-k layout", "-x").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_EOD_VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/setup_cpu_env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q "$@"
