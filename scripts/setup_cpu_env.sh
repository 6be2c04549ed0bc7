#!/usr/bin/env bash
# Usage: bash scripts/setup_cpu_env.sh
# Creates (or reuses) the virtual environment and installs the pinned CPU requirements and
# this package (editable). Re-running is cheap: nothing is installed when the requirements
# have not changed since the last install.
#   MEGATRON_EOD_VENV  where the venv lives        (default: <repo>/.venv)
#   PYTHON             interpreter to create it    (default: python3.11, else python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_EOD_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -c 'import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 11), \
    "megatron-core 0.16.1 (pinned in requirements/cpu.txt) needs Python 3.10 or 3.11, not %d.%d" \
    % sys.version_info[:2]' || exit 1
  echo "[setup] creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi

STAMP="$VENV/.megatron_eod_installed"
WANT="$(cat "$ROOT/requirements/cpu.txt" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  echo "[setup] installing requirements/cpu.txt into $VENV"
  # One pip command for torch and megatron-core together (see requirements/cpu.txt).
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r "$ROOT/requirements/cpu.txt"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -e "$ROOT"
  echo "$WANT" > "$STAMP"
fi
