"""All of a group's ring steps as one exchange and one kernel call (the batched ring).

One job: fold a group's ring steps (kv_schedule.py) into a `BatchedExchange`: every key/value
row the group sends, to all peers, as one gathered buffer; every row it receives, from all
peers, in one buffer (step 1's rows first, each step's in its sender's order, exactly as the
steps receive them); and ONE non-causal varlen call in which each query piece attends to all
the received rows of its document before it, whichever peer they came from. A group then
makes two attention calls per layer and direction (the local call and this one) and one
log-sum-exp merge, whatever the ring size, instead of one call and one merge per step.

The pairs are the steps' pairs, each once (a non-causal call does not care about key order),
so the plan's balance and traffic are unchanged; what changes is that all received rows are
held at once (`recv_count`) rather than one step's. So where some group would receive more
than MAX_RECEIVED_PER_ROW times its own rows (one document over many groups: the group
holding its end receives nearly all of it, up to (R-1)x its rows), the plan gives no group a
batched form (`CPPlan.batched_ring`, the same answer on every rank: both sides of a transfer
must run the same executor) and the steps run, whose buffers stay at one step's rows.

What it does not do: no placement, no communication; built from the steps on the host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_eod.plan.kv_schedule import (GroupSchedule, KernelCall, RingStep, make_call,
                                           span_of, to_device)
from megatron_eod.plan.pieces import ranges

__all__ = ["BatchedExchange", "MAX_RECEIVED_PER_ROW", "batch_steps", "with_batched"]

# Received rows held at once, per row of the group, beyond which the steps run instead (the
# batched executor then holds the received key/values, a gathered copy and their float32
# gradients: about 6x this many rows of bf16 key/values at the peak of the backward).
MAX_RECEIVED_PER_ROW = 4


@dataclass(frozen=True)
class BatchedExchange:
    """send_index: int64 [S], local rows sent, step after step (rows a step sends to
    steps[i].send_to are send_index[send_offsets[i]:send_offsets[i+1]]); received rows of
    step i land at recv_offsets[i]:recv_offsets[i+1] of the [recv_count] buffer; `call`
    (None when nothing is received) reads its keys from that buffer."""

    send_index: torch.Tensor
    send_offsets: Tuple[int, ...]
    recv_offsets: Tuple[int, ...]
    call: Optional[KernelCall]
    send_span: Optional[Tuple[int, int]] = None

    @property
    def recv_count(self) -> int:
        return self.recv_offsets[-1]

    def to(self, device) -> "BatchedExchange":
        return BatchedExchange(to_device(self.send_index, device), self.send_offsets,
                               self.recv_offsets,
                               None if self.call is None else self.call.to(device),
                               self.send_span)


def _offsets(counts: Sequence[int]) -> Tuple[int, ...]:
    return tuple(int(x) for x in np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]))


def batch_steps(steps: Sequence[RingStep]) -> BatchedExchange:
    """The batched form of a group's steps (host tensors, before any `to(device)`)."""
    sends = [s.send_index.numpy() for s in steps]
    send_index = np.concatenate(sends) if sends else np.zeros(0, np.int64)
    recv_offsets = _offsets([s.recv_count for s in steps])
    # Every (query piece, key rows) sequence of every step: the piece's first local row and
    # length, and where its keys lie in `keys` (all steps' key rows, as buffer rows).
    calls = [(s.call, base) for s, base in zip(steps, recv_offsets) if s.call is not None]
    call = None
    if calls:
        keys = np.concatenate([c.k_index.numpy() + base for c, base in calls])
        key_base = _offsets([c.k_index.numel() for c, _ in calls])
        first = np.concatenate([c.q_index.numpy()[c.cu_seqlens_q.numpy()[:-1]]
                                for c, _ in calls])
        q_len = np.concatenate([np.diff(c.cu_seqlens_q.numpy()) for c, _ in calls])
        k_start = np.concatenate([c.cu_seqlens_k.numpy()[:-1].astype(np.int64) + kb
                                  for (c, _), kb in zip(calls, key_base)])
        k_len = np.concatenate([np.diff(c.cu_seqlens_k.numpy()) for c, _ in calls])
        order = np.argsort(first, kind="stable")  # by piece, then step
        first, q_len, k_start, k_len = first[order], q_len[order], k_start[order], k_len[order]
        new = np.flatnonzero(np.concatenate([[True], first[1:] != first[:-1]]))
        k_index = keys[ranges(k_start, k_start + k_len)]
        call = make_call(q_len[new], np.add.reduceat(k_len, new),
                         ranges(first[new], first[new] + q_len[new]), k_index, causal=False)
    return BatchedExchange(torch.from_numpy(send_index.astype(np.int64)),
                           _offsets([s.size for s in sends]), recv_offsets, call,
                           span_of(send_index))


def with_batched(schedule: GroupSchedule) -> GroupSchedule:
    """The schedule with its batched form (host tensors); as is when it has no steps."""
    if not schedule.steps:
        return schedule
    return dataclasses.replace(schedule, batched=batch_steps(schedule.steps))
