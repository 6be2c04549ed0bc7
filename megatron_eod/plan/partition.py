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
3. Exact token counts by a chain over the groups: group g passes its token excess k to group
   g+1 (or takes a deficit from it) by cutting ONE whole document in two. Which document, and
   whether the head or the tail piece moves, is chosen so that the work that moves brings g to
   its share: a head piece of k tokens always carries k(k+1)/2 pairs, a tail piece of a
   document of length L carries k(2L-k+1)/2, so the document length tunes the work moved.
   Between two choices that balance equally well, the one that makes fewer key/value tokens
   travel wins. The last group receives what is left, which the chain has balanced.

What it does not do: no key/value schedule (kv_schedule.py), no padding ever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

from megatron_eod.plan.cost import doc_pairs

__all__ = ["Pieces", "partition_documents", "LONG_WORK_FRACTION"]

LONG_WORK_FRACTION = 0.8  # a document with more of a group's pairs than this is zigzagged
CHAIN_SLACK = 0.002  # the chain may leave this share of a group's pairs for the repair to fix


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


class _Groups:
    """Running token and pair totals of every group, and the pieces given so far."""

    def __init__(self, groups: int):
        self.tokens = np.zeros(groups, dtype=np.int64)
        self.work = np.zeros(groups, dtype=np.float64)
        self.pieces: List[Tuple[int, int, int, int]] = []  # (start, end, doc, group)
        self.whole: Dict[int, List[int]] = {g: [] for g in range(groups)}

    def give(self, group, start, end, doc, doc_start):
        a, b = start - doc_start, end - doc_start
        self.tokens[group] += end - start
        self.work[group] += (b * (b + 1) - a * (a + 1)) // 2
        self.pieces.append((start, end, doc, group))


def _zigzag_long(doc, cu, m, groups_order, state):
    start, length = int(cu[doc]), int(cu[doc + 1] - cu[doc])
    edges = np.linspace(0, length, 2 * m + 1).round().astype(np.int64)
    for i, g in enumerate(groups_order[:m]):
        for c in (i, 2 * m - 1 - i):
            if edges[c + 1] > edges[c]:
                state.give(g, start + edges[c], start + edges[c + 1], doc, start)


def _part_work(a, b, x, head):
    """Pairs of the first (head) or last (tail) x tokens of piece [a, b) of a document."""
    return x * (2 * a + x + 1) / 2 if head else x * (2 * b - x + 1) / 2


def _options(state, cu, group, k):
    """(piece index, moves head?, a, b) for every piece of `group` that can give k tokens."""
    out = []
    for i, (s, e, doc, g) in enumerate(state.pieces):
        if g == group and e - s > k:
            for head in (True, False):
                out.append((i, head, s - int(cu[doc]), e - int(cu[doc])))
    return out


def _best_single(state, cu, giver, k, want, slack=0.0):
    best = None
    for i, head, a, b in _options(state, cu, giver, k):
        err = abs(_part_work(a, b, k, head) - want)
        key = (err if err > slack else 0.0, _move_traffic(a, b, k, head), err)
        if best is None or key < best[0]:
            best = (key, [(i, head, k)])
    return best


def _move_traffic(a, b, x, head):
    """Key/value tokens a cut makes travel (estimate used for ranking): a moved head is needed
    by the keeper of the rest (x); a moved tail needs what precedes it in its document."""
    return x if head else b - x


def _best_exchange(state, cu, g, k, want, limit=6, other=None, slack=0.0):
    """g gives x tokens of one piece to `other` (default g+1) and takes x - k of one of
    other's pieces; x is free, so the work moved can be tuned at a fixed token count.
    Among choices within `slack` pairs of the best balance, the least traffic wins."""
    other = g + 1 if other is None else other

    def largest(group):
        opts = _options(state, cu, group, 0)
        return sorted(opts, key=lambda o: o[2] - o[3])[: 2 * limit]

    best = None
    for i, hi, ai, bi in largest(g):
        for j, hj, aj, bj in largest(other):
            lo_x, hi_x = max(1, k + 1), min(bi - ai - 1, bj - aj - 1 + k)
            if hi_x < lo_x:
                continue
            x = np.arange(lo_x, hi_x + 1, dtype=np.float64)
            net = _part_work(ai, bi, x, hi) - _part_work(aj, bj, x - k, hj)
            err = np.abs(net - want)
            traffic = _move_traffic(ai, bi, x, hi) + _move_traffic(aj, bj, x - k, hj)
            ok = err <= err.min() + slack
            m = int(np.flatnonzero(ok)[np.argmin(traffic[ok])])
            key = (float(err[m]) if err[m] > slack else 0.0, float(traffic[m]), float(err[m]))
            if best is None or key < best[0]:
                best = (key, [(i, hi, int(x[m])), (j, hj, int(x[m]) - k)])
    return best


def _cut(state, cu, index, head, count, taker):
    s, e, doc, giver = state.pieces[index]
    cut = s + count if head else e - count
    moved, kept = ((s, cut), (cut, e)) if head else ((cut, e), (s, cut))
    if doc in state.whole[giver]:
        state.whole[giver].remove(doc)
    doc_start = int(cu[doc])
    sa, sb = s - doc_start, e - doc_start
    state.tokens[giver] -= e - s
    state.work[giver] -= (sb * (sb + 1) - sa * (sa + 1)) // 2
    state.pieces[index] = None
    state.give(giver, kept[0], kept[1], doc, doc_start)
    state.give(taker, moved[0], moved[1], doc, doc_start)


def _repair(cu, state, groups, share, tolerance=2e-3, rounds=None):
    """Token-neutral exchanges from the busiest to the idlest group until balanced."""
    for _ in range(rounds or 4 * groups):
        a, b = int(np.argmax(state.work)), int(np.argmin(state.work))
        want = min(state.work[a] - share, share - state.work[b])
        if max(state.work[a] - share, share - state.work[b]) <= tolerance * share:
            return
        best = _best_exchange(state, cu, a, 0, want, other=b, slack=tolerance * share)
        if best is None or best[0][2] >= want:
            return  # no exchange improves on doing nothing
        (i, hi, x), (j, hj, y) = best[1]
        _cut(state, cu, i, hi, x, b)
        _cut(state, cu, j, hj, y, a)
        state.pieces = [p for p in state.pieces if p is not None and p[1] > p[0]]


def _chain(cu, state, groups, share, tolerance=2e-3):
    tokens_share = int(cu[-1]) // groups
    for g in range(groups - 1):
        k = int(state.tokens[g] - tokens_share)
        want = state.work[g] - share  # pairs g should hand to g+1 (negative: receive)
        if k == 0 and abs(want) <= tolerance * share:
            continue
        while k != 0:
            # No piece long enough to cut k tokens from: hand over the longest one whole.
            giver, taker = (g, g + 1) if k > 0 else (g + 1, g)
            mine = [i for i, p in enumerate(state.pieces) if p[3] == giver]
            longest = max(mine, key=lambda i: state.pieces[i][1] - state.pieces[i][0])
            size = state.pieces[longest][1] - state.pieces[longest][0]
            if size > abs(k):
                break
            _cut(state, cu, longest, True, size, taker)
            state.pieces = [p for p in state.pieces if p is not None and p[1] > p[0]]
            k = int(state.tokens[g] - tokens_share)
            want = state.work[g] - share
        best = None
        if k != 0:
            giver = g if k > 0 else g + 1
            best = _best_single(state, cu, giver, abs(k), want if k > 0 else -want,
                                slack=CHAIN_SLACK * share)
        if best is None or best[0][2] > CHAIN_SLACK * share:
            exchange = _best_exchange(state, cu, g, k, want, slack=CHAIN_SLACK * share)
            if exchange is not None and (best is None or exchange[0][0] < best[0][0]):
                best = exchange
        if best is None:
            raise _NoCandidate(g)
        moves = best[1]
        if len(moves) == 1:
            i, head, count = moves[0]
            _cut(state, cu, i, head, count, g + 1 if k > 0 else g)
        else:
            (i, hi, x), (j, hj, y) = moves
            _cut(state, cu, i, hi, x, g + 1)
            if y > 0:
                _cut(state, cu, j, hj, y, g)
        state.pieces = [p for p in state.pieces if p is not None]


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


class _NoCandidate(Exception):
    def __init__(self, group):
        super().__init__(group)
        self.group = group


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
        state = _Groups(groups)
        is_long = long_docs.copy()
        is_long[list(extra_long)] = True
        for d in sorted(np.flatnonzero(is_long), key=lambda d: -pairs[d]):
            m = max(2, int(np.ceil(lengths[d] / tokens_share)),
                    int(np.ceil(pairs[d] / (LONG_WORK_FRACTION * share))))
            m = min(m, groups)
            order = np.lexsort((np.arange(groups), state.work))
            _zigzag_long(d, cu, m, list(order), state)
        for d in sorted(np.flatnonzero(~is_long), key=lambda d: (-pairs[d], d)):
            load = np.maximum((state.work + pairs[d]) / share,
                              (state.tokens + lengths[d]) / tokens_share)
            g = int(np.argmin(load))
            state.give(g, int(cu[d]), int(cu[d + 1]), int(d), int(cu[d]))
            state.whole[g].append(int(d))
        _refine(state, lengths, pairs, groups, tokens_share, share)
        try:
            _chain(cu, state, groups, share)
            _repair(cu, state, groups, share)
            break
        except _NoCandidate:
            # No whole document of that group can be cut to move the excess: zigzag its
            # largest whole document as well and start again (rare; tiny streams).
            whole = [d for d in np.flatnonzero(~is_long)]
            if not whole:
                raise AssertionError("partition: no document left to cut") from None
            extra_long.add(int(max(whole, key=lambda d: lengths[d])))
    arr = np.array(sorted(state.pieces, key=lambda p: (p[3], p[0])), dtype=np.int64)
    arr = arr.reshape(-1, 4)
    return Pieces(start=arr[:, 0], end=arr[:, 1], doc=arr[:, 2], group=arr[:, 3])
