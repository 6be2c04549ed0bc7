"""The sweep: a placement of documents on CP groups that never fails and is always balanced.

One job: given document lengths and R groups, give every group exactly N/R tokens and the
same number of causal query-key pairs within `cost.balance_bound`, for ANY valid stream, in
O(n_docs log n_docs + R log N) host work: one sort, then a loop over groups with a bisection
each. It is the planner's fallback and one of its candidates (partition.py).

A query at position p of its document costs p + 1 pairs. Taking a document's tokens in
"shells" (a head [u, u+x) and a tail [v-y, v) of what is left, x ~ y) keeps what is left a
centred middle, so every part of a document has the density (L + 1) / 2 pairs per token of
the whole: documents sorted by length are sorted by density. Every group takes a tokens from
the sparse end of the sorted list (short documents, whole while they last) and N/R - a from
the dense end (long documents, in shells); the larger a, the less work, so a bisection on a
hits the group's share. Shares are cumulative (group g aims at (g + 1) / R of all pairs), so
errors do not pile up: each group is off by at most a couple of tokens' pairs
(`cost.GRANULARITY_TOKENS`). The ends meet in the middle of the list; the last group takes
what is left, which is exactly its share of tokens. Each group boundary cuts at most one
document at each end. A short document cut at the sparse end gives its head instead of a
shell (its next holder then needs few keys), up to `head_cut_below` tokens.

`DocumentSweep` is also the packer's finishing step (pack.py): it fills any token counts with
any pair targets from any pool of documents.

What it does not do: no key/value schedule (kv_schedule.py), no padding ever.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from megatron_eod.plan.cost import doc_pairs
from megatron_eod.plan.pieces import Pieces

__all__ = ["DocumentSweep", "sweep_documents", "swept_pieces", "HEAD_CUT_FRACTION"]

# (sorted index, first position, end position) of a partial document taken by a group.
_Part = Tuple[int, int, int]

HEAD_CUT_FRACTION = 8  # by default documents up to share / 8 tokens are cut head-first


def _pairs(start: int, end: int) -> int:
    """Causal pairs of queries at positions [start, end) of a document (Python ints: exact;
    the hot scalar form of cost.range_pairs)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def _shell(u: int, v: int, length: int, n: int) -> Tuple[int, int]:
    """Split n tokens of the middle [u, v) of a document into a head x and a tail n - x that
    keep what is left centred (so its density stays (length + 1) / 2)."""
    x = min(max((n + (length - v) - u) // 2, 0), n)
    return x, n - x


class DocumentSweep:
    """Documents sorted by length; the material left is documents i..j of that order, where
    i is left as its middle [ui, vi) and j as [uj, vj) (the same document when i == j)."""

    def __init__(self, lengths: np.ndarray, head_cut_below: float):
        # Head cuts at the sparse end only for documents up to `head_cut_below` tokens: what
        # is left of a head-cut document is denser than the document, and must not end up
        # denser than the documents after it (the sweep's balance relies on that order).
        self.head_cut_below = head_cut_below
        # Stable, so equal lengths keep stream order; a radix sort when lengths fit 16 bits.
        keys = lengths.astype(np.uint16) if lengths.max() < 1 << 16 else lengths
        self.order = np.argsort(keys, kind="stable")
        self.length = lengths[self.order]
        self.cum_len = np.concatenate([[0], np.cumsum(self.length)])
        self.cum_work = np.concatenate([[0], np.cumsum(doc_pairs(self.length))])
        last = self.length.size - 1
        self.state = (0, 0, int(self.length[0]), last, 0, int(self.length[last]))

    def _whole(self, lo: int, hi: int) -> int:
        return int(self.cum_work[hi]) - int(self.cum_work[lo])

    def _partial(self, state, k: int, n: int, parts, shell: bool):
        """Take n tokens of what is left of document k: a shell (dense end) or its first n
        tokens (sparse end: a short document's head, so its next holder needs only n keys)."""
        i, ui, vi, j, uj, vj = state
        length = int(self.length[k])
        u, v = (ui, vi) if k == i else (uj, vj) if k == j else (0, length)
        x, y = (n, 0) if not shell and length <= self.head_cut_below else _shell(u, v, length, n)
        if parts is not None:
            if x:
                parts.append((k, u, u + x))
            if y:
                parts.append((k, v - y, v))
        return _pairs(u, u + x) + _pairs(v - y, v), (u + x, v - y)

    def front(self, state, a: int, parts=None, wholes=None):
        """Take a tokens from the sparse end: -> (pairs, new state)."""
        i, ui, vi, j, uj, vj = state
        if a < vi - ui or i == j:
            work, (u, v) = self._partial(state, i, a, parts, False)
            return work, ((i, u, v, j, u, v) if i == j else (i, u, v, j, uj, vj))
        work = _pairs(ui, vi)
        if parts is not None and vi > ui:
            parts.append((i, ui, vi))
        a -= vi - ui
        # Whole documents i+1 .. k-1 (k <= j), then the head of document k.
        k = min(j, int(self.cum_len.searchsorted(self.cum_len[i + 1] + a, "right")) - 1)
        work += self._whole(i + 1, k)
        if wholes is not None and k > i + 1:
            wholes.append((i + 1, k))
        a -= int(self.cum_len[k] - self.cum_len[i + 1])
        more, (u, v) = self._partial(state, k, a, parts, False)
        new = (k, u, v, j, u, v) if k == j else (k, u, v, j, uj, vj)
        return work + more, new

    def back(self, state, b: int, parts=None, wholes=None):
        """Take b tokens from the dense end: -> (pairs, new state)."""
        i, ui, vi, j, uj, vj = state
        if b < vj - uj or i == j:
            work, (u, v) = self._partial(state, j, b, parts, True)
            return work, ((j, u, v, j, u, v) if i == j else (i, ui, vi, j, u, v))
        work = _pairs(uj, vj)
        if parts is not None and vj > uj:
            parts.append((j, uj, vj))
        b -= vj - uj
        # Whole documents k .. j-1 (k >= i+1), then a shell of document k - 1.
        k = max(i + 1, int(self.cum_len.searchsorted(self.cum_len[j] - b, "left")))
        work += self._whole(k, j)
        if wholes is not None and j > k:
            wholes.append((k, j))
        b -= int(self.cum_len[j] - self.cum_len[k])
        p = k - 1
        more, (u, v) = self._partial(state, p, b, parts, True)
        new = (p, u, v, p, u, v) if p == i else (i, ui, vi, p, u, v)
        return work + more, new

    def take(self, a: int, b: int, parts=None, wholes=None):
        """a tokens from the sparse end, then b from the dense end: -> (pairs, new state)."""
        work_front, state = self.front(self.state, a, parts, wholes)
        work_back, state = self.back(state, b, parts, wholes)
        return work_front + work_back, state

    def fill(self, tokens: int, target: float, last: bool, parts, wholes) -> int:
        """Take `tokens` tokens whose pairs come closest to `target`; -> the pairs taken."""
        a = tokens  # the last group takes what is left: exactly one share of tokens
        if not last:
            work = lambda a: self.take(a, tokens - a)[0]  # noqa: E731
            lo, hi = 0, tokens
            w_lo, w_hi = work(lo), work(hi)
            falling = w_lo >= w_hi  # more from the sparse end, less work (the usual case)
            if (target - w_lo) * (target - w_hi) > 0:  # out of reach: the nearer end
                a = lo if abs(target - w_lo) <= abs(target - w_hi) else hi
            else:
                # Invariant: the target lies between work(lo) and work(hi). Work is nearly
                # linear in a, so try the linear interpolation first (regula falsi); halve
                # instead whenever it would not at least halve the bracket.
                bisect_next = False
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if not bisect_next and w_lo != w_hi:
                        guess = lo + int((target - w_lo) / (w_hi - w_lo) * (hi - lo))
                        mid = min(hi - 1, max(lo + 1, guess))
                    w_mid = work(mid)
                    before = hi - lo
                    if (w_mid > target) == falling:
                        lo, w_lo = mid, w_mid
                    else:
                        hi, w_hi = mid, w_mid
                    bisect_next = 2 * (hi - lo) > before
                a = lo if abs(w_lo - target) <= abs(w_hi - target) else hi
        work, self.state = self.take(a, tokens - a, parts, wholes)
        return work


def sweep_documents(cu_seqlens, groups: int, head_cut_below: Optional[float] = None) -> Pieces:
    """Pieces for `groups` groups over the stream described by `cu_seqlens` (see module)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    n_docs = lengths.size
    if groups == 1:
        return Pieces.build(cu[:-1], cu[1:], np.arange(n_docs), np.zeros(n_docs, np.int64),
                            cu, 1)
    share = int(cu[-1]) // groups
    if head_cut_below is None:
        head_cut_below = max(1, share // HEAD_CUT_FRACTION)
    sweep = DocumentSweep(lengths, head_cut_below)
    total = int(sweep.cum_work[-1])
    parts: List[List[_Part]] = []
    wholes: List[List[Tuple[int, int]]] = []
    done = 0
    for g in range(groups):
        parts.append([])
        wholes.append([])
        target = total * (g + 1) / groups - done
        done += sweep.fill(share, target, g == groups - 1, parts[-1], wholes[-1])
    return swept_pieces(cu, sweep.order, parts, wholes, groups)


def swept_pieces(cu, order, parts, wholes, groups) -> Pieces:
    """Stream pieces, grouped by group, from a sweep's partial (sorted index, u, v) parts and
    whole ranges of sorted indices; `order[k]` is the document of sorted index k. No global
    sort: a group's few partial parts are sorted by (document, position) and merged where
    they touch; its whole documents follow. A handful of passes over the pieces (a stream of
    one-token documents has a piece per token)."""
    docs: List[np.ndarray] = []
    counts = np.zeros(groups, dtype=np.int64)
    partial = []  # (piece index, u, v) of the partial pieces
    at = 0
    for g in range(groups):
        merged: List[List[int]] = []
        for doc, u, v in sorted((int(order[k]), u, v) for k, u, v in parts[g]):
            if merged and merged[-1][0] == doc and merged[-1][2] == u:
                merged[-1][2] = v
            else:
                merged.append([doc, u, v])
        docs.append(np.array([m[0] for m in merged], np.int64))
        partial.extend((at + i, u, v) for i, (_, u, v) in enumerate(merged))
        at += len(merged)
        for lo, hi in wholes[g]:
            docs.append(order[lo:hi])
            at += hi - lo
        counts[g] = at - counts.sum()
    doc = np.concatenate(docs)
    doc_start = cu[doc]
    start, end = doc_start.copy(), cu[doc + 1]
    if partial:
        index, u, v = (np.array(c, np.int64) for c in zip(*partial))
        start[index] = doc_start[index] + u
        end[index] = doc_start[index] + v
    group = np.repeat(np.arange(groups, dtype=np.int64), counts)
    return Pieces(start, end, doc, group, doc_start, groups)
