#!/usr/bin/env bash
# Usage: bash scripts/test_megatron_lm_versions.sh [VERSION] [PYTEST ARGS...]
# Runs the tests that face Megatron-LM's own trainer against the megatron-core wheel that GPU
# users install (VERSION, default 0.19.2: from 0.17 the wheels carry megatron.training and
# need Python >= 3.12), in a venv of its own, .venv-mcore-VERSION. With no pytest args: the
# Megatron-LM trainer, flag, checkpoint, data-check, step and CPU-compat tests; pass `tests`
# for the whole suite.
# Not in CI (CI runs megatron-core 0.16.1 with ../shared/megatron-lm on Python 3.11): on
# Python 3.12 pip resolves torch==2.13.0 to its CUDA build, several GB. Everything still runs
# on CPU ranks with gloo.
#   PYTHON   interpreter for the venv (default: the first Python >= 3.12 found)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:-0.19.2}"
[ $# -gt 0 ] && shift
VENV="$ROOT/.venv-mcore-$VERSION"
if [ -z "${PYTHON:-}" ]; then  # the first that runs (a pyenv shim may not)
  for candidate in python3.12 python3.13 "$HOME"/.pyenv/versions/3.1[23]*/bin/python; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] >= (3, 12)' 2>/dev/null; then
      PYTHON="$candidate"
      break
    fi
  done
fi

if [ ! -x "$VENV/bin/python" ]; then
  [ -n "${PYTHON:-}" ] || { echo "no Python >= 3.12 found: set PYTHON" >&2; exit 1; }
  "$PYTHON" -c 'import sys; assert sys.version_info[:2] >= (3, 12), \
    "megatron-core >= 0.17 needs Python >= 3.12, not %d.%d" % sys.version_info[:2]' || exit 1
  echo "[setup] creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi

STAMP="$VENV/.megatron_eod_installed"
WANT="$VERSION $(cat "$ROOT/requirements/cpu.txt" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  echo "[setup] installing torch and megatron-core $VERSION into $VENV"
  # One pip command for torch and megatron-core (see requirements/cpu.txt); the rest of the
  # pinned test requirements as CI has them.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    "torch==2.13.0" "megatron-core==$VERSION" \
    -r <(grep -v -E '^(torch|megatron-core)==' "$ROOT/requirements/cpu.txt")
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -e "$ROOT"
  echo "$WANT" > "$STAMP"
fi

# The wheel's megatron/training is Megatron-LM's trainer: the tests find it there.
MEGATRON_LM_PATH="$("$VENV/bin/python" -c 'import os, megatron.training as t
print(os.path.dirname(os.path.dirname(os.path.dirname(t.__file__))))' 2>/dev/null)"
export MEGATRON_LM_PATH
echo "[test] megatron-core $("$VENV/bin/python" -c 'import megatron.core as c; print(c.__version__)' 2>/dev/null), Megatron-LM's trainer from $MEGATRON_LM_PATH"

cd "$ROOT"
if [ $# -eq 0 ]; then
  set -- tests/training/test_megatron_lm.py tests/training/test_megatron_lm_args.py \
    tests/training/test_megatron_lm_pretrain.py tests/training/test_trainer_choice.py \
    tests/training/test_checkpoint_interop.py tests/training/test_data_checks_at_startup.py \
    tests/megatron/test_cpu_compat.py tests/megatron/test_steps.py tests/data/test_checks.py
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
