"""Communication for the CP algorithms: paired point-to-point exchanges and all-to-alls.

One job: move tensors between ranks of an explicit process group, asynchronously, so that
the algorithms can overlap a step's transfer with the previous step's compute. Peers are
given as ranks inside `group`; empty transfers are skipped (both sides know the sizes from the
plan, so a skipped send always meets a skipped receive). NCCL allows a batched p2p call with
only some ranks of a group only after the group's first collective: `warm_up(group)` runs one
(an all-reduce of one element) the first time a group is used, on every rank of it.

Host staging (tests only): gloo moves CPU tensors only, so the multi-process CUDA tests, which
run several processes on ONE GPU over gloo, stage every transfer through host memory
(`host_staging()`, or MEGATRON_EOD_HOST_STAGING=1 in a launched process). Production runs
use NCCL, which moves device memory directly; nothing stages there.

What it does not do: no attention math, no global process-group state.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = ["Exchange", "Transfers", "exchange", "exchange_many", "all_to_all_equal", "warm_up",
           "host_staging"]

_WARM = []  # groups that have run a collective (kept alive, compared by identity)
_STAGING = [os.environ.get("MEGATRON_EOD_HOST_STAGING") == "1"]


@contextlib.contextmanager
def host_staging(enabled: bool = True):
    """Tests only: stage transfers through host memory (see the module docstring)."""
    before = _STAGING[0]
    _STAGING[0] = enabled
    try:
        yield
    finally:
        _STAGING[0] = before


class Exchange:
    """A started send-to-one-peer / receive-from-another; `wait()` returns the received tensor."""

    def __init__(self, works: List, received: Optional[torch.Tensor], what: str = "", group=None,
                 device=None):
        self._works, self._received, self._what, self._group = works, received, what, group
        self._device = device  # host staging: where the received tensor goes after the wait

    def wait(self) -> Optional[torch.Tensor]:
        try:
            for work in self._works:
                work.wait()
        except RuntimeError as error:  # e.g. a peer stopped answering: say which transfer
            raise RuntimeError(f"{error} [{self._what} in CP group of global ranks "
                               f"{_ranks(self._group)}]") from error
        self._works = []
        if self._device is not None and self._received is not None:
            self._received, self._device = self._received.to(self._device), None
        return self._received


def _ranks(group):
    try:
        return dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return "?"


def exchange(send: Optional[torch.Tensor], send_to: int, recv_shape, recv_from: int, group,
             dtype: torch.dtype, device, tag: int = 0) -> Exchange:
    """Start sending `send` to group rank `send_to` and receiving `recv_shape` from
    `recv_from` (either side may be empty, no elements: then it is skipped)."""
    ops = []
    received = None
    staged_for = device if _STAGING[0] else None
    if send is not None and send.numel():
        send = send.to("cpu") if staged_for is not None else send
        ops.append(dist.P2POp(dist.isend, send.contiguous(),
                              dist.get_global_rank(group, send_to), group, tag))
    if recv_shape is not None and math.prod(recv_shape) > 0:
        received = torch.empty(recv_shape, dtype=dtype,
                               device="cpu" if staged_for is not None else device)
        ops.append(dist.P2POp(dist.irecv, received, dist.get_global_rank(group, recv_from),
                              group, tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    what = (f"p2p tag {tag}: send to group rank {send_to}, receive from group rank "
            f"{recv_from}")
    return Exchange(works, received, what, group, staged_for)


class Transfers:
    """Started sends and receives into given buffers; `wait()` returns when all are done."""

    def __init__(self, works: List, staged: List, what: str, group, ops=()):
        self._works, self._staged, self._what, self._group = works, staged, what, group
        self._ops = ops  # the tensors in flight stay referenced until the wait

    def wait(self) -> None:
        Exchange(self._works, None, self._what, self._group).wait()
        self._works, self._ops = [], ()
        for host, target in self._staged:  # host staging: received into host memory first
            target.copy_(host)
        self._staged = []


def exchange_many(sends, recvs, group, what: str = "") -> Transfers:
    """Start, in ONE batched p2p call, every send of `sends` [(tensor, group rank, tag)] and
    every receive of `recvs` [(contiguous buffer it fills, group rank, tag)], in the order
    given (NCCL matches a pair's messages by order: both sides list them in the same order).
    Empty tensors are skipped, as in `exchange`."""
    ops, staged = [], []
    for tensor, peer, tag in sends:
        if tensor.numel():
            tensor = tensor.to("cpu") if _STAGING[0] else tensor.contiguous()
            ops.append(dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, peer), group,
                                  tag))
    for buffer, peer, tag in recvs:
        if buffer.numel():
            if not buffer.is_contiguous():
                raise AssertionError("exchange_many receives into contiguous buffers only")
            target = buffer
            if _STAGING[0]:
                target = torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu")
                staged.append((target, buffer))
            ops.append(dist.P2POp(dist.irecv, target, dist.get_global_rank(group, peer), group,
                                  tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    return Transfers(works, staged, what or f"{len(ops)} batched p2p transfers", group, ops)


def warm_up(group, device) -> None:
    """Run one collective on `group` the first time it is seen (every rank of it calls this at
    the same point: the entry of an attention call), so that later batched p2p calls may
    involve only the ranks with something to move."""
    if group is None or any(g is group for g in _WARM):
        return
    dist.all_reduce(torch.zeros(1, device="cpu" if _STAGING[0] else device), group=group)
    _WARM.append(group)


def all_to_all_equal(x: torch.Tensor, group) -> torch.Tensor:
    """x: [world, ...] with chunk j going to group rank j -> [world, ...] with chunk j from j."""
    device = x.device
    x = x.to("cpu").contiguous() if _STAGING[0] else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, unlike empty_like
    try:
        dist.all_to_all_single(out, x, group=group)
    except RuntimeError as error:
        raise RuntimeError(f"{error} [Ulysses all-to-all in group of global ranks "
                           f"{_ranks(group)}]") from error
    return out.to(device)
