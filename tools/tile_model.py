"""The attention kernels' floor in a tile model: what partial tiles cost a layout.

A flash kernel computes a varlen call in tiles of block_q queries x block_k keys, and a tile
holding one needed pair costs as much as a full one. So pieces of split documents pay partial
tiles that the whole row's one call does not: a 300-row query piece against 8k received keys
rounds up to 384 rows. `tiles_over_ideal` gives the busiest rank's tiles over the whole row's
tiles / cp, forward and backward: the device time of the attention kernels cannot beat this
ratio, whatever the glue around them. A model, not a measurement (tile shapes differ by
kernel, GPU and head dim); tools/count_launches.py and tools/bench_cp_gpu.py report it.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_eod.attention.ring import BATCHED, executor_for  # noqa: E402

__all__ = ["TILES", "call_tiles", "fused_forward_tiles", "plan_calls", "tiles_over_ideal"]

# Tile shapes of FlashAttention-2 at head dim 128 (forward 128 queries x 64 keys, backward
# 64 x 128); the bench mixes' ratios move by under 1.5% with 128 x 128 for both.
TILES = {"forward": (128, 64), "backward": (64, 128)}


def call_tiles(cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k):
    """Tiles a varlen call computes: per sequence, every (query block, key block) with at least
    one pair; causal calls align the last query with the last key (flash's bottom-right
    rule), so query row i sees keys < i + 1 + len_k - len_q."""
    lq = np.diff(np.asarray(cu_seqlens_q, dtype=np.int64))
    lk = np.diff(np.asarray(cu_seqlens_k, dtype=np.int64))
    keep = (lq > 0) & (lk > 0)
    lq, lk = lq[keep], lk[keep]
    blocks = -(-lq // block_q)
    if not causal:
        return int(np.sum(blocks * (-(-lk // block_k))))
    seq = np.repeat(np.arange(lq.size), blocks)
    first = np.repeat(np.cumsum(blocks) - blocks, blocks)
    block_end = np.minimum(lq[seq], (np.arange(seq.size) - first + 1) * block_q)
    keys = np.clip(block_end + lk[seq] - lq[seq], 0, lk[seq])
    return int(np.sum(-(-keys // block_k)))


def fused_forward_tiles(forward_tiles, block_k=TILES["forward"][1]):
    """Tiles the fused forward (attention/triton_forward.py) computes over a group's
    `ForwardTiles` (plan/forward_tiles.py), in query blocks of its block_m rows (a tile of
    fewer rows costs a whole block): per tile, its received keys' blocks and its local keys'
    from its first row's document start."""
    blocks = 0
    for table in (forward_tiles.local_only, forward_tiles.with_received):
        t = table.cpu().numpy().astype(np.int64)
        blocks += int(np.sum(-(-(t[:, 3] - t[:, 2]) // block_k) +
                             -(-(t[:, 1] - t[:, 4]) // block_k)))
    return blocks * forward_tiles.block_m / TILES["forward"][0]


def plan_calls(plan, exchange):
    """[the KernelCalls of one direction, per ring group] as the ring executor `exchange`
    makes them (ring.executor_for decides which runs the group)."""
    out = []
    for schedule in plan.schedules:
        calls = [schedule.local]
        if executor_for(schedule, exchange) in BATCHED:
            calls.append(schedule.batched.call if schedule.batched else None)
        else:
            calls += [step.call for step in schedule.steps]
        out.append([c for c in calls if c is not None])
    return out


def tiles_over_ideal(calls_per_rank, cu, cp, share=1, fused=None):
    """{direction: the busiest rank's tiles / (the whole row's one causal call's tiles / cp)};
    calls_per_rank: [KernelCalls] per rank, or per group of `share` ranks splitting its work
    (a hybrid ring group over its Ulysses degree); `fused`: each group's ForwardTiles where
    the forward is the fused kernel (its forward's tiles instead of the calls')."""
    out = {}
    for direction, (bq, bk) in TILES.items():
        ideal = call_tiles(cu, cu, True, bq, bk) / cp
        if fused is not None and direction == "forward":
            busiest = max(fused_forward_tiles(tiles, bk) for tiles in fused) / share
        else:
            busiest = max(sum(call_tiles(c.cu_seqlens_q.cpu().numpy(),
                                         c.cu_seqlens_k.cpu().numpy(), c.causal, bq, bk)
                              for c in calls) for calls in calls_per_rank) / share
        out[direction] = busiest / ideal
    return out
