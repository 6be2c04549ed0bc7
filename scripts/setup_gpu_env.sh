#!/usr/bin/env bash
# Usage: bash scripts/setup_gpu_env.sh
# Creates (or reuses) the GPU virtual environment and installs requirements/gpu.txt and this
# package (editable); with INSTALL_FLASH_ATTN=1 also flash-attn (a source build against the
# installed torch: needs nvcc and takes a while; without it the PyTorch varlen kernel is used).
#   MEGATRON_EOD_GPU_VENV  where the venv lives            (default: <repo>/.venv-gpu)
#   PYTHON                 interpreter to create it        (default: python3.12, else python3)
#   INSTALL_FLASH_ATTN     1: install flash-attn           (default: 0)
#   FLASH_ATTN_VERSION     flash-attn version              (default: 2.8.3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_EOD_GPU_VENV:-$ROOT/.venv-gpu}"
PYTHON="${PYTHON:-$(command -v python3.12 || command -v python3)}"

command -v nvidia-smi >/dev/null || { echo "[setup-gpu] no nvidia-smi: not a GPU machine" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 12), \
    "megatron-core 0.19.2 (requirements/gpu.txt) needs Python 3.12, not %d.%d" \
    % sys.version_info[:2]' || exit 1
  echo "[setup-gpu] creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi

STAMP="$VENV/.megatron_eod_installed"
WANT="$(cat "$ROOT/requirements/gpu.txt" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
WANT="$WANT-flash${INSTALL_FLASH_ATTN:-0}"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  echo "[setup-gpu] installing requirements/gpu.txt into $VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r "$ROOT/requirements/gpu.txt"
  if [ "${INSTALL_FLASH_ATTN:-0}" = 1 ]; then
    echo "[setup-gpu] building flash-attn ${FLASH_ATTN_VERSION:-2.8.3} (needs nvcc)"
    # flash-attn's setup.py imports these itself (no build isolation: it builds against torch)
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check ninja wheel packaging
    MAX_JOBS="${MAX_JOBS:-8}" "$VENV/bin/python" -m pip install --quiet \
      --disable-pip-version-check --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION:-2.8.3}"
  fi
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -e "$ROOT"
  echo "$WANT" > "$STAMP"
fi
"$VENV/bin/python" -c 'import torch; assert torch.cuda.is_available(), \
  "torch %s sees no CUDA device" % torch.__version__; \
  print("[setup-gpu] torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())'
