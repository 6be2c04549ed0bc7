"""Place the documents of a packed stream on CP groups: equal tokens, equal attention work.

One job: given document lengths and the number of groups R (CP ranks for Ring; Ulysses groups
for Hybrid), choose which token ranges ("pieces") each group holds so that every group holds
exactly N/R tokens and (nearly) the same number of causal query-key pairs, while short
documents stay whole, no document is padded, and few tokens must travel between groups.
Deterministic, numpy only, O(n_docs * R + N) host work.

A query at position p of its document costs p + 1 pairs wherever its keys live, so a group's
work is a sum over the tokens it holds; the head of a document is cheap, its tail expensive.

1. Long documents (longer than N/R, or more than `LONG_WORK_FRACTION` of a group's pairs) are
   zigzagged over the fewest groups that can take them (2m equal chunks; group i of m holds
   chunks i and 2m-1-i, which carry equal work), the least loaded groups first.
2. Whole documents go greedily, most work first, to the group whose larger of (work, tokens)
   relative to its share stays smallest.
3. Whole documents move or swap between groups while that shrinks the worst group's
   (tokens, work) error (`_refine`).
4. balance.py makes token counts exact and work equal by cutting a few pieces (`chain`,
   `repair`), preferring cuts that make few key/value tokens travel.

What it does not do: no key/value schedule (kv_schedule.py), no padding ever.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_eod.plan.balance import GroupLoads, NoCandidate, chain, kv_per_group, repair
from megatron_eod.plan.cost import doc_pairs

__all__ = ["Pieces", "partition_documents", "LONG_WORK_FRACTION"]

LONG_WORK_FRACTION = 0.8  # a document with more of a group's pairs than this is zigzagged
M_WORK_FRACTION = 0.9  # ... over m groups, m the fewest that keep its share per group below this


@dataclass(frozen=True)
class Pieces:
    """Contiguous token ranges of the stream, each inside one document, in local order.

    start/end: int64 [P], stream offsets [start, end); doc: int64 [P]; group: int64 [P].
    Pieces are sorted by group; within a group their order is the group's local token order
    (by stream offset, so a document's earlier pieces come first).
    """

    start: np.ndarray
    end: np.ndarray
    doc: np.ndarray
    group: np.ndarray

    def token_index(self, group: int) -> np.ndarray:
        """Stream offsets of the tokens `group` holds, in local order."""
        mine = self.group == group
        return ranges(self.start[mine], self.end[mine])


def ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, e) for every (s, e), vectorised."""
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    lengths = ends - starts
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + offsets


def _zigzag_long(doc, cu, m, groups_order, state):
    start, length = int(cu[doc]), int(cu[doc + 1] - cu[doc])
    edges = np.linspace(0, length, 2 * m + 1).round().astype(np.int64)
    for i, g in enumerate(groups_order[:m]):
        for c in (i, 2 * m - 1 - i):
            if edges[c + 1] > edges[c]:
                state.give(g, start + edges[c], start + edges[c + 1], doc, start)


def _refine(state, lengths, pairs, groups, tokens_share, share, rounds=200):
    """Move or swap whole documents between groups while that shrinks the worst group's
    (token, work) error; leaves the chain small token excesses to cut."""
    tok_scale, work_scale = float(tokens_share), float(share)

    def cost(dt, dw):  # token errors matter less: the chain absorbs them, work it cannot
        return (dt / tok_scale) ** 2 * 0.05 + (dw / work_scale) ** 2

    for _ in range(rounds):
        dt = state.tokens - tokens_share
        dw = state.work - share
        errors = cost(dt, dw)
        a = int(np.argmax(errors))
        base = errors.sum()
        best = (0.0, None)
        xs = np.array(state.whole[a], dtype=np.int64)
        if xs.size == 0:
            break
        for b in range(groups):
            if b == a:
                continue
            ys = np.array(state.whole[b] + [-1], dtype=np.int64)  # -1: a move, not a swap
            lx, px = lengths[xs][:, None], pairs[xs][:, None].astype(float)
            ly = np.where(ys >= 0, lengths[ys], 0)[None, :]
            py = np.where(ys >= 0, pairs[ys], 0)[None, :].astype(float)
            new = (cost(dt[a] - lx + ly, dw[a] - px + py) + cost(dt[b] + lx - ly, dw[b] + px - py)
                   - errors[a] - errors[b])
            i, j = np.unravel_index(np.argmin(new), new.shape)
            if new[i, j] < best[0] - 1e-12 * base:
                best = (new[i, j], (b, int(xs[i]), int(ys[j])))
        if best[1] is None:
            break
        b, x, y = best[1]
        _move_whole(state, x, a, b, lengths, pairs)
        if y >= 0:
            _move_whole(state, y, b, a, lengths, pairs)


def _move_whole(state, doc, src, dst, lengths, pairs):
    state.whole[src].remove(doc)
    state.whole[dst].append(doc)
    state.tokens[src] -= lengths[doc]
    state.tokens[dst] += lengths[doc]
    state.work[src] -= pairs[doc]
    state.work[dst] += pairs[doc]
    state.pieces = [(s, e, d, dst if d == doc else g) for s, e, d, g in state.pieces]


def partition_documents(cu_seqlens, groups: int) -> Pieces:
    """Pieces for `groups` groups over the stream described by `cu_seqlens` (see module)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    n_docs = lengths.size
    if groups == 1:
        return Pieces(cu[:-1].copy(), cu[1:].copy(), np.arange(n_docs), np.zeros(n_docs, int))
    tokens_share = int(cu[-1]) // groups
    pairs = doc_pairs(lengths)
    share = pairs.sum() / groups
    long_docs = (lengths > tokens_share) | (pairs > LONG_WORK_FRACTION * share)
    extra_long = set()
    while True:
        state = GroupLoads(groups)
        is_long = long_docs.copy()
        is_long[list(extra_long)] = True
        for d in sorted(np.flatnonzero(is_long), key=lambda d: -pairs[d]):
            m = max(2, int(np.ceil(lengths[d] / tokens_share)),
                    int(np.ceil(pairs[d] / (M_WORK_FRACTION * share))))
            m = min(m, groups)
            # The m least-loaded groups; within them, the one receiving least so far takes
            # the outermost chunks (it will need the most keys: (2m-2) of 2m chunks).
            chosen = np.lexsort((np.arange(groups), state.work))[:m]
            received = kv_per_group(state, cu, groups)
            roles = sorted(chosen, key=lambda g: (received[g], state.work[g], g))
            _zigzag_long(d, cu, m, roles, state)
        for d in sorted(np.flatnonzero(~is_long), key=lambda d: (-pairs[d], d)):
            load = np.maximum((state.work + pairs[d]) / share,
                              (state.tokens + lengths[d]) / tokens_share)
            g = int(np.argmin(load))
            state.give(g, int(cu[d]), int(cu[d + 1]), int(d), int(cu[d]))
            state.whole[g].append(int(d))
        _refine(state, lengths, pairs, groups, tokens_share, share)
        try:
            chain(cu, state, groups, share)
            repair(cu, state, groups, share)
            break
        except NoCandidate:
            # No whole document of that group can be cut to move the excess: zigzag its
            # largest whole document as well and start again (rare; tiny streams).
            whole = [d for d in np.flatnonzero(~is_long)]
            if not whole:
                raise AssertionError("partition: no document left to cut") from None
            extra_long.add(int(max(whole, key=lambda d: lengths[d])))
    return _merged(state.pieces)


def _merged(pieces) -> Pieces:
    """Sort by (group, start) and join touching pieces of one document in one group."""
    out = []
    for s, e, d, g in sorted(pieces, key=lambda p: (p[3], p[0])):
        if out and out[-1][3] == g and out[-1][2] == d and out[-1][1] == s:
            out[-1][1] = e
        else:
            out.append([s, e, d, g])
    arr = np.array(out, dtype=np.int64).reshape(-1, 4)
    return Pieces(start=arr[:, 0], end=arr[:, 1], doc=arr[:, 2], group=arr[:, 3])
