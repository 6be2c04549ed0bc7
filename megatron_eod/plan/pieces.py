"""`Pieces`: which token ranges of the packed stream each CP group holds.

One job: the record every other plan module reads and writes. A piece is a contiguous range
[start, end) of the flattened b*s stream that lies inside one document and belongs to one
group. Pieces are grouped by group (ascending); within a group the pieces of one document are
consecutive, in position order and not touching. A group's local token order is the
concatenation of its pieces, so each of its documents is one run of rows there, earlier
positions first (what the local causal attention call needs).

What it does not do: no placement (partition.py), no pair or traffic counts (cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["Pieces", "ranges"]


def ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, e) for every (s, e), vectorised."""
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    lengths = ends - starts
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + offsets


@dataclass(frozen=True)
class Pieces:
    """start/end: int64 [P] stream offsets [start, end); doc: int64 [P] document index;
    group: int64 [P]; doc_start: int64 [P] stream offset of the piece's document; in the
    order the module describes."""

    start: np.ndarray
    end: np.ndarray
    doc: np.ndarray
    group: np.ndarray
    doc_start: np.ndarray
    groups: int

    @classmethod
    def build(cls, start, end, doc, group, cu_seqlens, groups: int) -> "Pieces":
        """Any ranges -> the module's order: sorted by (group, start), empty ranges dropped,
        touching pieces of one document in one group merged."""
        start, end = np.asarray(start, np.int64), np.asarray(end, np.int64)
        doc, group = np.asarray(doc, np.int64), np.asarray(group, np.int64)
        keep = end > start
        start, end, doc, group = start[keep], end[keep], doc[keep], group[keep]
        order = np.lexsort((start, group))
        start, end, doc, group = start[order], end[order], doc[order], group[order]
        joins = np.zeros(start.size, dtype=bool)
        joins[1:] = (group[1:] == group[:-1]) & (doc[1:] == doc[:-1]) & (start[1:] == end[:-1])
        if joins.any():
            first = np.flatnonzero(~joins)
            last = np.concatenate([first[1:], [start.size]]) - 1
            start, end, doc, group = start[first], end[last], doc[first], group[first]
        cu = np.asarray(cu_seqlens, np.int64)
        return cls(start, end, doc, group, cu[doc], int(groups))

    @cached_property
    def length(self) -> np.ndarray:
        return self.end - self.start

    @cached_property
    def group_offsets(self) -> np.ndarray:
        """int64 [groups + 1]: the pieces of group g are [offsets[g], offsets[g+1])."""
        return np.searchsorted(self.group, np.arange(self.groups + 1))

    def local_start(self) -> np.ndarray:
        """int64 [P]: the first local row of every piece on its group."""
        cum = np.concatenate([[0], np.cumsum(self.length)])
        offsets = self.group_offsets
        return cum[:-1] - np.repeat(cum[offsets[:-1]], np.diff(offsets))

    def token_index(self, group: int) -> np.ndarray:
        """Stream offsets of the tokens `group` holds, in local order."""
        lo, hi = self.group_offsets[[group, group + 1]]
        return ranges(self.start[lo:hi], self.end[lo:hi])

    def split_order(self) -> np.ndarray:
        """Indices of the pieces of documents held by two groups or more ("split documents",
        the only ones whose keys travel), sorted by (document, start). Only documents with
        several pieces can be split, and there are few: they alone are sorted."""
        several = np.flatnonzero(np.bincount(self.doc)[self.doc] > 1)
        order = several[np.lexsort((self.start[several], self.doc[several]))]
        doc, group = self.doc[order], self.group[order]
        if doc.size == 0:
            return order
        first = np.flatnonzero(np.concatenate([[True], doc[1:] != doc[:-1]]))
        counts = np.diff(np.append(first, doc.size))
        mixed = np.logical_or.reduceat(group != np.repeat(group[first], counts), first)
        return order[np.repeat(mixed, counts)]

    def tokens_per_group(self) -> np.ndarray:
        return np.bincount(self.group, weights=self.length,
                           minlength=self.groups).astype(np.int64)
