"""Attention work and key/value traffic of a token placement, under a causal document mask.

One job: measure any placement of the packed stream over CP ranks (ours or the layouts other
systems use) with the same yardsticks: causal query-key pairs each rank computes, and the
key/value tokens each rank must receive from its peers. Pure numpy; no communication.

The model: a query at position p of its document attends to the p+1 keys at positions 0..p
of the same document, wherever they live. So a rank's work is the sum of (p+1) over the
queries it holds, and it needs from other ranks exactly the tokens of its documents that sit
before its last query of that document.

What it does not do: no placement (partition.py), no schedule (kv_schedule.py).
"""

from __future__ import annotations

import numpy as np

__all__ = ["doc_pairs", "range_pairs", "positions_and_docs", "pairs_per_rank",
           "kv_tokens_received_per_rank"]


def doc_pairs(lengths: np.ndarray) -> np.ndarray:
    """Causal pairs of whole documents: L(L+1)/2 each."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths * (lengths + 1) // 2


def range_pairs(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Causal pairs of queries at document positions [start, end): (e(e+1) - s(s+1)) / 2."""
    start, end = np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64)
    return (end * (end + 1) - start * (start + 1)) // 2


def positions_and_docs(cu_seqlens: np.ndarray):
    """Per token of the stream: its position in its document and its document index."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    doc = np.repeat(np.arange(lengths.size), lengths)
    pos = np.arange(cu[-1]) - cu[:-1][doc]
    return pos, doc


def pairs_per_rank(cu_seqlens: np.ndarray, owner: np.ndarray, world: int) -> np.ndarray:
    """Causal pairs computed by each rank when `owner[i]` holds the query of token i."""
    pos, _ = positions_and_docs(cu_seqlens)
    return np.bincount(np.asarray(owner), weights=pos + 1, minlength=world).astype(np.int64)


def kv_tokens_received_per_rank(cu_seqlens: np.ndarray, owner: np.ndarray,
                                world: int) -> np.ndarray:
    """Key/value tokens each rank needs from other ranks (each token counted once per rank)."""
    pos, doc = positions_and_docs(cu_seqlens)
    owner = np.asarray(owner, dtype=np.int64)
    n_docs = int(doc.max()) + 1 if doc.size else 0
    # Last query position of every (rank, document); -1 where the rank holds none of it.
    last = np.full((world, n_docs), -1, dtype=np.int64)
    np.maximum.at(last, (owner, doc), pos)
    received = np.zeros(world, dtype=np.int64)
    for rank in range(world):
        needed = (last[rank, doc] > pos) & (owner != rank)
        received[rank] = int(needed.sum())
    return received
