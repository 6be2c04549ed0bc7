"""tools/tile_model.py: the flash tile count of a varlen call, against a dense mask."""

import os
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import tile_model  # noqa: E402


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=5),
       st.booleans(), st.sampled_from([(128, 64), (64, 128), (16, 32), (1, 1)]))
def test_call_tiles_counts_the_tiles_holding_a_pair(lengths, causal, blocks):
    """The tile model against a dense mask: a (block_q x block_k) tile counts when one of its
    (query, key) pairs is computed; causal pairs are bottom-right aligned (flash's rule)."""
    bq, bk = blocks
    expected = 0
    for lq, lk in lengths:
        if not lq or not lk:
            continue
        mask = np.ones((lq, lk), dtype=bool)
        if causal:
            mask = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq)
        pad = np.zeros((-(-lq // bq) * bq, -(-lk // bk) * bk), dtype=bool)
        pad[:lq, :lk] = mask
        expected += int(pad.reshape(pad.shape[0] // bq, bq, -1, bk).any(axis=(1, 3)).sum())
    cu_q = np.concatenate([[0], np.cumsum([lq for lq, _ in lengths])])
    cu_k = np.concatenate([[0], np.cumsum([lk for _, lk in lengths])])
    assert tile_model.call_tiles(cu_q, cu_k, causal, bq, bk) == expected


def test_fused_forward_tiles_count_each_tiles_key_blocks():
    """The fused forward's tiles (plan/forward_tiles.py): per tile, its received keys' blocks
    and its local keys' from its first row's document start, in block_m-row units over the
    flash forward's 128-row blocks. A 200-row document over one group: tiles 0:128 (2 key
    blocks of 64) and 128:200 (keys 0:200, 4 blocks); with 7 received rows before 10:25 of
    another document: 1 + 1 blocks more at 16-row tiles."""
    from megatron_eod.plan.forward_tiles import forward_tiles

    assert tile_model.fused_forward_tiles(forward_tiles(np.array([0, 200]))) == 6
    tiles = forward_tiles(np.array([0, 10, 40]), np.arange(10, 25), np.array([0, 15]),
                          np.array([0, 7]), block_m=16)
    # local-only 0:10 (1 block), 25:40 (keys 10:40, 1 block); the piece 10:25: 1 + 1
    assert tile_model.fused_forward_tiles(tiles) == 4 * 16 / 128
