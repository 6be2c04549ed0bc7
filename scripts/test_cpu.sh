#!/usr/bin/env bash
# Usage: bash scripts/test_cpu.sh [pytest args...]
# Sets up the CPU environment (scripts/setup_cpu_env.sh) and runs the test suite; GPU tests
# are skipped on a machine without CUDA. Extra arguments go to pytest ("-k layout", "-x").
#   PYTEST_WORKERS  pytest-xdist processes, a file's tests in one (default 2: the suite's
#                   ranks wait on each other, and one process left the second core idle
#                   about a third of the time); 0 runs the suite in this process (-s, pdb)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_EOD_VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/setup_cpu_env.sh"
cd "$ROOT"
WORKERS="${PYTEST_WORKERS:-2}"
if [ "$WORKERS" = 0 ]; then
  exec "$VENV/bin/python" -m pytest -q "$@"
fi
exec "$VENV/bin/python" -m pytest -q -n "$WORKERS" --dist loadfile "$@"
