"""A group's batched backward's key tiles, for the fused backward's dk/dv kernel.

One job: from a group's local call and its batched call over received keys (host tensors),
the key tiles whose key and value gradients one program each computes
(attention/triton_backward.py), every key row in one tile, longest first: int32
(k_start, k_stop, q_start, q_stop).
* `local`: at most `block_n` local rows, cut per document from its first row, consecutive
  short documents together (as the forward's query tiles, plan/forward_tiles.py); the rows
  that see them are q_start:q_stop = from the first key to the end of the last key's
  document, each row seeing its own document's keys up to itself (forward_tiles.row_start).
* `received`: at most `block_n` rows of the receive buffer, inside one query piece's received
  rows (each received row has that one reader, kv_batched.py), seen by all of the piece's
  rows q_start:q_stop.
The cost of a tile is its query rows (q_stop - q_start).

What it does not do: no kernel, no device work.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from megatron_eod.plan.forward_tiles import cut_ranges, pack_short, received_pieces
from megatron_eod.plan.kv_schedule import to_device

__all__ = ["KeyTiles", "key_tiles", "DEFAULT_BLOCK_N"]

DEFAULT_BLOCK_N = 64  # key rows per tile (the dk/dv kernel's BLOCK_N: a power of two)


class KeyTiles(NamedTuple):
    """`local`, `received`: int32 [n, 4] key tiles (k_start, k_stop, q_start, q_stop),
    each longest first; `block_n`: the most keys a tile has."""

    local: torch.Tensor
    received: torch.Tensor
    block_n: int

    def to(self, device) -> "KeyTiles":
        return KeyTiles(to_device(self.local, device), to_device(self.received, device),
                        self.block_n)


def _table(k_start, k_stop, q_start, q_stop, block_n) -> torch.Tensor:
    """The key ranges k_start:k_stop (their readers q_start:q_stop per range, or per key
    when q_stop is a function of the tile's last key) cut in tiles of at most block_n keys,
    longest first."""
    which, t_start = cut_ranges(k_start, k_stop, block_n)
    t_stop = np.minimum(t_start + block_n, k_stop[which])
    readers = q_stop(t_stop) if callable(q_stop) else q_stop[which]
    first = t_start if q_start is None else q_start[which]
    table = np.stack([t_start, t_stop, first, readers], axis=1)
    table = table[np.argsort(-(table[:, 3] - table[:, 2]), kind="stable")]
    return torch.from_numpy(np.ascontiguousarray(table, dtype=np.int32).reshape(-1, 4))


def key_tiles(local_cu, call_rows=None, call_cu_q=None, call_cu_k=None,
              block_n: int = DEFAULT_BLOCK_N) -> KeyTiles:
    """The key tiles of a group (arguments as plan/forward_tiles.forward_tiles')."""
    if not isinstance(block_n, int) or block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two, got {block_n!r}")
    local_cu = np.asarray(local_cu, np.int64)
    run_of_row = np.repeat(np.arange(max(local_cu.size - 1, 0)), np.diff(local_cu))
    run_end = local_cu[1:][run_of_row] if run_of_row.size else np.zeros(0, np.int64)
    a, b = local_cu[:-1], local_cu[1:]
    a, b = pack_short(a[b > a], b[b > a], block_n)
    local = _table(a, b, None, lambda stop: run_end[stop - 1], block_n)
    first, stop, r_start, r_stop = received_pieces(run_of_row, call_rows, call_cu_q, call_cu_k)
    return KeyTiles(local, _table(r_start, r_stop, first, stop, block_n), block_n)
