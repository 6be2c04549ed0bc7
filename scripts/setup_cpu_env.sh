#!/usr/bin/env bash
# Usage: bash scripts/setup_cpu_env.sh
# Creates (or reuses) the virtual environment and installs the pinned CPU requirements and
# this package (editable). Re-running is cheap: nothing is installed when the requirements
# have not changed since the last install.
#   MEGATRON_EOD_VENV  where the venv lives        (default: <repo>/.venv)
#   PYTHON             interpreter to create it    (default: python3.11, else python3; with
#                                                   MEGATRON_CORE, the first Python >= 3.12)
#   MEGATRON_CORE      another megatron-core than requirements/cpu.txt's 0.16.1, e.g. 0.19.2
#                      (from 0.17 the wheels carry Megatron-LM's trainer and need Python
#                      >= 3.12, where torch==2.13.0 resolves to its CUDA build: several GB);
#                      used by scripts/test_megatron_lm_versions.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_EOD_VENV:-$ROOT/.venv}"
CORE="${MEGATRON_CORE:-}"

if [ -z "$CORE" ]; then
  PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
  SUPPORTED='(3, 10) <= sys.version_info[:2] <= (3, 11)'
  WHY='megatron-core 0.16.1 (pinned in requirements/cpu.txt) needs Python 3.10 or 3.11'
else
  SUPPORTED='sys.version_info[:2] >= (3, 12)'
  WHY="megatron-core $CORE needs Python >= 3.12"
  if [ -z "${PYTHON:-}" ]; then  # the first that runs (a pyenv shim may not)
    for candidate in python3.12 python3.13 "$HOME"/.pyenv/versions/3.1[23]*/bin/python; do
      if "$candidate" -c "import sys; assert $SUPPORTED" 2>/dev/null; then
        PYTHON="$candidate"
        break
      fi
    done
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  [ -n "${PYTHON:-}" ] || { echo "$WHY: none found, set PYTHON" >&2; exit 1; }
  "$PYTHON" -c "import sys; assert $SUPPORTED, \
    '$WHY, not %d.%d' % sys.version_info[:2]" || exit 1
  echo "[setup] creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi

STAMP="$VENV/.megatron_eod_installed"
WANT="${CORE:+$CORE }$(cat "$ROOT/requirements/cpu.txt" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  # pip fails half-way with "No space left on device" otherwise; say so before it starts.
  NEED_MIB=$([ -z "$CORE" ] && echo 2048 || echo 8192)  # the venv plus pip's unpacking
  for dir in "$VENV" "${TMPDIR:-/tmp}"; do
    FREE_MIB=$(df -Pm "$dir" 2>/dev/null | awk 'NR == 2 {print $4}') || continue
    if [ "${FREE_MIB:-0}" -lt "$NEED_MIB" ]; then
      echo "[setup] only $FREE_MIB MiB free under $dir; installing needs about $NEED_MIB MiB" \
        "(free some space, or set MEGATRON_EOD_VENV / TMPDIR to another disk)" >&2
      exit 1
    fi
  done
  echo "[setup] installing requirements/cpu.txt${CORE:+ with megatron-core $CORE} into $VENV"
  # One pip command for torch and megatron-core together (see requirements/cpu.txt).
  if [ -z "$CORE" ]; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
      -r "$ROOT/requirements/cpu.txt"
  else
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
      -r <(sed -E "s/^megatron-core==.*/megatron-core==$CORE/" "$ROOT/requirements/cpu.txt")
  fi
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -e "$ROOT"
  echo "$WANT" > "$STAMP"
fi
