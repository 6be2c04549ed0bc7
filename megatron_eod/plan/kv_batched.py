"""All of a group's ring steps as one exchange and one kernel call (the batched ring).

One job: a group's `BatchedExchange`: every key/value row it sends, to all peers, as runs of
its local rows (views, nothing gathered); every row it receives, from all peers, in one
buffer laid out in the order its ONE non-causal varlen call reads them; that call, in which
each query piece attends to all the received rows of its document before it, whichever peer
they came from. A group then makes two attention calls per layer and direction (the local
call and this one) and one log-sum-exp merge, whatever the ring size, instead of one call and
one merge per step.

The receive buffer is the call's keys exactly, query piece after query piece, each piece's
keys peer after peer (in ring-step order, a non-causal call does not care about key order),
each peer's in position order. So the call reads its keys as one run of the buffer (a view,
no gather), and reads every buffer row once: the key/value gradients it returns are the
kernel's own, in the kernel's dtype, with no sum on the receiving side. The price is that a
key row read by two query pieces of the receiver (two pieces of one document, both after it)
travels twice; the owner sums the two gradients it gets back, as it already does for a row
sent to two peers. Each (query piece, peer) run of the buffer is one message (split where its
rows are not one run of the sender's local rows: never in the plans made here, whose pieces of
a document on one group are consecutive), so the sender's k and v rows leave as views, with no
gather or stack; a peer may send several messages to one receiver; both sides list a pair's
messages in the receiver's buffer order and number them (`Message.ordinal`, the tag), which
NCCL (order) and gloo (tags) both need.

The pairs are the steps' pairs, each once, so the plan's balance is unchanged; the traffic is
the steps' plus the repeated rows (`rows_received`), all held at once. So where some group
would receive more than MAX_RECEIVED_PER_ROW times its own rows (one document over many
groups: the group holding its end receives nearly all of it), the plan gives no group a
batched form (`CPPlan.batched_ring`, the same answer on every rank: both sides of a transfer
must run the same executor) and the steps run, whose buffers stay at one step's rows.

What it does not do: no placement, no communication; built on the host from the pieces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from megatron_eod.plan.kv_schedule import (GroupSchedule, KernelCall, SplitDocuments,
                                           given_pieces, make_call, needed_pieces, span_of,
                                           to_device)
from megatron_eod.plan.pieces import ranges

__all__ = ["BatchedExchange", "Landing", "MAX_RECEIVED_PER_ROW", "Message", "build_batched",
           "rows_received", "with_batched"]

# Received rows held at once, per row of the group, beyond which the steps run instead (the
# batched backward then holds the received key/values and their gradients from the kernel,
# which return as views: about 2x this many rows of key/values at its peak).
MAX_RECEIVED_PER_ROW = 4


class Message(NamedTuple):
    """Rows start:stop of the send or receive order, to or from ring group `peer`, the
    `ordinal`-th message between the two in this direction; a sent message's rows are the run
    of local rows from `row` on (-1 for a received one), so k and v go as views of it."""

    peer: int
    start: int
    stop: int
    ordinal: int
    row: int = -1


@dataclass(frozen=True)
class BatchedExchange:
    """send_index: int64 [S], local rows sent, message after message (a row goes once per
    query piece of a peer that reads it): `sends`' rows, each message a run of local rows
    (from `Message.row`), and where the gradients returned for them land in the [2, S, G, D]
    return buffer; `recvs`: where each arriving message
    lands in the [recv_count] buffer; `call` (None when nothing is received) reads its keys
    from that buffer, every row once and in order (k_span (0, recv_count)). The key/value
    gradients go back along the same messages, reversed; `landing` (None where each row is
    sent once) says how those of a row sent several times are summed (batched.py)."""

    send_index: torch.Tensor
    sends: Tuple[Message, ...]
    recvs: Tuple[Message, ...]
    call: Optional[KernelCall]
    send_span: Optional[Tuple[int, int]] = None
    landing: Optional["Landing"] = None

    @property
    def recv_count(self) -> int:
        return self.recvs[-1].stop if self.recvs else 0

    def to(self, device) -> "BatchedExchange":
        landing = self.landing
        if landing is not None:
            landing = landing._replace(index=to_device(landing.index, device))
        return dataclasses.replace(self, send_index=to_device(self.send_index, device),
                                   call=None if self.call is None else self.call.to(device),
                                   landing=landing)


class Landing(NamedTuple):
    """Where a group sends some row more than once (to several peers, or to two query pieces
    of one), the gradients returned for a row are summed with its own in float32, then
    rounded once, over the run of local rows start:stop that covers every row sent (rows in
    it not sent add nothing): `index`, int64 [S], each sent row's place in that run."""

    start: int
    stop: int
    index: torch.Tensor


def _landing(send_index: np.ndarray) -> Optional[Landing]:
    """None where every row is sent once (the gradients then land one each, by send_index)."""
    if np.unique(send_index).size == send_index.size:
        return None
    start = int(send_index.min())
    return Landing(start, int(send_index.max()) + 1, torch.from_numpy(send_index - start))


def _messages(q: np.ndarray, k: np.ndarray, peer: np.ndarray, length: np.ndarray,
              local_start: np.ndarray) -> Tuple[Message, ...]:
    """One message per run of (query piece q, key piece k) pairs with the same query piece and
    peer whose key pieces follow each other in the peer's local rows (both sides compute this
    from the same split: they agree), numbered per peer."""
    if not q.size:
        return ()
    follows = local_start[k[:-1]] + length[k[:-1]] == local_start[k[1:]]
    first = np.flatnonzero(np.concatenate(
        [[True], (q[1:] != q[:-1]) | (peer[1:] != peer[:-1]) | ~follows]))
    offsets = np.concatenate([[0], np.cumsum(np.add.reduceat(length[k], first))])
    seen: dict = {}
    out = []
    for i, (p, row) in enumerate(zip(peer[first].tolist(), local_start[k[first]].tolist())):
        out.append(Message(p, int(offsets[i]), int(offsets[i + 1]), seen.get(p, 0), row))
        seen[p] = seen.get(p, 0) + 1
    return tuple(out)


def build_batched(split: SplitDocuments, group: int) -> BatchedExchange:
    """Group `group`'s batched exchange (host tensors, before any `to(device)`)."""
    p, groups = split.pieces, split.pieces.groups
    length, local_start = p.length, split.local_start
    rows = lambda i: ranges(local_start[i], local_start[i] + length[i])  # noqa: E731
    # Received: query piece after query piece (local order), each one's keys by the step
    # that brings them, then by position: the call's keys, as one run.
    q, k = needed_pieces(split, group)
    order = np.lexsort((p.start[k], (group - p.group[k]) % groups, local_start[q]))
    q, k = q[order], k[order]
    recvs = tuple(m._replace(row=-1) for m in _messages(q, k, p.group[k], length, local_start))
    call = None
    if q.size:
        new = np.flatnonzero(np.concatenate([[True], q[1:] != q[:-1]]))
        read = int(length[k].sum())
        call = make_call(length[q[new]], np.add.reduceat(length[k], new), rows(q[new]),
                         np.arange(read, dtype=np.int64), causal=False)
    # Sent: receiver after receiver (by step), each one's part laid out as it reads it.
    gq, gk = given_pieces(split, group)
    order = np.lexsort((p.start[gk], local_start[gq], (p.group[gq] - group) % groups))
    gq, gk = gq[order], gk[order]
    send_index = rows(gk) if gk.size else np.zeros(0, np.int64)
    send_span = span_of(send_index)
    return BatchedExchange(torch.from_numpy(send_index),
                           _messages(gq, gk, p.group[gq], length, local_start), recvs, call,
                           send_span,
                           None if send_span is not None else _landing(send_index))


def rows_received(split: SplitDocuments, group: int) -> int:
    """Key/value rows the group's batched exchange receives (and holds at once): a row once
    per query piece of the group that reads it."""
    q, k = needed_pieces(split, group)
    return int(split.pieces.length[k].sum())


def with_batched(schedule: GroupSchedule, split: SplitDocuments) -> GroupSchedule:
    """The schedule with its batched form (host tensors); as is when it has no steps."""
    if not schedule.steps:
        return schedule
    return dataclasses.replace(schedule, batched=build_batched(split, schedule.group))
