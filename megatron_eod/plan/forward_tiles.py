"""A group's batched forward as query tiles for one fused kernel (attention/triton_forward.py).

One job: from a group's local call and its batched call over received keys (host tensors),
the list of query tiles the fused forward runs, longest first, in two launches: the tiles
whose rows need no received key (launched while the exchange is in flight) and the others.

A tile is at most `block_m` consecutive local rows, int32 (q_start, q_stop, r_start, r_stop,
l_start), and `row_start[i]` is local row i's first local row of its document. Row i
(q_start <= i < q_stop) attends to the received rows r_start:r_stop (the earlier pieces of
its document that other groups hold, all before it: no mask) and to the local rows
row_start[i]..i (its document's run of local rows up to itself: causal); the kernel reads the
local rows from l_start = row_start[q_start] on. That is all of row i's keys, so the
kernel's online softmax ends with the row's final out and lse: no merge of two calls'
results, no float32 copy of out, written once.

Which rows share a tile: a piece with received keys is cut alone (its rows share them), as
is each document of block_m rows or more needing no received key, from its first row (as a
varlen kernel cuts a sequence); consecutive shorter documents are cut together, across their
boundaries, so that they share tiles instead of each padding one to block_m rows. A tile
from document A into B reads from A's start to its last row (B's rows see only their own
keys there): at most A's length, under block_m, more than B's rows need.

Why tiles longest first: a launch's tail is its last long tiles running alone; the cost of
a tile is its keys (r_stop - r_start + q_stop - l_start) and a GPU starts programs in
launch order, so launching the longest first leaves the short ones to fill the tail. The
varlen flash kernels launch a grid of (query block, sequence, head) in that order, the
longest document's last blocks wherever the document happens to be.

What it does not do: no kernel, no device work (attention/triton_forward.py runs the tiles).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from megatron_eod.plan.kv_schedule import GroupSchedule, to_device

__all__ = ["ForwardTiles", "forward_tiles", "with_fused_tiles", "DEFAULT_BLOCK_M",
           "cut_ranges", "pack_short", "received_pieces"]

DEFAULT_BLOCK_M = 128  # query rows per tile (the fused kernel's BLOCK_M: a power of two)


class ForwardTiles(NamedTuple):
    """`local_only`, `with_received`: int32 [n, 5] tiles (q_start, q_stop, r_start, r_stop,
    l_start), each longest first;
    `row_start`: int32 [T], each local row's first local row of its document (its run);
    `block_m`: the most rows a tile has (the kernel's query block);
    `every`: both launches' tiles, longest first (the fused backward's dq runs them in one
    launch once the received keys are in)."""

    local_only: torch.Tensor
    with_received: torch.Tensor
    row_start: torch.Tensor
    block_m: int
    every: torch.Tensor

    def to(self, device) -> "ForwardTiles":
        return ForwardTiles(to_device(self.local_only, device),
                            to_device(self.with_received, device),
                            to_device(self.row_start, device), self.block_m,
                            to_device(self.every, device))


def cut_ranges(q_start: np.ndarray, q_stop: np.ndarray, block_m: int):
    """Index into the row ranges of each tile of at most block_m rows, and each tile's first
    row: (range index, tile start)."""
    count = -(-(q_stop - q_start) // block_m)
    which = np.repeat(np.arange(q_start.size), count)
    first = np.cumsum(count) - count
    offset = (np.arange(int(count.sum())) - np.repeat(first, count)) * block_m
    return which, q_start[which] + offset


def _rows_received(num_rows: int, first: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """bool [num_rows]: the rows inside one of the runs first[i]:stop[i]."""
    edges = np.zeros(num_rows + 1, np.int64)
    np.add.at(edges, first, 1)
    np.add.at(edges, stop, -1)
    return np.cumsum(edges)[:-1] > 0


def pack_short(a, b, block_m):
    """The row ranges a:b (in order) with each run of consecutive ranges shorter than block_m
    that follow each other (b[i] == a[i + 1]) merged into one: tiles then cut across the short
    documents, which share a tile instead of each padding one. Long documents keep their own
    ranges, so that their tiles start at their first row, as a varlen kernel's do (cut from
    elsewhere, each of a long document's tiles would reach its causal edge part way through
    a key block)."""
    if a.size < 2:
        return a, b
    short = (b - a) < block_m
    joins = short[1:] & short[:-1] & (a[1:] == b[:-1])
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    return a[starts], np.maximum.reduceat(b, starts)


def _table(q_start, q_stop, r_start, r_stop, row_start, block_m) -> torch.Tensor:
    """int32 [n, 5] tiles of the row ranges q_start:q_stop (keys r_start:r_stop received),
    cut in tiles of at most block_m rows, each reading local keys from its first row's
    document start (row_start), longest first."""
    which, t_start = cut_ranges(q_start, q_stop, block_m)
    table = np.stack([t_start, np.minimum(t_start + block_m, q_stop[which]), r_start[which],
                      r_stop[which], row_start[t_start] if t_start.size else t_start], axis=1)
    return _longest_first(table)


def _longest_first(table) -> torch.Tensor:
    """The tiles (int [n, 5]) as int32, by cost (their keys: received plus local), highest
    first."""
    table = np.asarray(table, dtype=np.int64).reshape(-1, 5)
    cost = (table[:, 3] - table[:, 2]) + (table[:, 1] - table[:, 4])
    table = table[np.argsort(-cost, kind="stable")]
    return torch.from_numpy(np.ascontiguousarray(table, dtype=np.int32).reshape(-1, 5))


def received_pieces(run_of_row, call_rows, call_cu_q, call_cu_k):
    """(first row, stop row, first received row, stop received row) int64 of each query
    piece of the call over received keys (none for no call); each must be a run of local
    rows inside one local sequence (run_of_row: each local row's sequence)."""
    nothing = np.zeros(0, np.int64)
    if call_rows is None or len(call_cu_q) < 2:
        return nothing, nothing, nothing, nothing
    cu_q, cu_k = np.asarray(call_cu_q, np.int64), np.asarray(call_cu_k, np.int64)
    rows = np.asarray(call_rows, np.int64)
    keep = np.diff(cu_q) > 0
    first, last = rows[cu_q[:-1][keep]], rows[cu_q[1:][keep] - 1]
    stop = first + np.diff(cu_q)[keep]
    if np.any(last != stop - 1) or np.any(run_of_row[first] != run_of_row[last]):
        raise ValueError("each query piece of the call over received keys must be a run "
                         "of local rows inside one local sequence")
    return first, stop, cu_k[:-1][keep], cu_k[1:][keep]


def forward_tiles(local_cu, call_rows=None, call_cu_q=None, call_cu_k=None,
                  block_m: int = DEFAULT_BLOCK_M) -> ForwardTiles:
    """The tiles of a group: `local_cu`, the local call's cu_seqlens (its runs of local rows,
    one per document); the batched call over received keys (None: nothing received) as its
    query rows (local rows, piece after piece), cu_seqlens_q and cu_seqlens_k (its keys are
    the receive buffer in order: piece i's are rows cu_k[i]:cu_k[i+1] of it)."""
    if not isinstance(block_m, int) or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m!r}")
    local_cu = np.asarray(local_cu, np.int64)
    num_rows = int(local_cu[-1]) if local_cu.size else 0
    run_of_row = np.repeat(np.arange(max(local_cu.size - 1, 0)), np.diff(local_cu))
    nothing = np.zeros(0, np.int64)
    first, stop, r_start, r_stop = received_pieces(run_of_row, call_rows, call_cu_q, call_cu_k)
    # The other rows: per document (cut at local runs' starts and received pieces' ends),
    # consecutive documents shorter than a tile packed together.
    received = _rows_received(num_rows, first, stop)
    change = np.flatnonzero(received[1:] != received[:-1]) + 1
    cuts = np.unique(np.concatenate([local_cu, change, [0, num_rows]]))
    a, b = cuts[:-1], cuts[1:]
    plain = ~received[a] if a.size else np.zeros(0, bool)
    a, b = pack_short(a[plain], b[plain], block_m)
    zero = np.zeros(a.size, np.int64)
    row_start = local_cu[run_of_row] if num_rows else nothing
    local_only = _table(a, b, zero, zero, row_start, block_m)
    with_received = _table(first, stop, r_start, r_stop, row_start, block_m)
    return ForwardTiles(local_only, with_received, torch.from_numpy(row_start.astype(np.int32)),
                        block_m, _longest_first(torch.cat([local_only, with_received]).numpy()))


def with_fused_tiles(schedule: GroupSchedule, block_m: int = DEFAULT_BLOCK_M,
                     key_block: int | None = None) -> GroupSchedule:
    """The schedule with its fused forward's tiles of block_m query rows and its fused
    backward's key tiles of key_block keys (plan/key_tiles.py; None: its default; index
    tensors on the host, before any `to(device)`), for a schedule that runs batched (no ring
    steps, or their batched form)."""
    from megatron_eod.plan.key_tiles import DEFAULT_BLOCK_N, key_tiles

    if schedule.steps and schedule.batched is None:
        raise ValueError("forward tiles need the batched form of the ring steps")
    call = schedule.batched.call if schedule.batched is not None else None
    args = (schedule.local.cu_seqlens_q.numpy(),
            None if call is None else call.q_index.numpy(),
            None if call is None else call.cu_seqlens_q.numpy(),
            None if call is None else call.cu_seqlens_k.numpy())
    return dataclasses.replace(schedule, forward_tiles=forward_tiles(*args, block_m),
                               key_tiles=key_tiles(*args, key_block or DEFAULT_BLOCK_N))
