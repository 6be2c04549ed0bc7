"""Who needs whose keys: the per-group attention calls and ring steps of a placement.

One job: turn `Pieces` (which token ranges each group holds) into, for every group, the
varlen kernel calls it makes and the key/value rows it exchanges with each peer. Everything
is index tensors computed once per micro-batch on the host, so the attention layers do no
host work and no host syncs.

For group g with R groups:
* the local call: one causal sequence per run of g's pieces of one document (they are
  consecutive in local order), so it runs over the local rows as they are, with no gather;
* step t = 1..R-1: g receives from group (g - t) mod R exactly the pieces of that group that
  precede one of g's pieces in the same document (each such piece once), sends to group
  (g + t) mod R the pieces that group needs from g, and makes one non-causal call in which
  each of its pieces attends to the received pieces of its document that precede it.
Only documents cut into several pieces create steps with data; a step without data on both
sides is skipped by the attention code.

What it does not do: no placement (partition.py), no communication.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from megatron_eod.plan.partition import Pieces, ranges

__all__ = ["KernelCall", "RingStep", "GroupSchedule", "build_schedules"]


@dataclass(frozen=True)
class KernelCall:
    """One varlen attention call: sequence i has queries q_index[cu_q[i]:cu_q[i+1]] and keys
    k_index[cu_k[i]:cu_k[i+1]] (rows of the local or the received tensor)."""

    q_index: torch.Tensor  # int64 [tq]
    k_index: torch.Tensor  # int64 [tk]
    cu_seqlens_q: torch.Tensor  # int32 [n+1]
    cu_seqlens_k: torch.Tensor  # int32 [n+1]
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    pairs: int  # query-key pairs this call evaluates (per head)

    def to(self, device) -> "KernelCall":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return KernelCall(move(self.q_index), move(self.k_index), move(self.cu_seqlens_q),
                          move(self.cu_seqlens_k), self.max_seqlen_q, self.max_seqlen_k,
                          self.causal, self.pairs)


@dataclass(frozen=True)
class RingStep:
    """Step t of group g's ring: send rows to group g+t, receive rows from group g-t."""

    step: int
    send_to: int
    recv_from: int
    send_index: torch.Tensor  # int64 [n_send], local rows sent to send_to
    recv_count: int
    call: Optional[KernelCall]  # None when nothing is received

    def to(self, device) -> "RingStep":
        return RingStep(self.step, self.send_to, self.recv_from,
                        self.send_index.to(device, non_blocking=True), self.recv_count,
                        None if self.call is None else self.call.to(device))


@dataclass(frozen=True)
class GroupSchedule:
    group: int
    num_tokens: int
    local: KernelCall
    steps: Tuple[RingStep, ...]

    def to(self, device) -> "GroupSchedule":
        return GroupSchedule(self.group, self.num_tokens, self.local.to(device),
                             tuple(s.to(device) for s in self.steps))

    @property
    def kv_tokens_received(self) -> int:
        return sum(s.recv_count for s in self.steps)

    @property
    def pairs(self) -> int:
        return self.local.pairs + sum(s.call.pairs for s in self.steps if s.call is not None)


def _call(q_rows: List[np.ndarray], k_rows: List[np.ndarray], causal: bool) -> KernelCall:
    lq = np.array([r.size for r in q_rows], dtype=np.int64)
    lk = np.array([r.size for r in k_rows], dtype=np.int64)
    if causal:  # bottom-right aligned: query i of sq sees keys 0 .. i + (sk - sq)
        pairs = int((lq * (lk - lq) + lq * (lq + 1) // 2).sum())
    else:
        pairs = int((lq * lk).sum())
    cat = lambda rows: torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, np.int64))  # noqa: E731
    cu = lambda lens: torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))  # noqa: E731
    return KernelCall(cat(q_rows), cat(k_rows), cu(lq), cu(lk),
                      int(lq.max()) if lq.size else 0, int(lk.max()) if lk.size else 0,
                      causal, pairs)


def build_schedules(pieces: Pieces, groups: int) -> List[GroupSchedule]:
    """Schedules for all groups (every rank computes all of them identically)."""
    length = pieces.end - pieces.start
    local_start = np.zeros(length.size, dtype=np.int64)  # first local row of each piece
    by_group = [np.flatnonzero(pieces.group == g) for g in range(groups)]
    for idx in by_group:
        local_start[idx] = np.concatenate([[0], np.cumsum(length[idx])[:-1]]) if idx.size else []
    rows = lambda i: np.arange(local_start[i], local_start[i] + length[i])  # noqa: E731
    # Pieces of documents cut into several pieces, by document, in stream order.
    of_doc = defaultdict(list)
    counts = np.bincount(pieces.doc)
    for i in np.flatnonzero(counts[pieces.doc] > 1):
        of_doc[int(pieces.doc[i])].append(int(i))
    for doc in of_doc:
        of_doc[doc].sort(key=lambda i: pieces.start[i])

    def earlier(i, group):  # pieces of `group` in i's document that end before i starts
        return [j for j in of_doc.get(int(pieces.doc[i]), ())
                if pieces.group[j] == group and pieces.end[j] <= pieces.start[i]]

    schedules = []
    for g in range(groups):
        mine = by_group[g]
        n_tokens = int(length[mine].sum())
        # The group's pieces of one document are consecutive in local order (pieces are in
        # stream order and documents are contiguous): one causal sequence per run, so the
        # local call covers the local rows in order (q_index = k_index = identity).
        runs = []
        for i in mine:
            if runs and pieces.doc[runs[-1][-1]] == pieces.doc[i]:
                runs[-1].append(i)
            else:
                runs.append([i])
        run_rows = [np.arange(local_start[r[0]], local_start[r[-1]] + length[r[-1]])
                    for r in runs]
        local = _call(run_rows, run_rows, causal=True)
        steps = []
        for t in range(1, groups):
            src, dst = (g - t) % groups, (g + t) % groups
            # What g receives from src: src's pieces preceding one of g's pieces (once each).
            needed = {j: None for i in mine for j in earlier(i, src)}
            recv_pieces = sorted(needed, key=lambda j: local_start[j])
            buffer_at = {}
            offset = 0
            for j in recv_pieces:
                buffer_at[j] = offset
                offset += int(length[j])
            call = None
            if recv_pieces:
                qs, ks = [], []
                for i in mine:
                    before = earlier(i, src)
                    if before:
                        qs.append(rows(i))
                        ks.append(np.concatenate([np.arange(buffer_at[j], buffer_at[j]
                                                            + length[j]) for j in before]))
                call = _call(qs, ks, causal=False)
            # What g sends to dst: g's pieces preceding one of dst's pieces.
            sent = {j: None for i in by_group[dst] for j in earlier(i, g)}
            send_pieces = sorted(sent, key=lambda j: local_start[j])
            send_index = ranges(local_start[send_pieces], local_start[send_pieces]
                                + length[send_pieces]) if send_pieces else np.zeros(0, np.int64)
            steps.append(RingStep(t, dst, src, torch.from_numpy(send_index), offset, call))
        schedules.append(GroupSchedule(g, n_tokens, local, tuple(steps)))
    return schedules
