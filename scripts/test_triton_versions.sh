#!/usr/bin/env bash
# Usage: bash scripts/test_triton_versions.sh [VERSION ...]
# Compiles the fused kernels (--cp-fused-forward, --cp-fused-backward) with each Triton
# VERSION for sm_80 and sm_90 without a GPU, as the flags' start-up check does
# (attention/triton_compile.py, whose description of a kernel changed at Triton 3.2 and 3.3):
# each kernel compiles, its loads are 16-byte vectors, its shared memory fits the GPU's;
# registers and spills are printed, not checked (they move between versions).
# Default versions: 3.0.0 3.2.0 3.3.1 3.5.1 3.6.0 3.7.1 3.8.0, those of PyTorch 2.4, 2.6, 2.7,
# 2.9, 2.11 (the GPU machine's), 2.13 (the Python 3.11 venv's) and 2.14 (CI's venv, whose
# tests/attention/test_triton_compile.py compiles only the default shapes, bf16 at head dim
# 128: the other shapes, e.g. head dims 64, 80 in 16-row tiles and 256, are compiled here).
# The backward's atomic-dq benchmark form (triton_backward.ATOMIC_DQ) is compiled where it
# is not refused by name (3.2 aborts compiling it, 3.3 fails). Each version is installed
# once, without its dependencies, under .triton-versions/VERSION (550-700 MB each), and
# imported ahead of the venv's own.
# Not in CI (the downloads); needs the venv of scripts/setup_cpu_env.sh.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ $# -gt 0 ] || set -- 3.0.0 3.2.0 3.3.1 3.5.1 3.6.0 3.7.1 3.8.0
status=0
for version in "$@"; do
  target="$ROOT/.triton-versions/$version"
  if [ ! -f "$target/.installed" ]; then
    "$PYTHON" -m pip install -q --no-deps --target "$target" "triton==$version"
    touch "$target/.installed"
  fi
  echo "[triton] $version"
  if ! (cd "$ROOT" && env -u TRITON_INTERPRET PYTHONPATH="$target" \
        TRITON_CACHE_DIR="$ROOT/.triton-versions/cache-$version" "$PYTHON" - "$version" <<'EOF'
import os, re, subprocess, sys, tempfile

import triton

from megatron_eod.attention import triton_backward
from megatron_eod.attention.triton_backward import compile_backward_for, compile_delta_for
from megatron_eod.attention.triton_forward import compile_for

assert triton.__version__ == sys.argv[1], (triton.__version__, "imported instead")
LIMIT = {80: 166912, 90: 232448}  # shared memory a program may have: A100, H100/H200
ptxas = next(p for p in (os.path.join(os.path.dirname(triton.__file__), *parts) for parts in (
    ("backends", "nvidia", "bin", "ptxas"), ("third_party", "cuda", "bin", "ptxas")))
    if os.path.exists(p))


def registers(kernel, arch):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a" if arch == 90 else "sm_80",
                             f.name, "-o", os.devnull], capture_output=True, text=True,
                            check=True).stderr
    return (re.search(r"Used ([0-9]+) registers", report).group(1),
            re.search(r"([0-9]+) bytes spill stores", report).group(1))


for arch in (80, 90):
    for shape in (("bf16", 128, 4, 128), ("fp16", 64, 1, 64), *((("bf16", 256, 2, 128),)
                                                                if arch == 80 else ())):
        kernels = {"forward": compile_for(arch, *shape), "delta": compile_delta_for(
            arch, *shape[:2])}
        kernels["dq"], kernels["dk/dv"] = compile_backward_for(arch, *shape)
        for name, kernel in kernels.items():
            assert "ld.global.v4" in kernel.asm["ptx"], (arch, shape, name)
            assert kernel.metadata.shared <= LIMIT[arch], (arch, shape, name)
            regs, spilled = registers(kernel, arch)
            print(f"  sm_{arch} {shape[0]} head dim {shape[1]} {name}: {regs} registers, "
                  f"{spilled} bytes spilled, {kernel.metadata.shared} bytes shared")
# a head dim not a power of two in 16-row tiles (the forward's smallest)
kernel = compile_for(90, "bf16", 80, 8, 16)
assert "ld.global.v4" in kernel.asm["ptx"] and kernel.metadata.shared <= LIMIT[90]
print("  sm_90 bf16 head dim 80, 16-row tiles, forward: %s registers, %s bytes spilled"
      % registers(kernel, 90))
if triton_backward.atomic_dq_problem() is None:
    kernel = compile_backward_for(90, atomic_dq=True)[1]
    ptx = kernel.asm["ptx"]
    assert re.search(r"atom\.global\.gpu\.relaxed\.add(\.v4)?\.f32", ptx), "no relaxed adds"
    print("  sm_90 atomic dq: %s registers, %s bytes spilled, " % registers(kernel, 90) +
          ("16-byte adds" if ".add.v4.f32" in ptx else "scalar adds"))
else:
    print(f"  atomic dq refused: {triton_backward.atomic_dq_problem()}")
EOF
  ); then
    echo "[triton] $version FAILED"
    status=1
  fi
done
exit $status
