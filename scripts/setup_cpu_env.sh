#!/usr/bin/env bash
# Usage: bash scripts/setup_cpu_env.sh
# Creates (or reuses) the virtual environment and installs the pinned requirements and this
# package (editable). Re-running is cheap: nothing is installed when the requirements have not
# changed since the last install.
#   MEGATRON_EOD_VENV  where the venv lives        (default: <repo>/.venv)
#   PYTHON             interpreter to create it    (default: python3.12 on PATH, else pyenv's)
#   MEGATRON_CORE      another megatron-core than requirements/cpu.txt's 0.19.2:
#                      0.17.x / 0.18.x (Python 3.12, the same pins otherwise), or 0.16.1
#                      (Python 3.11, requirements/cpu-py311.txt; its wheel has no trainer:
#                      Megatron-LM's comes from a core_v0.16.1 checkout); used by
#                      scripts/test_megatron_lm_versions.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_EOD_VENV:-$ROOT/.venv}"
CORE="${MEGATRON_CORE:-}"

REQUIREMENTS="$ROOT/requirements/cpu.txt"
MINOR=12
if [[ "$CORE" == 0.16.* ]]; then
  REQUIREMENTS="$ROOT/requirements/cpu-py311.txt"
  MINOR=11
fi
WANTED="3.$MINOR"

if [ ! -x "$VENV/bin/python" ]; then
  if [ -z "${PYTHON:-}" ]; then  # the first that runs (a pyenv shim may not)
    for candidate in "python$WANTED" "$HOME/.pyenv/versions/$WANTED"*/bin/python \
        "${PYENV_ROOT:-$HOME/.pyenv}/versions/$WANTED"*/bin/python; do
      if "$candidate" -c "import sys; assert sys.version_info[:2] == (3, $MINOR)" \
          2>/dev/null; then
        PYTHON="$candidate"
        break
      fi
    done
  fi
  if [ -z "${PYTHON:-}" ]; then
    echo "[setup] Python $WANTED not found (megatron-core ${CORE:-0.19.2} needs it): install" \
         "it (e.g. pyenv install $WANTED, or your distribution's python$WANTED and" \
         "python$WANTED-venv), or set PYTHON=/path/to/python$WANTED" >&2
    exit 1
  fi
  "$PYTHON" -c "import sys; assert sys.version_info[:2] == (3, $MINOR), \
    'megatron-core ${CORE:-0.19.2} needs Python $WANTED, not %d.%d (PYTHON=$PYTHON)' \
    % sys.version_info[:2]" || exit 1
  echo "[setup] creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -c "import sys; assert sys.version_info[:2] == (3, $MINOR), \
  '$VENV holds Python %d.%d; megatron-core ${CORE:-0.19.2} needs $WANTED: remove it, or set \
MEGATRON_EOD_VENV to another folder' % sys.version_info[:2]" || exit 1

STAMP="$VENV/.megatron_eod_installed"
WANT="${CORE:+$CORE }$(cat "$REQUIREMENTS" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  # pip fails half-way with "No space left on device" otherwise; say so before it starts.
  NEED_MIB=$([ "$MINOR" = 11 ] && echo 2048 || echo 8192)  # the venv plus pip's unpacking
  for dir in "$VENV" "${TMPDIR:-/tmp}"; do
    FREE_MIB=$(df -Pm "$dir" 2>/dev/null | awk 'NR == 2 {print $4}') || continue
    if [ "${FREE_MIB:-0}" -lt "$NEED_MIB" ]; then
      echo "[setup] only $FREE_MIB MiB free under $dir; installing needs about $NEED_MIB MiB" \
        "(free some space, or set MEGATRON_EOD_VENV / TMPDIR to another disk)" >&2
      exit 1
    fi
  done
  echo "[setup] installing ${REQUIREMENTS#"$ROOT"/}${CORE:+ with megatron-core $CORE} into $VENV"
  # One pip command for torch and megatron-core together (see requirements/cpu.txt).
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r <(sed -E "${CORE:+s/^megatron-core==.*/megatron-core==$CORE/}" "$REQUIREMENTS") \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -e "$ROOT" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
  echo "$WANT" > "$STAMP"
fi
