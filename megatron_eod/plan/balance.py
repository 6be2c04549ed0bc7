"""Exact token counts and equal work by cutting pieces: the second half of the partitioner.

One job: starting from a placement where every group holds roughly its share of tokens and
pairs (partition.py), make the token counts exact and the pairs equal by cutting pieces and
moving a head or a tail part to another group. A query at position p of its document costs
p + 1 pairs, so a head part [a, a+x) of a piece carries x(2a+x+1)/2 pairs and a tail part
[b-x, b) carries x(2b-x+1)/2: the part and the piece chosen tune the work a cut moves.

* `chain`: for g = 0..R-2, group g passes its token excess to g+1 (or takes its deficit) with
  one cut, or with a pair of cuts (g gives x tokens, takes x - k back: x is then free to tune
  the work); among choices within `CHAIN_SLACK` of the best balance the one that makes the
  fewest key/value tokens travel wins. The last group gets what is left.
* `repair`: token-neutral exchanges between the busiest and the idlest group until every
  group is within 0.2% of its share of pairs.

What it does not do: no initial placement, no schedule.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

__all__ = ["GroupLoads", "NoCandidate", "chain", "repair", "CHAIN_SLACK"]

CHAIN_SLACK = 0.005  # the chain may leave this share of a group's pairs for the repair to fix
REPAIR_TOLERANCE = 0.003  # repair stops when every group is this close to its share of pairs


class GroupLoads:
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


def kv_per_group(state, cu, groups) -> np.ndarray:
    """Key/value tokens each group must receive for the pieces placed so far."""
    by_doc: Dict[int, List[Tuple[int, int, int, int]]] = {}
    for p in state.pieces:
        if p is not None:
            by_doc.setdefault(p[2], []).append(p)
    kv = np.zeros(groups, dtype=np.float64)
    for pieces in by_doc.values():
        if len(pieces) < 2:
            continue
        for g in {p[3] for p in pieces}:
            last = max(p[0] for p in pieces if p[3] == g)
            kv[g] += sum(p[1] - p[0] for p in pieces if p[3] != g and p[1] <= last)
    return kv


def _load_after(kv, group, added):
    return kv[group] + added


def _best_single(state, cu, giver, taker, k, want, kv, slack=0.0):
    """Cut k tokens off one of giver's pieces. Ranking: balance (within slack), then the
    key/value load the cut adds: a moved head [a, a+k) is needed by the giver, which keeps the
    later part (k), and its new owner needs the document before it (a); a moved tail
    [b-k, b) needs what precedes it (b - k)."""
    best = None
    for i, head, a, b in _options(state, cu, giver, k):
        err = abs(_part_work(a, b, k, head) - want)
        if head:
            load = max(_load_after(kv, giver, k), _load_after(kv, taker, a))
        else:
            load = _load_after(kv, taker, b - k)
        key = (err if err > slack else 0.0, load, err)
        if best is None or key < best[0]:
            best = (key, [(i, head, k)])
    return best


def _best_exchange(state, cu, g, k, want, kv, limit=6, other=None, slack=0.0):
    """g gives x tokens of one piece to `other` (default g+1) and takes x - k of one of
    other's pieces; x is free, so the work moved can be tuned at a fixed token count.
    Among choices within `slack` pairs of the best balance, the one leaving the smaller
    key/value load on the two groups wins."""
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
            y = x - k
            net = _part_work(ai, bi, x, hi) - _part_work(aj, bj, y, hj)
            err = np.abs(net - want)
            # See _best_single: a head [a, a+x) costs its giver x and its taker a; a tail
            # [b-x, b) costs its taker b - x.
            load_g = kv[g] + (x if hi else 0.0) + (aj if hj else bj - y)
            load_o = kv[other] + (ai if hi else bi - x) + (y if hj else 0.0)
            load = np.maximum(load_g, load_o)
            ok = err <= err.min() + slack
            m = int(np.flatnonzero(ok)[np.argmin(load[ok])])
            key = (float(err[m]) if err[m] > slack else 0.0, float(load[m]), float(err[m]))
            if best is None or key < best[0]:
                best = (key, [(i, hi, int(x[m])), (j, hj, int(y[m]))])
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


def repair(cu, state, groups, share, tolerance=REPAIR_TOLERANCE, rounds=None):
    """Token-neutral exchanges from the busiest to the idlest group until balanced."""
    for _ in range(rounds or 8 * groups):
        a, b = int(np.argmax(state.work)), int(np.argmin(state.work))
        want = min(state.work[a] - share, share - state.work[b])
        if max(state.work[a] - share, share - state.work[b]) <= tolerance * share:
            return
        kv = kv_per_group(state, cu, groups)
        best = _best_exchange(state, cu, a, 0, want, kv, other=b, slack=tolerance * share)
        if best is None or best[0][2] >= want:
            return  # no exchange improves on doing nothing
        (i, hi, x), (j, hj, y) = best[1]
        _cut(state, cu, i, hi, x, b)
        _cut(state, cu, j, hj, y, a)
        state.pieces = [p for p in state.pieces if p is not None and p[1] > p[0]]


def chain(cu, state, groups, share, tolerance=REPAIR_TOLERANCE):
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
        kv = kv_per_group(state, cu, groups)
        if k != 0:
            giver, taker = (g, g + 1) if k > 0 else (g + 1, g)
            best = _best_single(state, cu, giver, taker, abs(k), want if k > 0 else -want, kv,
                                slack=CHAIN_SLACK * share)
        if best is None or best[0][2] > CHAIN_SLACK * share:
            exchange = _best_exchange(state, cu, g, k, want, kv, slack=CHAIN_SLACK * share)
            if exchange is not None and (best is None or exchange[0][0] < best[0][0]):
                best = exchange
        if best is None:
            if k == 0:
                continue  # balanced in tokens; the work gap is left to `repair`
            raise NoCandidate(g)
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


class NoCandidate(Exception):
    """No piece of a group can be cut to move its token excess."""

    def __init__(self, group):
        super().__init__(group)
        self.group = group
