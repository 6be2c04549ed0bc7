"""Order each group's rows so the rows that attend to received keys are one run, last.

One job: reorder the pieces inside every group of a placement (which tokens a group holds
does not change, only where each sits among its local rows) so that the query rows of the
received-keys call form one run. The attention then takes q, and in the backward dout, q, out
and lse, of those rows as slices (views) instead of gathering copies, merges with the span
form of the log-sum-exp merge and adds dq into a slice: on a GPU, about half a group's rows
are copied five times per layer less (query rows of split documents are 4-53% of a group's
rows on the bench mixes), and five glue launches go away.

A piece "needs received keys" when an earlier piece of its document belongs to another
group. Within a document's run of pieces on one group (consecutive, in position order: the
local causal call needs that, and this keeps it) the pieces that need received keys are a
suffix, since a later piece sees everything an earlier one does. So every run is one of:
none of its pieces needs received keys, a mixed run (a prefix that does not, then a suffix
that does), or all of them do. Runs are ordered in that order, stably (none; mixed; all): the
mixed run's suffix and the all-needing runs are then one run at the end of the local rows.
Two mixed runs on one group (a document cut at each end of the group's share: 7% of the
batched calls on the bench mixes, 12% at 128k tokens / CP 16, more at higher CP) leave a gap
whatever the order; such a group keeps its order and the attention gathers those rows, as
before. Among the runs of one class, those whose pieces are sent to other groups sit next to
each other where that is free (none needing: not sent, then sent; all needing: all sent, some
sent, none sent), and a group whose rows that need received keys are one run already keeps
its order (`_groups_to_reorder`).

Any order of a group's tokens is correct: positions, labels and the loss mask travel with the
tokens (megatron/batch.py). Vectorised: a few passes over all pieces, the sort over the
reordered groups' pieces only.

What it does not do: no placement (partition.py), no schedule (kv_schedule.py).
"""

from __future__ import annotations

import numpy as np

from megatron_eod.plan.pieces import Pieces

__all__ = ["needs_received_keys", "order_for_exchange"]


def _other_group_before_and_after(pieces: Pieces):
    """(bool [P], bool [P]): whether a piece of the piece's document held by another group
    lies before it (the piece needs received keys) / after it (the piece is sent)."""
    before = np.zeros(pieces.start.size, dtype=bool)
    after = before.copy()
    index = pieces.split_order()  # pieces of split documents, by (document, start)
    if index.size == 0:
        return before, after
    doc, group = pieces.doc[index], pieces.group[index]
    first = np.flatnonzero(np.concatenate([[True], doc[1:] != doc[:-1]]))
    last = np.append(first[1:], doc.size) - 1
    counts = last - first + 1
    position = np.arange(doc.size)
    # A piece has another group before it iff its group is not the document's first piece's,
    # or the first piece of another group than that one comes before it (mirror: after).
    first_group, last_group = np.repeat(group[first], counts), np.repeat(group[last], counts)
    first_other = np.minimum.reduceat(np.where(group != first_group, position, doc.size), first)
    last_other = np.maximum.reduceat(np.where(group != last_group, position, -1), first)
    before[index] = (group != first_group) | (np.repeat(first_other, counts) < position)
    after[index] = (group != last_group) | (np.repeat(last_other, counts) > position)
    return before, after


def _groups_to_reorder(pieces: Pieces, needs: np.ndarray) -> np.ndarray:
    """The groups whose pieces that need received keys are not consecutive (their rows are
    not one run). The others keep their order: reordering them gains nothing, and a new order
    can cost the peers the run of rows they send, and the steps executor its runs of received
    keys (each step's rows arrive in the order this group reads them, first read first)."""
    position = np.flatnonzero(needs)
    group = pieces.group[position]
    count = np.bincount(group, minlength=pieces.groups)
    lowest = np.full(pieces.groups, needs.size)
    highest = np.full(pieces.groups, -1)
    np.minimum.at(lowest, group, position)
    np.maximum.at(highest, group, position)
    return np.flatnonzero((count > 0) & (highest - lowest + 1 != count))


def _run_keys(needs: np.ndarray, sent: np.ndarray, doc: np.ndarray, group: np.ndarray):
    """For some groups' pieces (their flags, documents and groups, in order): int64 per
    piece, the class of its document run, 0..8 (none needing: not sent, then sent | mixed |
    all needing: all sent, some, none); and the positions of the mixed runs' first pieces.
    Within a run the pieces that need received keys are a suffix and the pieces sent a
    prefix, so a run's first and last pieces say its class."""
    first = np.flatnonzero(np.concatenate([[True], (doc[1:] != doc[:-1]) |
                                           (group[1:] != group[:-1])]))
    last = np.append(first[1:], doc.size) - 1
    needs_class = np.where(needs[first], 2, np.where(needs[last], 1, 0))
    sent_class = np.where(sent[last], 2, np.where(sent[first], 1, 0))
    run_key = 3 * needs_class + np.select([needs_class == 0, needs_class == 2],
                                          [sent_class // 2, 2 - sent_class], 0)
    return np.repeat(run_key, last - first + 1), first[needs_class == 1]


def needs_received_keys(pieces: Pieces) -> np.ndarray:
    """bool [P]: whether an earlier piece of the piece's document is held by another group."""
    return _other_group_before_and_after(pieces)[0]


def order_for_exchange(pieces: Pieces) -> Pieces:
    """`pieces` with the document runs of every group that gains ordered (see the module):
    the rows that need received keys last, the rows sent next to each other where that does
    not cost the first. Groups, runs and each run's piece order are unchanged. Host work: a
    few passes over all pieces (about 3 ms at 1M tokens of 1-7-token documents, 262k pieces)
    and a sort of the reordered groups' pieces."""
    needs, sent = _other_group_before_and_after(pieces)
    groups = _groups_to_reorder(pieces, needs)
    if groups.size == 0:
        return pieces
    reorder = np.zeros(pieces.groups, dtype=bool)
    reorder[groups] = True
    sel = np.flatnonzero(reorder[pieces.group])  # their pieces, grouped by group
    group = pieces.group[sel]
    run_key, mixed = _run_keys(needs[sel], sent[sel], pieces.doc[sel], group)
    # Two mixed runs leave a gap whatever the order: such a group keeps its order.
    gains = np.bincount(group[mixed], minlength=pieces.groups) <= 1
    moved = sel[np.argsort(group * 9 + np.where(gains[group], run_key, 0), kind="stable")]

    def reordered(values):  # only the reordered groups' pieces move (few, of many pieces)
        out = values.copy()
        out[sel] = values[moved]
        return out

    return Pieces(reordered(pieces.start), reordered(pieces.end), reordered(pieces.doc),
                  pieces.group, reordered(pieces.doc_start), pieces.groups)
