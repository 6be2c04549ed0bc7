#!/usr/bin/env bash
# Usage: bash scripts/fetch_offline_wheels.sh [DEST]
# For a GPU machine that cannot reach a package index but whose Python already has CUDA torch:
# downloads HERE the wheels of requirements/offline_gpu.txt built for THAT machine's Python and
# platform (megatron-core 0.19.2 carries Megatron-LM's trainer). Carry DEST to the GPU machine
# (inside the repository); scripts/gpu_checks.sh installs from it before it runs.
#   DEST                    where to put wheels/ (default: <repo>/.device, git-ignored)
#   OFFLINE_PYTHON_VERSION  the GPU machine's Python, MAJOR.MINOR (default: 3.12)
#   OFFLINE_ARCH            its processor (default: x86_64)
#   PYTHON                  the interpreter whose pip downloads (default: the CPU venv's, else
#                           python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.device}"
VERSION="${OFFLINE_PYTHON_VERSION:-3.12}"
ARCH="${OFFLINE_ARCH:-x86_64}"
PYTHON="${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}"

[[ "$VERSION" =~ ^3\.[0-9]+$ ]] || {
  echo "[offline] OFFLINE_PYTHON_VERSION must be MAJOR.MINOR such as 3.12, not '$VERSION'" >&2
  exit 2
}
# pip matches a platform tag exactly: offer every manylinux glibc level a wheel may name.
PLATFORMS=(--platform "manylinux2014_$ARCH" --platform "manylinux1_$ARCH")
for minor in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${minor}_$ARCH"); done

# One version of each package: a stale wheel beside a new one stops the whole install.
rm -rf "$DEST/wheels"
mkdir -p "$DEST/wheels"
echo "[offline] downloading requirements/offline_gpu.txt for CPython $VERSION ($ARCH) into $DEST/wheels"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$VERSION" --implementation cp "${PLATFORMS[@]}" \
  -r "$ROOT/requirements/offline_gpu.txt" -d "$DEST/wheels" \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
wanted=$(grep -cvE '^\s*(#|$)' "$ROOT/requirements/offline_gpu.txt")
got=$(find "$DEST/wheels" -name '*.whl' | wc -l)
[ "$got" -eq "$wanted" ] || {
  echo "[offline] expected $wanted wheels, found $got in $DEST/wheels" >&2
  exit 1
}

echo "[offline] $(du -sh "$DEST" | cut -f1) in $DEST: carry it inside the repository, then run"
echo "          bash scripts/gpu_checks.sh   (it installs $DEST/wheels with pip --no-index)"
