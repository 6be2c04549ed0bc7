"""Attention work and key/value traffic of a placement, and the balance bound: in one place.

One job: measure any placement of the packed stream over CP groups (ours, or the layouts
other systems use, given as a token -> rank map) with the same yardsticks, and state the one
balance bound the planner promises and the tests and benchmarks assert.

The model: a query at position p of its document attends to the p + 1 keys at positions
0..p of the same document, wherever they live. So a group's work is the sum of (p + 1) over
the queries it holds (positions [a, b) of one document: (b(b+1) - a(a+1)) / 2 pairs), and it
needs from other groups exactly the tokens of its documents that sit before its last query of
that document. Pure numpy, O(P log P) in the number of pieces; no dense (group x document)
table.

What it does not do: no placement (partition.py), no schedule (kv_schedule.py).
"""

from __future__ import annotations

import numpy as np

from megatron_eod.plan.pieces import Pieces

__all__ = ["BALANCE_TOLERANCE", "balance_bound", "doc_pairs", "range_pairs", "group_pairs",
           "group_kv_received", "pieces_from_owner", "pairs_per_rank",
           "kv_tokens_received_per_rank"]

# The planner's promise, asserted by tests/plan and tools/bench_cp.py: the busiest group
# computes at most (1 + BALANCE_TOLERANCE) times the mean pairs, plus the granularity term
# of `balance_bound` that only matters for tiny streams.
BALANCE_TOLERANCE = 0.01
# Exact token counts make some imbalance unavoidable at small sizes (one 2-token document on
# 2 ranks: 1 and 2 pairs). The planner's per-group error is at most a couple of tokens of
# the longest document, each costing at most its length in pairs.
GRANULARITY_TOKENS = 2


def balance_bound(mean_pairs: float, longest_document: int) -> float:
    """The most pairs the busiest group may compute: see BALANCE_TOLERANCE."""
    return mean_pairs * (1 + BALANCE_TOLERANCE) + GRANULARITY_TOKENS * longest_document


def doc_pairs(lengths: np.ndarray) -> np.ndarray:
    """Causal pairs of whole documents: L(L+1)/2 each."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths * (lengths + 1) // 2


def range_pairs(start, end):
    """Causal pairs of queries at document positions [start, end): (e(e+1) - s(s+1)) / 2.
    Works on numpy arrays and on Python ints (exact, no overflow)."""
    if isinstance(start, (int, np.integer)) and isinstance(end, (int, np.integer)):
        start, end = int(start), int(end)
        return (end * (end + 1) - start * (start + 1)) // 2
    start, end = np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64)
    return (end * (end + 1) - start * (start + 1)) // 2


def group_pairs(pieces: Pieces) -> np.ndarray:
    """int64 [groups]: causal query-key pairs of every group's queries."""
    pairs = range_pairs(pieces.start - pieces.doc_start, pieces.end - pieces.doc_start)
    return _sum_by(pieces.group, pairs, pieces.groups)


def group_kv_received(pieces: Pieces) -> np.ndarray:
    """int64 [groups]: key/value tokens each group needs from other groups (each once)."""
    split = pieces.split_order()  # pieces of documents held by several groups, in order
    doc, group, length = pieces.doc[split], pieces.group[split], pieces.length[split]
    if doc.size == 0:
        return np.zeros(pieces.groups, dtype=np.int64)
    # Tokens of the document up to and including each piece (pieces of a document are
    # disjoint, so start order is end order).
    through = np.cumsum(length)
    first = np.concatenate([[True], doc[1:] != doc[:-1]])
    through -= np.maximum.accumulate(np.where(first, through - length, 0))
    # Per (document, group): tokens up to its last piece, minus its own tokens.
    keys, inverse = np.unique(doc * pieces.groups + group, return_inverse=True)
    last_through = np.zeros(keys.size, dtype=np.int64)
    np.maximum.at(last_through, inverse, through)
    own = np.bincount(inverse, weights=length, minlength=keys.size).astype(np.int64)
    return _sum_by(keys % pieces.groups, last_through - own, pieces.groups)


def pieces_from_owner(cu_seqlens, owner, groups: int) -> Pieces:
    """The pieces of a token -> group map (runs of one group inside one document)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    owner = np.asarray(owner, dtype=np.int64)
    n = int(cu[-1])
    doc = np.repeat(np.arange(cu.size - 1), np.diff(cu))
    new = np.ones(n, dtype=bool)
    new[1:] = (owner[1:] != owner[:-1]) | (doc[1:] != doc[:-1])
    starts = np.flatnonzero(new)
    ends = np.concatenate([starts[1:], [n]])
    return Pieces.build(starts, ends, doc[starts], owner[starts], cu, groups)


def pairs_per_rank(cu_seqlens, owner, world: int) -> np.ndarray:
    """Causal pairs computed by each rank when `owner[i]` holds the query of token i."""
    return group_pairs(pieces_from_owner(cu_seqlens, owner, world))


def kv_tokens_received_per_rank(cu_seqlens, owner, world: int) -> np.ndarray:
    """Key/value tokens each rank needs from other ranks (each token counted once per rank)."""
    return group_kv_received(pieces_from_owner(cu_seqlens, owner, world))


def _sum_by(index, values, size) -> np.ndarray:
    out = np.zeros(size, dtype=np.int64)
    np.add.at(out, index, values)
    return out
