"""The batched ring's backward as fused Triton kernels over the plan's tiles.

One job: launch the fused backward's kernels (attention/triton_backward_kernels.py) from the
rows' final out and lse: `row_delta`, the rowsum(dout * out) the others read; `tile_dq` over
the forward's query tiles (plan/forward_tiles.py; each row's received and local keys);
`tile_dkdv` over a launch's key tiles (plan/key_tiles.py: the local keys, or the received
ones). The batched executors' fused path (fused.py) runs the local keys' dk/dv while the
keys travel, then the received keys' (their gradients go back to their owners) and dq: four
kernels (delta's included) instead of two backward calls and a sum of dq's two terms.

What it does not do: no communication (batched.py), no dropout.
"""

from __future__ import annotations

import math
import re

import torch

from megatron_eod.attention.triton_compile import compile_kernel
from megatron_eod.attention.triton_forward import block_d, check_tensors

BACKWARD = "the fused backward (--cp-fused-backward)"

__all__ = ["compile_backward_for", "compile_delta_for", "row_delta", "tile_dq", "tile_dkdv"]


# Rows per program of the delta kernel (a memory-bound row sum: 4 warps read 2 x 64 rows).
DELTA_ROWS = 64


def row_delta(dout, out):
    """float32 [T, H]: each row's and head's dout . out, summed in float32 by one kernel
    launch (no float32 copy of either)."""
    check_tensors(out, None, None, 16, "out", BACKWARD, dout=dout)
    rows, heads, head_dim = out.shape
    delta = torch.empty((rows, heads), dtype=torch.float32, device=out.device)
    if rows == 0:
        return delta
    from megatron_eod.attention.triton_backward_kernels import row_delta_kernel

    row_delta_kernel[(-(-rows // DELTA_ROWS), heads)](
        dout, out, delta, rows, dout.stride(0), dout.stride(1), out.stride(0), out.stride(1),
        delta.stride(0), delta.stride(1), **_delta_constants(head_dim), num_warps=4)
    return delta


def _delta_constants(head_dim):
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_T=DELTA_ROWS)


# Blocks without register spills at head_dim 128 on sm_80 and sm_90 under Triton 3.7.1
# (ptxas -v on the PTX of compile_backward_for, tested): dq 128 query rows x 32 keys (64 keys
# spill on sm_80); dk/dv 64 keys x 32 query rows (64 rows spill on sm_90; under Triton 3.6.0,
# the H200's, 32 rows spill 88 bytes there and 16 none: scripts/test_triton_versions.sh); 8
# warps, 2 stages. Chosen for registers, not measured: on one H200 the two kernels took
# 2.1-2.3x PyTorch's backward, with a dk/dv kernel since rewritten (keys as the matrix rows:
# on sm_90 its four products are warpgroup MMAs, where two were Ampere-style and p, ds went
# through shared memory to be transposed, every block).
DQ_BLOCK_N, DKDV_BLOCK_M = 32, 32

# (dq's key block, dk/dv's query block, num_warps, num_stages[, dk/dv's num_warps]) for every
# launch instead of the above, or None: for benchmarks sweeping the kernels' shapes
# (tools/bench_cp_gpu.py --fused-backward-config, tools/sweep_fused_backward.py), at every
# head_dim as given; dk/dv's warps default to dq's.
BACKWARD_OVERRIDE = None

# Whether dq comes from the dk/dv kernel's float32 atomic adds (FlashAttention-2's backward)
# instead of the dq kernel: five matrix products a block instead of seven and one kernel
# less, but the adds' order varies run to run (not bitwise reproducible, so never under
# --deterministic-mode) and each block adds its rows' dq to memory. For benchmarks until a
# GPU has timed both (tools/sweep_fused_backward.py's `atomic:` shapes).
ATOMIC_DQ = False


def atomic_dq_problem():
    """None where this Triton compiles the dk/dv kernel that adds dq, else why not (3.2
    aborts the process compiling it, 3.3 fails; 3.0-3.1 and 3.4-3.7 compile it, 3.0-3.1
    with scalar adds: scripts/test_triton_versions.sh)."""
    import triton

    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", triton.__version__).groups())
    if (major, minor) in ((3, 2), (3, 3)):
        return (f"dq by atomic adds does not compile with Triton 3.2 (it aborts the process) "
                f"or 3.3: found {triton.__version__}")
    return None


def _blocks(head_dim):
    """(dq's key block, dk/dv's query block, dq's num_warps, num_stages, dk/dv's num_warps)
    at head_dim."""
    if BACKWARD_OVERRIDE is not None:
        dq_block_n, dkdv_block_m, warps, stages, *dkdv_warps = BACKWARD_OVERRIDE
        return dq_block_n, dkdv_block_m, warps, stages, (dkdv_warps or [warps])[0]
    stages = 2 if head_dim <= 128 else 1  # shared memory above 128
    return DQ_BLOCK_N, DKDV_BLOCK_M, 8, stages, 8


def _shape(head_dim, block_m, block_n, dkdv=False):
    """(constexpr arguments, launch options) of the dq kernel, or with `dkdv` the dk/dv one."""
    _, _, dq_warps, num_stages, dkdv_warps = _blocks(head_dim)
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=block_m,
                BLOCK_N=block_n), \
        dict(num_warps=dkdv_warps if dkdv else dq_warps, num_stages=num_stages)


def _check_block(what, size):
    """Triton's matrix products need every block dimension >= 16 on a GPU."""
    if size < 16 or size & (size - 1):
        raise ValueError(f"the fused backward's {what} must be a power of two >= 16, got "
                         f"{size}")


def tile_dq(dout, q, k, v, received_k, received_v, lse, delta, tiles, row_start, dq, scale,
            block_m, block_n=None):
    """Writes dq of every row of `tiles` (the forward's query tiles of block_m rows)."""
    check_tensors(q, tiles, row_start, block_m, kernel=BACKWARD, k=k, v=v, dout=dout, dq=dq)
    block_n = _blocks(q.shape[2])[0] if block_n is None else block_n
    _check_block("dq's key block", block_n)
    if tiles.shape[0] == 0:
        return
    if received_k is None:
        received_k, received_v = k, v
    heads, kv_heads = q.shape[1], k.shape[1]
    constants, options = _shape(q.shape[2], block_m, block_n)
    from megatron_eod.attention.triton_backward_kernels import attention_dq_kernel

    attention_dq_kernel[(tiles.shape[0] * heads,)](
        q, k, v, received_k, received_v, dout, lse, delta, dq, tiles, row_start,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        received_k.stride(0), received_k.stride(1), received_v.stride(0),
        received_v.stride(1), dout.stride(0), dout.stride(1), lse.stride(0), lse.stride(1),
        delta.stride(0), delta.stride(1), dq.stride(0), dq.stride(1),
        float(scale) * math.log2(math.e), float(scale), HEADS=heads,
        GROUP=heads // kv_heads, **constants, **options)


def tile_dkdv(dout, q, k, v, lse, delta, key_tiles, row_start, dk, dv, scale, causal,
              block_n, block_m=None, dq32=None):
    """Writes dk, dv of every key row of `key_tiles` ([n, 4] of plan/key_tiles.py; k, v the
    local rows with `causal`, else the receive buffer's); with `dq32` (float32 like q) also
    adds to it the dq its keys give their rows (ATOMIC_DQ)."""
    check_tensors(q, key_tiles, row_start, 16, kernel=BACKWARD, k=k, v=v, dout=dout, dk=dk,
                  dv=dv)
    if dq32 is not None and (dq32.dtype != torch.float32 or dq32.shape != q.shape or
                             dq32.stride(-1) != 1 or dq32.device != q.device):
        raise ValueError(f"{BACKWARD}: dq32 must be float32 of q's shape {tuple(q.shape)} "
                         f"on q's device ({q.device}) with a unit last stride, got "
                         f"{dq32.dtype} {tuple(dq32.shape)} on {dq32.device}, strides "
                         f"{dq32.stride()}")
    if dq32 is not None and (problem := atomic_dq_problem()) is not None:
        raise ValueError(f"{BACKWARD}: {problem}")
    block_m = _blocks(q.shape[2])[1] if block_m is None else block_m
    _check_block("the key tiles' keys (key_block)", block_n)
    _check_block("dk/dv's query block", block_m)
    if key_tiles.shape[0] == 0:
        return
    heads, kv_heads = q.shape[1], k.shape[1]
    constants, options = _shape(q.shape[2], block_m, block_n, dkdv=True)
    from megatron_eod.attention.triton_backward_kernels import attention_dkdv_kernel

    dq_out = dk if dq32 is None else dq32  # (unread without ATOMIC_DQ)
    attention_dkdv_kernel[(key_tiles.shape[0] * kv_heads,)](
        q, k, v, dout, lse, delta, dk, dv, dq_out, key_tiles, row_start,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), lse.stride(0), lse.stride(1), delta.stride(0),
        delta.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        dq_out.stride(0), dq_out.stride(1), float(scale) * math.log2(math.e), float(scale),
        KV_HEADS=kv_heads, GROUP=heads // kv_heads, CAUSAL=causal, ATOMIC_DQ=dq32 is not None,
        **constants, **options)


def compile_delta_for(arch: int, dtype: str = "bf16", head_dim: int = 128):
    """row_delta's kernel compiled for `arch` without a GPU (delta [T, H] contiguous)."""
    from megatron_eod.attention.triton_backward_kernels import row_delta_kernel

    return compile_kernel(row_delta_kernel, arch, dtype, _delta_constants(head_dim),
                          dict(num_warps=4), ("s_eh",))


def compile_backward_for(arch: int, dtype: str = "bf16", head_dim: int = 128, group: int = 4,
                         block_m: int = 128, block_n: int = 64, heads: int = 32,
                         atomic_dq: bool = False):
    """(dq kernel, dk/dv kernel) compiled for `arch` without a GPU, as
    triton_forward.compile_for (lse [H, T] memory, delta [T, H] contiguous); `atomic_dq`:
    the dk/dv kernel that adds dq too (ATOMIC_DQ)."""
    from megatron_eod.attention.triton_backward_kernels import (attention_dkdv_kernel,
                                                                attention_dq_kernel)

    dq_block_n, dkdv_block_m, *_ = _blocks(head_dim)
    constants, options = _shape(head_dim, block_m, dq_block_n)
    dq = compile_kernel(attention_dq_kernel, arch, dtype,
                        dict(constants, HEADS=heads, GROUP=group), options, ("s_lt", "s_eh"))
    constants, options = _shape(head_dim, dkdv_block_m, block_n, dkdv=True)
    dkdv = compile_kernel(attention_dkdv_kernel, arch, dtype,
                          dict(constants, KV_HEADS=heads // group, GROUP=group, CAUSAL=True,
                               ATOMIC_DQ=atomic_dq),
                          options, ("s_lt", "s_eh"), ("DQ",) if atomic_dq else ())
    return dq, dkdv
