#!/usr/bin/env python3
"""Device kernels a CP rank's attention launches besides the attention kernels themselves.

    python tools/count_launches.py [--samples 3] [--configs 32768:4,131072:8]

At small per-rank sizes the glue around the attention kernels (gathers of rows, log-sum-exp
merges, gradient sums, dtype casts) costs launches of a few microseconds each, which is why
the busiest rank's time exceeds the ideal on a GPU (docs/BENCHMARKS.md). This counts that
glue without a GPU: it runs each ring group's forward+backward (simulate.py, bf16 on the CPU,
through the GPU backend's own code, TorchVarlenBackend, whose two flash kernels are answered
by empty results) under a dispatch mode that counts every aten operation that would launch a
kernel (views and allocations excluded), the backend's own lse fix-ups and copies included.
Each log-sum-exp merge counts as the loop nests inductor makes of it (MERGE_LAUNCHES, read
from its CPU output code; on CUDA each nest is expected to be one Triton kernel: a profile on
a GPU confirms or corrects it).
A group's glue includes its own side of the exchange: the gathers of the rows it sends (the
steps executor; the batched one sends views) and the landing of the gradients they get back
(the transfers themselves are not counted).
Reports, for the busiest group (most launches) of each mix: attention calls, glue launches,
and glue launches per attention call, for ring and hybrid (Ulysses degree 2), each with both
ring executors (batched, steps) and the batched one with the fused forward (the default
on GPUs; each Triton launch counts as a call); ideal is one attention call and no glue.
Beside them, the most bytes any group's glue writes, in units of that group's q (its rows x
all query heads x head dim, --heads / --kv-heads set the GQA ratio): a memory-bound kernel's
time follows its bytes, so this says what the glue costs where launches are hidden.
The executor's shape-based choice (sum returned gradients over the run covering the rows sent
or over all rows: `batched.LAUNCH_BYTES`) is made as for a model's rows
(--model-kv-heads x --model-head-dim, bf16), not for the toy rows counted here: the launch
price is scaled by the ratio of the two row sizes.
Beside them, the attention kernels' own floor in a tile model (tools/tile_model.py): the
busiest group's flash tiles per rank over the whole-row call's tiles / cp, forward and
backward, mean over the rows.
"""

import argparse
import os
import sys
from collections import Counter
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from bench_cp import pack_rows, stdlib_lengths, web_row  # noqa: E402
from bench_layouts import OURS  # noqa: E402
from tile_model import TILES, plan_calls, tiles_over_ideal  # noqa: E402
from megatron_eod import plan_context_parallel  # noqa: E402
from megatron_eod.attention import batched, ring  # noqa: E402
from megatron_eod.attention.backends import TorchVarlenBackend  # noqa: E402
from megatron_eod.attention.simulate import InProcessTransport, Ready, SimulatedPlan  # noqa: E402
from megatron_eod.attention.triton_forward import TritonForwardBackend  # noqa: E402

# Loop nests of the compiled merge (TORCH_LOGS=output_code, CPU inductor, torch 2.13): a run of
# rows updates lse then out in two; rows by index gather, compute and scatter in four.
MERGE_LAUNCHES = {"span": 2, "rows": 4}

# Operations that launch no kernel: views, metadata, allocations.
_FREE = {"select", "slice", "unsqueeze", "squeeze", "view", "_unsafe_view", "transpose", "t",
         "expand", "as_strided", "alias", "detach", "empty", "empty_like", "empty_strided",
         "unbind", "split", "narrow", "permute", "reshape", "lift_fresh", "_to_copy_noop"}


# PyTorch's CUDA flash kernels, which the GPU backend (TorchVarlenBackend) calls: counted as
# attention calls and answered with results of the right shapes, no work (they have no CPU
# kernel); everything else the backend does around them (lse fix-ups, copies) is glue.
_ATTENTION_OPS = {"_flash_attention_forward", "_flash_attention_backward"}


# In-place index operations write their source's rows, not the whole tensor they return.
_SOURCE_ARG = {"index_add_": 3, "index_copy_": 3, "index_put_": 2}


class Launches(NamedTuple):
    """A group's forward+backward: attention calls, glue launches, launches by operation,
    and bytes the glue writes (a memory-bound kernel's time follows its bytes)."""
    calls: int
    glue: int
    ops: Counter
    glue_bytes: int


def _written(name, args, out) -> int:
    if name in _SOURCE_ARG:
        return args[_SOURCE_ARG[name]].nbytes
    return sum(t.nbytes for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


class _Launches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = Counter()
        self.calls = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _ATTENTION_OPS:
            self.calls += 1
            return _attention_results(name, args)
        out = func(*args, **(kwargs or {}))
        if name not in _FREE:
            self.count[name] += 1
            self.bytes += _written(name, args, out)
        return out


def _attention_results(name, args):
    """What the flash op returns, as empty tensors: forward (out, lse [H, T], seed, offset,
    debug mask), backward (dq, dk, dv)."""
    if name == "_flash_attention_forward":
        q = args[0]
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        scalar = torch.empty((), dtype=torch.int64)
        return torch.empty_like(q), lse, scalar, scalar, torch.empty(0, dtype=q.dtype)
    _, q, k, v = args[:4]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _LandingTransport(InProcessTransport):
    """Also hands back gradients for the rows the group sent (uninitialised: the transfer
    would fill them), so that their landing into dk/dv is counted as the group's glue."""

    def start_all_grad(self, schedule, gk_NGD, gv_NGD, row_shape, dtype, device):
        super().start_all_grad(schedule, gk_NGD, gv_NGD, row_shape, dtype, device)
        rows = schedule.batched.send_index.numel()
        return Ready(torch.empty((2, rows) + tuple(row_shape), dtype=dtype, device=device))

    def start_grad(self, step, grad_2NGD, row_shape, dtype, device):
        super().start_grad(step, grad_2NGD, row_shape, dtype, device)
        rows = step.send_index.numel()
        return Ready(torch.empty((2, rows) + tuple(row_shape), dtype=dtype, device=device)
                      if rows else None)


class _CountedFused(TritonForwardBackend):
    """The fused forward (--cp-fused-forward, the default on GPUs) over the GPU backend:
    each of its Triton launches counts as an attention call, with no work."""

    def __init__(self, mode):
        super().__init__(TorchVarlenBackend())
        self.mode = mode

    def forward_tiles(self, *args):
        if args[5].shape[0]:  # tiles to launch
            self.mode.calls += 1


def group_launches(plan, g, tensors, schedule_map=None, exchange="batched",
                   fused=False) -> Launches:
    """Group g's forward+backward with the ring executor `exchange`, with the fused forward
    where `fused`; `schedule_map` rewrites the schedules first (tests compare variants)."""
    mode = _Launches()
    backend = _CountedFused(mode) if fused else TorchVarlenBackend()
    sim = SimulatedPlan(plan, *tensors, backend, 0.1, exchange)
    sim.transport_type = _LandingTransport
    if schedule_map is not None:
        sim.schedules = [schedule_map(s) for s in sim.schedules]
    real_merge = ring.merge_into

    def counted_merge(*args, **kwargs):
        kind = "span" if kwargs.get("span") is not None else "rows"
        mode.count[f"fused merge ({kind})"] += MERGE_LAUNCHES[kind]
        mode.bytes += args[3].nbytes + args[4].nbytes  # the partial's rows of out and lse
        with _disable_current_modes():
            real_merge(*args, **kwargs)

    ring.merge_into = batched.merge_into = counted_merge
    try:
        with mode:
            sim.run_group(g)
    finally:
        ring.merge_into = batched.merge_into = real_merge
    return Launches(mode.calls, sum(mode.count.values()), mode.count, mode.bytes)


# Our layouts (bench_layouts.OURS), then the batched ones with the fused forward.
LAYOUTS = [(*row, False) for row in OURS] + [
    (f"{name} (fused forward)", algo, u, exchange, True)
    for name, algo, u, exchange in OURS if exchange == "batched"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=3, help="random rows per configuration")
    p.add_argument("--configs", default="32768:4,131072:8", help="comma-separated TOKENS:CP")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--model-kv-heads", type=int, default=8,
                   help="key/value heads of the model whose shape-based choices are made")
    p.add_argument("--model-head-dim", type=int, default=128)
    p.add_argument("--verbose", action="store_true", help="print the operations counted")
    args = p.parse_args(argv)
    launch_bytes = batched.LAUNCH_BYTES
    # A toy row costs this fraction of a model's row: a launch, the same fraction of its bytes.
    batched.LAUNCH_BYTES = launch_bytes * args.kv_heads * 8 // (args.model_kv_heads
                                                                 * args.model_head_dim)
    try:
        _report(args)
    finally:
        batched.LAUNCH_BYTES = launch_bytes


def _report(args):
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    std = stdlib_lengths()
    print("| mix | tokens / CP | layout | attention calls | glue launches | per call "
          "| glue writes, in q's | attention tiles over ideal: fwd / bwd |")
    print("|---|---|---|---|---|---|---|---|")
    for mix in ("stdlib", "web"):
        for n, cp in configs:
            rng = np.random.default_rng(0)
            found, heaviest, tiles = {}, {}, {}
            for _ in range(args.samples):
                cu = pack_rows(std, n, rng) if mix == "stdlib" else web_row(n, rng)
                q = torch.zeros(n, args.heads, 8, dtype=torch.bfloat16)
                kv = torch.zeros(n, args.kv_heads, 8, dtype=torch.bfloat16)
                for name, algo, u, exchange, fused in LAYOUTS:
                    name = name.replace("ours ", "")
                    plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, u)
                    ratio = tiles_over_ideal(plan_calls(plan, exchange), cu, cp, u or 1)
                    for direction, value in ratio.items():
                        tiles.setdefault((name, direction), []).append(value)
                    for g in range(plan.ring_size):
                        got = group_launches(plan, g, (q, kv, kv, q), exchange=exchange,
                                             fused=fused)
                        if got.glue > found.get(name, (0, -1))[1]:
                            found[name] = got
                        # In units of the group's q: its rows x all heads x head dim.
                        q_bytes = plan.schedules[g].num_tokens * q[0].nbytes
                        heaviest[name] = max(heaviest.get(name, 0), got.glue_bytes / q_bytes)
            for name, (calls, glue, ops, _) in found.items():
                fwd, bwd = (np.mean(tiles[name, d]) for d in TILES)
                print(f"| {mix} | {n // 1024}k / {cp} | {name} | {calls} | {glue} | "
                      f"{glue / calls:.1f} | {heaviest[name]:.1f} | {fwd:.3f} / {bwd:.3f} |")
                if args.verbose:
                    print(f"  {dict(ops)}")


if __name__ == "__main__":
    main()
