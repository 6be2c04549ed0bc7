"""Who needs whose keys: one group's attention calls and ring steps, built on demand.

One job: turn `Pieces` into the varlen kernel calls a group makes and the key/value rows it
exchanges with each peer. Only the asking group's schedule is built (a rank needs its own),
in O(its pieces + the pieces of its split documents + R) host work; everything is index
tensors made once per micro-batch, so the attention layers do no host work and no host syncs.

For group g with R groups:
* the local call: one causal sequence per document g holds (its pieces of one document are
  one run of local rows), over the local rows as they are, with no gather;
* step t = 1..R-1: g receives from group (g - t) mod R exactly the pieces of that group that
  precede one of g's pieces in the same document (each once, in the order g's call reads
  them, so that its keys are one run of the buffer where no piece is read twice),
  sends to group (g + t) mod R the pieces that group needs from g, and makes one non-causal
  call in which each of its pieces attends to the received pieces of its document before it.
Only documents held by two groups or more ("split documents") create steps with data.

`needed_pieces` is the one statement of "who needs what": the schedules, `CPPlan.stats()`
and the tests all read it.

What it does not do: no placement (partition.py), no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

import numpy as np
import torch

from megatron_eod.plan.pieces import Pieces, ranges

if TYPE_CHECKING:  # kv_batched.py and forward_tiles.py build on this module
    from megatron_eod.plan.forward_tiles import ForwardTiles
    from megatron_eod.plan.key_tiles import KeyTiles
    from megatron_eod.plan.kv_batched import BatchedExchange

__all__ = ["KernelCall", "RingStep", "GroupSchedule", "SplitDocuments", "build_schedule",
           "call_from_rows", "make_call", "needed_pieces", "schedule_totals", "span_of",
           "to_device"]


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor onto `device` without the host waiting for the device: pinned, then a
    non-blocking copy, for a GPU (a blocking copy drains the stream first, and a non-blocking
    one from pageable memory may still wait for it). Plans and micro-batches move this way."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@dataclass(frozen=True)
class KernelCall:
    """One varlen attention call: sequence i has queries q_index[cu_q[i]:cu_q[i+1]] and keys
    k_index[cu_k[i]:cu_k[i+1]] (rows of the local or the received tensor). q_span/k_span:
    (start, stop) when the index is the run start, start+1, .., stop-1 (known on the host at
    planning time), so the attention takes a slice, a view, instead of gathering a copy."""

    q_index: torch.Tensor  # int64 [tq]
    k_index: torch.Tensor  # int64 [tk]
    cu_seqlens_q: torch.Tensor  # int32 [n+1]
    cu_seqlens_k: torch.Tensor  # int32 [n+1]
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    pairs: int  # query-key pairs this call evaluates (per head)
    q_span: Optional[Tuple[int, int]] = None
    k_span: Optional[Tuple[int, int]] = None

    def to(self, device) -> "KernelCall":
        move = lambda t: to_device(t, device)  # noqa: E731
        return KernelCall(move(self.q_index), move(self.k_index), move(self.cu_seqlens_q),
                          move(self.cu_seqlens_k), self.max_seqlen_q, self.max_seqlen_k,
                          self.causal, self.pairs, self.q_span, self.k_span)


@dataclass(frozen=True)
class RingStep:
    """Step t of group g's ring: send rows to group g+t, receive rows from group g-t."""

    step: int
    send_to: int
    recv_from: int
    send_index: torch.Tensor  # int64 [n_send], local rows sent to send_to
    recv_count: int
    call: Optional[KernelCall]  # None when nothing is received
    send_span: Optional[Tuple[int, int]] = None  # (start, stop) when send_index is that run

    def to(self, device) -> "RingStep":
        return RingStep(self.step, self.send_to, self.recv_from,
                        to_device(self.send_index, device), self.recv_count,
                        None if self.call is None else self.call.to(device), self.send_span)


@dataclass(frozen=True)
class GroupSchedule:
    group: int
    num_tokens: int
    local: KernelCall
    steps: Tuple[RingStep, ...]
    batched: Optional["BatchedExchange"] = None  # the steps as one exchange (kv_batched.py)
    # The local call as two calls over two runs of rows, the one to launch first first
    # (local_split.py): what the batched executors run side by side with concurrent_calls.
    local_parts: Optional[Tuple[KernelCall, KernelCall]] = None
    # The batched forward as query tiles of one fused kernel (forward_tiles.py): what a
    # kernel backend with `forward_tiles` runs instead of the two calls and the merge.
    forward_tiles: Optional["ForwardTiles"] = None
    # Its backward's key tiles (key_tiles.py), for the fused backward's dk/dv kernel.
    key_tiles: Optional["KeyTiles"] = None

    def to(self, device) -> "GroupSchedule":
        parts = None if self.local_parts is None else \
            tuple(part.to(device) for part in self.local_parts)
        return GroupSchedule(self.group, self.num_tokens, self.local.to(device),
                             tuple(s.to(device) for s in self.steps),
                             None if self.batched is None else self.batched.to(device), parts,
                             None if self.forward_tiles is None else self.forward_tiles.to(device),
                             None if self.key_tiles is None else self.key_tiles.to(device))

    @property
    def kv_tokens_received(self) -> int:
        return sum(s.recv_count for s in self.steps)

    @property
    def pairs(self) -> int:
        return self.local.pairs + sum(s.call.pairs for s in self.steps if s.call is not None)


class SplitDocuments:
    """The pieces of documents held by two groups or more, sorted by (document, start), and
    every piece's first local row: what every schedule and `needed_pieces` read."""

    def __init__(self, pieces: Pieces):
        self.pieces = pieces
        self.local_start = pieces.local_start()
        self.index = pieces.split_order()  # piece indices, by (doc, start)
        self.doc = pieces.doc[self.index]

    def of_group(self, group: int) -> np.ndarray:
        """Indices into `index` of the split pieces `group` holds."""
        return np.flatnonzero(self.pieces.group[self.index] == group)


def needed_pieces(split: SplitDocuments, group: int) -> Tuple[np.ndarray, np.ndarray]:
    """Every (query piece of `group`, key piece of another group) pair of one split document
    where the key piece lies before the query piece: two int64 arrays of piece indices."""
    mine = split.of_group(group)
    # The pieces of a document are consecutive in `index`, in position order: the key
    # pieces before piece m are those between its document's first piece and m.
    first = np.searchsorted(split.doc, split.doc[mine], side="left")
    q, k = np.repeat(mine, mine - first), ranges(first, mine)
    other = split.pieces.group[split.index[k]] != group
    return split.index[q[other]], split.index[k[other]]


def given_pieces(split: SplitDocuments, group: int) -> Tuple[np.ndarray, np.ndarray]:
    """Every (query piece of another group, key piece of `group`) pair of one split document
    where the key piece lies before the query piece: the mirror of needed_pieces."""
    mine = split.of_group(group)
    end = np.searchsorted(split.doc, split.doc[mine], side="right")
    k, q = np.repeat(mine, end - mine - 1), ranges(mine + 1, end)
    other = split.pieces.group[split.index[q]] != group
    return split.index[q[other]], split.index[k[other]]


def _read_order(split: SplitDocuments, q: np.ndarray, k: np.ndarray):
    """(q, k) pairs of one (sender, receiver) sorted as the receiver reads them: its query
    pieces in local order, each one's keys in position order; and the key pieces once each,
    in the order first read. Sender and receiver both compute this from the same pairs, so
    the buffer arrives in the order the receiver's call takes it."""
    order = np.lexsort((split.pieces.start[k], split.local_start[q]))
    q, k = q[order], k[order]
    _, first = np.unique(k, return_index=True)
    return q, k, k[np.sort(first)]


def schedule_totals(split: SplitDocuments, group: int) -> Tuple[int, int]:
    """(query-key pairs the group's calls evaluate, key/value tokens it receives), from the
    same relation the schedule is built from, without building it."""
    p = split.pieces
    q, k = needed_pieces(split, group)
    local = local_call(p, group, with_rows=False)
    pairs = local.pairs + int((p.length[q] * p.length[k]).sum())
    return pairs, int(p.length[np.unique(k)].sum())


def _offsets(lengths: np.ndarray) -> torch.Tensor:
    """int32 cu_seqlens of sequence lengths."""
    return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def make_call(q_lengths, k_lengths, q_index, k_index, causal: bool) -> KernelCall:
    lq, lk = np.asarray(q_lengths, np.int64), np.asarray(k_lengths, np.int64)
    if causal:  # bottom-right aligned: query i of sq sees keys 0 .. i + (sk - sq)
        pairs = int((lq * (lk - lq) + lq * (lq + 1) // 2).sum())
    else:
        pairs = int((lq * lk).sum())
    return KernelCall(torch.from_numpy(q_index), torch.from_numpy(k_index), _offsets(lq),
                      _offsets(lk), int(lq.max()) if lq.size else 0,
                      int(lk.max()) if lk.size else 0, causal, pairs, span_of(q_index),
                      span_of(k_index))


def span_of(index: np.ndarray) -> Optional[Tuple[int, int]]:
    """(start, stop) when `index` is start, start+1, .., stop-1; else None."""
    if index.size == 0:
        return None
    start = int(index[0])
    if int(index[-1]) - start != index.size - 1 or np.any(np.diff(index) != 1):
        return None
    return start, start + int(index.size)


def call_from_rows(q_rows: List[np.ndarray], k_rows: List[np.ndarray],
                   causal: bool) -> KernelCall:
    """A call whose sequence i has queries q_rows[i] and keys k_rows[i] (benchmarks build
    other systems' layouts with it)."""
    cat = lambda rows: np.concatenate(rows) if rows else np.zeros(0, np.int64)  # noqa: E731
    return make_call([r.size for r in q_rows], [r.size for r in k_rows], cat(q_rows).astype(
        np.int64), cat(k_rows).astype(np.int64), causal)


def local_call(pieces: Pieces, group: int, with_rows: bool = True) -> KernelCall:
    """One causal sequence per run of the group's pieces of one document, over the local
    rows in order (q_index = k_index = identity)."""
    lo, hi = pieces.group_offsets[[group, group + 1]]
    doc, length = pieces.doc[lo:hi], pieces.length[lo:hi]
    run_length = np.add.reduceat(length, np.flatnonzero(np.concatenate(
        [[True], doc[1:] != doc[:-1]]))) if doc.size else np.zeros(0, np.int64)
    rows = np.arange(int(length.sum()) if with_rows else 0, dtype=np.int64)
    return make_call(run_length, run_length, rows, rows, causal=True)


def _by_group(group_of: np.ndarray, groups: int):
    """(order, bounds): entries of group g are order[bounds[g]:bounds[g+1]], stable."""
    order = np.argsort(group_of, kind="stable")
    return order, np.searchsorted(group_of[order], np.arange(groups + 1))


def build_schedule(split: SplitDocuments, group: int) -> GroupSchedule:
    """Group `group`'s local call and its R - 1 ring steps (see the module)."""
    p, groups = split.pieces, split.pieces.groups
    length, local_start = p.length, split.local_start
    rows = lambda i: ranges(local_start[i], local_start[i] + length[i])  # noqa: E731
    q_piece, k_piece = needed_pieces(split, group)
    from_order, from_bounds = _by_group(p.group[k_piece], groups)
    given_q, given_k = given_pieces(split, group)
    to_order, to_bounds = _by_group(p.group[given_q], groups)
    nothing = torch.zeros(0, dtype=torch.int64)
    steps: List[RingStep] = []
    for t in range(1, groups):
        src, dst = (group - t) % groups, (group + t) % groups
        # Received: src's needed pieces, once each, in the order this group reads them.
        mine = from_order[from_bounds[src]:from_bounds[src + 1]]
        qs, ks, received = _read_order(split, q_piece[mine], k_piece[mine])
        call = None
        if received.size:
            # Buffer offset of each received piece: they arrive in `received` order.
            offset = np.cumsum(length[received]) - length[received]
            by_piece = np.argsort(received)
            at = offset[by_piece[np.searchsorted(received[by_piece], ks)]]
            new_q = np.concatenate([[True], qs[1:] != qs[:-1]])
            uq = qs[new_q]
            k_lengths = np.add.reduceat(length[ks], np.flatnonzero(new_q))
            call = make_call(length[uq], k_lengths, rows(uq), ranges(at, at + length[ks]),
                         causal=False)
        # Sent: what dst needs from this group, in the order dst reads it (dst computes the
        # same pairs as its `received`).
        gone = to_order[to_bounds[dst]:to_bounds[dst + 1]]
        sent = _read_order(split, given_q[gone], given_k[gone])[2]
        sent_rows = rows(sent) if sent.size else None
        send_index = torch.from_numpy(sent_rows) if sent.size else nothing
        steps.append(RingStep(t, dst, src, send_index, int(length[received].sum()), call,
                              None if sent_rows is None else span_of(sent_rows)))
    lo, hi = p.group_offsets[[group, group + 1]]
    return GroupSchedule(group, int(length[lo:hi].sum()), local_call(p, group), tuple(steps))
