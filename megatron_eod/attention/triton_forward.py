"""The batched ring's forward as ONE fused Triton kernel over query tiles, longest first.

One job: launch the kernel (attention/triton_tile_kernel.py) over a group's forward tiles
(plan/forward_tiles.py), checking what it can take: for each tile of local query
rows and each query head, one program reads the tile's received keys (no mask), then its
document's local keys up to each row (causal), with one online softmax, and writes the rows'
final out and lse. Where the batched executor makes a local call, a call over received keys
and a log-sum-exp merge (three launches, a float32 round trip of the split rows, each call's
own tail), this makes one launch per half of the exchange: the tiles needing no received key
while the keys travel, the others after; every row is written once, and each launch starts
its longest tiles first.

    backend = TritonForwardBackend(get_backend(device, dtype))   # forward/backward: base's
    backend.forward_tiles(q, k, v, received_k, received_v, tiles, row_start, out, lse, scale,
                          block_m)

q: [T, H, D], k/v: [T, G, D] (G divides H), received_k/v: [N, G, D] or None, tiles: int32
[n, 5] and row_start: int32 [T] on q's device (plan/forward_tiles.py), out: [T, H, D] like
q, lse: float32 [T, H] (any strides). Only the forward is fused: the backward is the base
backend's (it takes any exact out and lse).
Triton is imported on first use; with TRITON_INTERPRET=1 set before anything imports it
(megatron-core does), the kernel runs on CPU tensors through Triton's interpreter: how the
tests check it without a GPU (tests/conftest.py sets it where there is none).

What it does not do: no backward (triton_backward.py, or the base backend's), no
communication, no dropout, no head_dim above 256.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

__all__ = ["TritonForwardBackend", "check_tensors", "compile_for", "device_problem",
           "interpreting_triton", "tile_forward", "triton_problem"]

_MAX_HEAD_DIM = 256


def interpreting_triton() -> bool:
    """Whether Triton's interpreter is asked for (CPU tensors; tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_problem():
    """None where the fused forward can run here, else why not (for the flag checks)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (it ships with PyTorch's CUDA wheels)"
    return None


def _kernel():
    """The jitted kernel, imported on first use (attention/triton_tile_kernel.py)."""
    from megatron_eod.attention.triton_tile_kernel import attention_tile_kernel

    return attention_tile_kernel


# (BLOCK_N, num_warps, num_stages) for every launch instead of `_launch_shape`'s, or None:
# for benchmarks sweeping the kernel's shapes (tools/bench_cp_gpu.py --fused-config).
LAUNCH_OVERRIDE = None


def _launch_shape(head_dim: int, block_m: int, arch=None):
    """(BLOCK_N, num_warps, num_stages) for a head_dim, query block and CUDA architecture
    (e.g. 90; None: the interpreter's). Up to head dim 128, Triton's own fused attention's
    shape on Hopper (64 keys, 8 warps, 3 stages) but on sm_90, where one H200 measured 32
    keys, 4 warps, 3 stages fastest: the whole row's forward at 0.87-0.95 of PyTorch's flash
    kernel in the sweep and 0.93-0.97 as the default, against 0.97-1.02 for 64:8:3
    (docs/BENCHMARKS.md, 2026-11-28, fourth lease). That shape spilled 12 bytes of
    registers on sm_90 then (Triton 3.6.0, the H200's); since the kernel's key blocks seen
    whole run unmasked it spills 32 there and none under Triton 3.7.1 (not timed since); it
    spills 204 bytes on sm_80, which keeps the spill-free one there until measured; smaller
    blocks for smaller tiles."""
    if LAUNCH_OVERRIDE is not None:
        return LAUNCH_OVERRIDE
    if head_dim > 128:
        # Two stages: three would need 136 KiB of shared memory on sm_80 (two: 104; sm_86/89
        # give 99, where device_problem refuses it at start-up).
        return min(32, max(block_m, 16)), (8 if block_m >= 128 else 4), 2
    if arch == 90:
        return min(32, max(block_m, 16)), 4, 3
    return min(64, max(block_m, 16)), (8 if block_m >= 128 else 4), 3


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


FORWARD = "the fused forward (--cp-fused-forward, TritonForwardBackend)"


def check_tensors(q, tiles, row_start, block_m, first="q", kernel=FORWARD, **dense):
    """What the fused kernels cannot take, named (ValueError, saying which: `kernel`): CPU
    tensors without Triton's interpreter, float32 on CUDA, tiles not int32 on q's device
    (None: no tiles), head_dim above 256, query blocks under 16 rows, and a strided head_dim
    in `q` (named `first`) or any of `dense` (name=tensor)."""
    if q.device.type != "cuda" and not interpreting_triton():
        raise ValueError(f"{kernel} runs on CUDA tensors, got {q.device} (on CPU tensors only "
                         f"through Triton's interpreter, TRITON_INTERPRET=1 before triton is "
                         f"imported, for tests)")
    if q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{kernel} takes float16 or bfloat16 on CUDA, got {q.dtype}")
    for name, t in (("tiles", tiles), ("row_start", row_start)):
        if t is not None and (t.device != q.device or t.dtype != torch.int32):
            raise ValueError(f"{kernel}: its {name} must be int32 on q's device "
                             f"({q.device}), got {t.dtype} on {t.device}: move the plan "
                             f"(CPPlan.to)")
    if q.shape[2] > _MAX_HEAD_DIM:
        raise ValueError(f"{kernel} takes head_dim <= {_MAX_HEAD_DIM}, got {q.shape[2]}")
    for name, t in dict(dense, **{first: q}).items():
        if t.stride(-1) != 1:
            raise ValueError(f"{kernel} needs a dense head_dim in {name}")
    if block_m < 16:
        raise ValueError(f"{kernel}: its query tiles need block_m >= 16, got {block_m}")


def tile_forward(q, k, v, received_k, received_v, tiles, row_start, out, lse, scale,
                 block_m):
    """Writes out and lse of every row of `tiles` (see the module); nothing to launch for
    no tiles. received_k/v None: the tiles read no received row (keys are passed for both)."""
    check_tensors(q, tiles, row_start, block_m, k=k, v=v, out=out)
    if tiles.shape[0] == 0:
        return
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    if received_k is None:
        received_k, received_v = k, v
    arch = _cuda_arch(q.device.index) if q.device.type == "cuda" else None
    constants, options = _compile_time(heads, head_dim, heads // kv_heads, block_m, arch)
    grid = (tiles.shape[0] * heads,)
    _kernel()[grid](
        q, k, v, received_k, received_v, out, lse, tiles, row_start,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        received_k.stride(0), received_k.stride(1), received_v.stride(0),
        received_v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        float(scale) * math.log2(math.e), **constants, **options)


def block_d(head_dim: int) -> int:
    """The fused kernels' head-dim block: head_dim's next power of two, at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _compile_time(heads, head_dim, group, block_m, arch=None):
    """(the kernel's constexpr arguments, its launch options) for a shape on `arch`."""
    block_n, num_warps, num_stages = _launch_shape(head_dim, block_m, arch)
    return (dict(HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), GROUP=group,
                 BLOCK_M=block_m, BLOCK_N=block_n),
            dict(num_warps=num_warps, num_stages=num_stages))


# Shared memory a program may have (bytes, opt-in) by compute capability, for a PyTorch that
# does not report it (before 2.7): CUDA's figures.
_SHARED_PER_PROGRAM = {(7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912,
                       (8, 9): 101376, (9, 0): 232448, (10, 0): 232448, (12, 0): 101376}


def device_problem(head_dim: int, dtype: str = "bf16", block_m: int = 128, device=None,
                   backward: bool = False):
    """None where the kernel (and with `backward` the fused backward's), compiled for this
    CUDA device's architecture at head_dim, fits the shared memory a program may have there,
    else why not (start-up checks: a launch that does not fit fails at the first layer,
    inside the step), or where they do not compile there (this Triton, this GPU). Compiles
    once (Triton caches)."""
    import triton

    from megatron_eod.attention.triton_compile import KernelCompileError

    index = torch.cuda.current_device() if device is None else device
    major, minor = torch.cuda.get_device_capability(index)
    props = torch.cuda.get_device_properties(index)
    # (PyTorch < 2.7 does not say: the architecture's figure, if known)
    available = getattr(props, "shared_memory_per_block_optin", None) or \
        _SHARED_PER_PROGRAM.get((major, minor))
    if not available:
        return None  # an architecture we do not know: the launch itself will say
    arch = major * 10 + minor
    where = f"{props.name} (sm_{major}{minor}) with Triton {triton.__version__}"
    try:
        kernels = [compile_for(arch, dtype, head_dim, block_m=block_m)]
    except KernelCompileError as error:
        return f"its kernel does not compile for {where}: {error.reason}; drop the flag"
    if backward:
        from megatron_eod.attention.triton_backward import compile_backward_for
        try:
            kernels += compile_backward_for(arch, dtype, head_dim, block_m=block_m)
        except KernelCompileError as error:
            return (f"with --cp-fused-backward, the backward's {error.kernel} does not compile "
                    f"for {where}: {error.reason}; drop --cp-fused-backward")
    needed = max(kernel.metadata.shared for kernel in kernels)
    if needed <= available:
        return None
    return (f"its kernels need {needed // 1024} KiB of shared memory per program at head dim "
            f"{head_dim} on {props.name} (sm_{major}{minor}), which gives {available // 1024} "
            f"KiB; use a head dim of at most 128 there (--kv-channels), or drop the flag")


def compile_for(arch: int, dtype: str = "bf16", head_dim: int = 128, group: int = 4,
                block_m: int = 128, heads: int = 32):
    """The kernel compiled for CUDA compute capability `arch` (e.g. 90) without a GPU (Triton
    ships its own ptxas): how the tests check, on a CPU, that it compiles for the GPUs it will
    run on. Needs TRITON_INTERPRET unset when triton was imported. -> Triton's CompiledKernel."""
    from megatron_eod.attention.triton_compile import compile_kernel

    constants, options = _compile_time(heads, head_dim, group, block_m, arch)
    return compile_kernel(_kernel(), arch, dtype, constants, options, ones=("s_lt",))


class TritonForwardBackend:
    """A kernel backend whose forward over a group's tiles is the fused kernel: the batched
    executors run `forward_tiles` where the schedule has tiles (ring and hybrid groups, and
    the one local call of Ulysses and CP=1, whose tiles are its documents'); every other call
    (the backward, the steps executor, which runs plans without batched forms) is the base
    backend's."""

    name = "triton"

    def __init__(self, base, fused_backward: bool = False, forward_beside: bool = True):
        self.base = base
        self.writes_out = getattr(base, "writes_out", False)
        self.writes_grads = getattr(base, "writes_grads", False)
        # --cp-fused-backward: the batched backward as the fused kernels too (fused.py)
        self.fused_backward = fused_backward
        # With concurrent_calls, whether the forward's first launch runs on a side stream
        # (False: only the backward's calls run side by side; a benchmark's row, as on one
        # H200 the side stream made the fused forward 0.01-0.13x of the ideal slower by the
        # wall clock on seven of eight rows while the backward's gained; its device time is
        # still to measure).
        self.forward_beside = forward_beside

    def forward(self, *args, **kwargs):
        return self.base.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        return self.base.backward(*args, **kwargs)

    @staticmethod
    def forward_tiles(q, k, v, received_k, received_v, tiles, row_start, out, lse, scale,
                      block_m):
        tile_forward(q, k, v, received_k, received_v, tiles, row_start, out, lse, scale,
                     block_m)

    # The fused backward's steps (attention/triton_backward.py), as fused.py calls them.
    @staticmethod
    def row_delta(dout, out):
        from megatron_eod.attention.triton_backward import row_delta
        return row_delta(dout, out)

    @staticmethod
    def dq_tiles(dout, q, lse, delta, row_start, scale, k, v, received_k, received_v, tiles,
                 dq, block_m):
        from megatron_eod.attention.triton_backward import tile_dq
        tile_dq(dout, q, k, v, received_k, received_v, lse, delta, tiles, row_start, dq, scale,
                block_m)

    @staticmethod
    def dkdv_tiles(dout, q, lse, delta, row_start, scale, k, v, key_tiles, dk, dv, causal,
                   block_n, dq32=None):
        from megatron_eod.attention.triton_backward import tile_dkdv
        tile_dkdv(dout, q, k, v, lse, delta, key_tiles, row_start, dk, dv, scale, causal,
                  block_n, dq32=dq32)

    @property
    def atomic_dq(self) -> bool:
        """Whether the fused backward's dk/dv kernels add dq (triton_backward.ATOMIC_DQ)."""
        from megatron_eod.attention import triton_backward
        return self.fused_backward and triton_backward.ATOMIC_DQ
