"""Whole-document packing: the planner's low-traffic candidate.

One job: place most documents whole, so that few key/value tokens travel, and still give
every group exactly N/R tokens and its share W of pairs. It may fail (returns None) or land
off balance; partition.py keeps it only when it is within its acceptance and moves less than
the other candidates, and the sweep (sweep.py) is always there to fall back on.

1. Long documents (longer than a share of tokens, or more than LONG_WORK of a share of pairs)
   are zigzagged over the fewest groups that can take them (2m equal chunks, group i of m
   holds chunks i and 2m-1-i, which carry equal pairs), on the groups with the least work so
   far; the one that receives least so far takes the outer chunks (it needs the most keys).
2. The filler: the shortest other documents holding `filler_fraction` of the tokens. Their
   density rho (pairs per token) prices every document: lambda = pairs - rho * tokens is the
   work a document brings beyond filler of its size. A group whose lambda is the target
   lambda* = W - rho * N/R can be finished exactly by filler of average density.
3. Medium documents, by lambda descending, go whole to the group with the least lambda that
   stays at or below lambda* and within its token cap; those that fit nowhere join the pool.
4. Moves and swaps of whole documents between the groups furthest above and below lambda*.
5. The pool (filler and left-over documents) is swept into every group's remaining tokens
   with cumulative pair targets (`sweep.DocumentSweep`), groups needing the sparsest pool
   first; only pool documents are ever cut, at most one at each end per group.

Host work: O(n_docs log n_docs + medium documents x R + R^2 x 48^2); partition.py runs it
only on inputs where that is small. Deterministic: every rank computes the same pieces.

What it does not do: no balance promise (partition.py checks it), no schedule.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np

from megatron_eod.plan.cost import doc_pairs, range_pairs
from megatron_eod.plan.pieces import Pieces
from megatron_eod.plan.sweep import DocumentSweep, swept_pieces

__all__ = ["pack_documents", "LONG_WORK"]

LONG_WORK = 0.8  # a document with more than this share of a group's pairs is zigzagged
SWAP_CANDIDATES = 48  # documents per group a refinement step looks at (largest |lambda|)


class _Groups:
    """Running tokens, pairs and lambda of every group, and who holds which whole document."""

    def __init__(self, groups: int, rho: float):
        self.tokens = np.zeros(groups, dtype=np.int64)
        self.work = np.zeros(groups, dtype=np.int64)
        self.rho = rho
        self.received = np.zeros(groups, dtype=np.int64)  # keys the long chunks need

    @property
    def lam(self) -> np.ndarray:
        return self.work - self.rho * self.tokens

    def add(self, group: int, tokens: int, work: int) -> None:
        self.tokens[group] += tokens
        self.work[group] += work


def _zigzag_long(long_docs, lengths, work, cu, state: _Groups, cap: float, share: float,
                 spread: float) -> Optional[List[Tuple[int, int, int, int]]]:
    """Chunks (start, end, doc, group) of the long documents, or None if one cannot fit."""
    groups = state.tokens.size
    out = []
    for d in sorted(long_docs, key=lambda d: (-work[d], d)):
        m = min(groups, max(math.ceil(lengths[d] / cap), math.ceil(work[d] / (spread * share))))
        chosen = np.lexsort((np.arange(groups), state.lam))[:m]
        roles = sorted(chosen.tolist(), key=lambda g: (state.received[g], state.work[g], g))
        edges = np.linspace(0, lengths[d], 2 * m + 1).round().astype(np.int64)
        for i, g in enumerate(roles):
            for c in (i, 2 * m - 1 - i):
                a, b = int(edges[c]), int(edges[c + 1])
                if b > a:
                    out.append((int(cu[d]) + a, int(cu[d]) + b, int(d), g))
                    state.add(g, b - a, range_pairs(a, b))
            held = int(edges[i + 1] - edges[i] + edges[2 * m - i] - edges[2 * m - 1 - i])
            state.received[g] += int(edges[2 * m - i]) - held
        if state.tokens.max() > cap:
            return None
    return out


def _place_medium(medium, lengths, work, lam_doc, state: _Groups, cap: float, target: float):
    """Whole documents by lambda descending onto the least-lambda group that stays at or
    below the target; -> owner per medium document (-1: left to the pool)."""
    owner = np.full(medium.size, -1, dtype=np.int64)
    lam = state.lam
    for i in np.argsort(-lam_doc[medium], kind="stable"):
        d = medium[i]
        ok = (state.tokens + lengths[d] <= cap) & (lam + lam_doc[d] <= target)
        if ok.any():
            g = int(np.argmin(np.where(ok, lam, np.inf)))
            owner[i] = g
            state.add(g, int(lengths[d]), int(work[d]))
            lam[g] += lam_doc[d]
    return owner


def _refine(medium, owner, lengths, work, lam_doc, state: _Groups, cap: float,
            target: float, tolerance: float) -> None:
    """Moves and swaps between the groups furthest above and below the target lambda."""
    groups = state.tokens.size
    for _ in range(4 * groups):
        dev = state.lam - target
        a, b = int(np.argmax(dev)), int(np.argmin(dev))
        if dev[a] - dev[b] <= tolerance:
            return
        xa, xb = np.flatnonzero(owner == a), np.flatnonzero(owner == b)
        xa = xa[np.argsort(-np.abs(lam_doc[medium[xa]]), kind="stable")[:SWAP_CANDIDATES]]
        xb = xb[np.argsort(-np.abs(lam_doc[medium[xb]]), kind="stable")[:SWAP_CANDIDATES]]
        # Row/column "none" (the last) turns a swap into a move.
        la = np.append(lam_doc[medium[xa]], 0.0)[:, None]
        lb = np.append(lam_doc[medium[xb]], 0.0)[None, :]
        ta = np.append(lengths[medium[xa]], 0)[:, None]
        tb = np.append(lengths[medium[xb]], 0)[None, :]
        ok = (state.tokens[a] - ta + tb <= cap) & (state.tokens[b] + ta - tb <= cap)
        score = np.where(ok, np.maximum(np.abs(dev[a] - la + lb), np.abs(dev[b] + la - lb)),
                         np.inf)
        i, j = np.unravel_index(np.argmin(score), score.shape)
        if not score[i, j] < max(abs(dev[a]), abs(dev[b])):
            return  # no move or swap of these two groups improves the worse of them
        for index, src, dst in ((xa, a, b), (xb, b, a)):
            k = i if src == a else j
            if k < index.size:
                d = medium[index[k]]
                owner[index[k]] = dst
                state.add(src, -int(lengths[d]), -int(work[d]))
                state.add(dst, int(lengths[d]), int(work[d]))


def pack_documents(cu_seqlens, groups: int, spread: float = 0.9,
                   filler_fraction: float = 0.1) -> Optional[Pieces]:
    """Pieces with most documents whole, or None (see the module). `spread`: a long document
    gives each of its groups at most this share of a group's pairs; `filler_fraction`: the
    share of all tokens that the shortest documents form the filler with."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    work = doc_pairs(lengths)
    n, total = int(cu[-1]), int(work.sum())
    share_tokens, share = n // groups, total / groups
    long_mask = (lengths > share_tokens) | (work > LONG_WORK * share)
    rest = np.flatnonzero(~long_mask)
    rest = rest[np.argsort(lengths[rest], kind="stable")]
    n_filler = int(np.searchsorted(np.cumsum(lengths[rest]), filler_fraction * n, "right"))
    filler, medium = rest[:n_filler], rest[n_filler:]
    filler_tokens = int(lengths[filler].sum())
    if filler_tokens == 0:
        return None  # nothing to finish the groups exactly with
    rho = int(work[filler].sum()) / filler_tokens
    cap = share_tokens - 0.25 * filler_tokens / groups  # room left for filler in every group
    state = _Groups(groups, rho)
    chunks = _zigzag_long(np.flatnonzero(long_mask), lengths, work, cu, state, cap, share,
                          spread)
    if chunks is None:
        return None
    target = share - rho * share_tokens  # lambda*
    lam_doc = work - rho * lengths
    owner = _place_medium(medium, lengths, work, lam_doc, state, cap, target)
    _refine(medium, owner, lengths, work, lam_doc, state, cap, target, 1e-3 * share)
    placed = owner >= 0
    pool = np.concatenate([filler, medium[~placed]])
    sweep = DocumentSweep(lengths[pool], head_cut_below=max(1, share_tokens // 8))
    parts: List[list] = [[] for _ in range(groups)]
    wholes: List[list] = [[] for _ in range(groups)]
    # Groups needing the sparsest pool first; cumulative targets carry each group's error on.
    room = share_tokens - state.tokens
    order = np.argsort((share - state.work) / np.maximum(1, room), kind="stable")
    needed = done = 0.0
    for k, g in enumerate(order.tolist()):
        needed += share - state.work[g]
        done += sweep.fill(int(room[g]), needed - done, k == groups - 1, parts[g], wholes[g])
    swept = swept_pieces(cu, pool[sweep.order], parts, wholes, groups)
    whole = medium[placed]
    starts = [np.array([c[0] for c in chunks], np.int64), cu[whole], swept.start]
    ends = [np.array([c[1] for c in chunks], np.int64), cu[whole + 1], swept.end]
    docs = [np.array([c[2] for c in chunks], np.int64), whole, swept.doc]
    owners = [np.array([c[3] for c in chunks], np.int64), owner[placed], swept.group]
    return Pieces.build(np.concatenate(starts), np.concatenate(ends), np.concatenate(docs),
                        np.concatenate(owners), cu, groups)
