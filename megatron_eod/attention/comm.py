"""Communication for the CP algorithms: paired point-to-point exchanges and all-to-alls.

One job: move tensors between ranks of an explicit process group, asynchronously, so that
the algorithms can overlap a step's transfer with the previous step's compute. Peers are
given as ranks inside `group`; empty transfers are skipped (both sides know the sizes from the
plan, so a skipped send always meets a skipped receive). NCCL allows a batched p2p call with
only some ranks of a group only after the group's first collective: `warm_up(group)` runs one
(an all-reduce of one element) the first time a group is used, on every rank of it.

Host staging: gloo moves CPU tensors only, so runs with gloo on CUDA (the multi-process GPU
tests: several processes on ONE GPU) stage every transfer through host memory
(`host_staging()`, `set_host_staging()`, which megatron/gloo_on_cuda.py turns on for gloo on
CUDA, or MEGATRON_EOD_HOST_STAGING=1 in a launched process). NCCL moves device memory directly;
nothing stages there.

What it does not do: no attention math, no global process-group state.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = ["Exchange", "exchange", "exchange_many", "all_to_all_equal", "is_warm", "warm_up",
           "host_staging", "set_host_staging"]

_WARM = []  # groups that have run a collective (kept alive, compared by identity)
_STAGING = [os.environ.get("MEGATRON_EOD_HOST_STAGING") == "1"]


def set_host_staging(enabled: bool) -> bool:
    """Stage transfers through host memory from now on, or stop; the previous setting."""
    before, _STAGING[0] = _STAGING[0], bool(enabled)
    return before


@contextlib.contextmanager
def host_staging(enabled: bool = True):
    """Stage transfers through host memory inside the block (see the module docstring)."""
    before = set_host_staging(enabled)
    try:
        yield
    finally:
        set_host_staging(before)


class Exchange:
    """Started transfers; `wait()` returns `result` (the buffer they fill, or None) once all
    are done, naming the transfer and its group if one fails."""

    def __init__(self, works: List, result: Optional[torch.Tensor] = None, what: str = "",
                 group=None, staged=(), ops=()):
        self._works, self._result, self._what, self._group = works, result, what, group
        self._staged = staged  # host staging: (host buffer, its target), copied after the wait
        self._ops = ops  # the tensors in flight stay referenced until the wait

    def wait(self) -> Optional[torch.Tensor]:
        try:
            for work in self._works:
                work.wait()
        except RuntimeError as error:  # e.g. a peer stopped answering: say which transfer
            raise RuntimeError(f"{error} [{self._what} in CP group of global ranks "
                               f"{_ranks(self._group)}]") from error
        self._works, self._ops = [], ()
        for host, target in self._staged:
            target.copy_(host)
        self._staged = ()
        return self._result


def _ranks(group):
    try:
        return dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return "?"


def exchange(send: Optional[torch.Tensor], send_to: int, recv_shape, recv_from: int, group,
             dtype: torch.dtype, device, tag: int = 0) -> Exchange:
    """Start sending `send` to group rank `send_to` and receiving `recv_shape` from
    `recv_from` (either side may be empty, no elements: then it is skipped); `wait()` returns
    the received tensor (None when nothing is received)."""
    received = None
    if recv_shape is not None and math.prod(recv_shape) > 0:
        received = torch.empty(recv_shape, dtype=dtype, device=device)
    what = (f"p2p tag {tag}: send to group rank {send_to}, receive from group rank "
            f"{recv_from}")
    return exchange_many([] if send is None else [(send, send_to, tag)],
                         [] if received is None else [(received, recv_from, tag)], group,
                         what, received)


def exchange_many(sends, recvs, group, what: str = "", result=None) -> Exchange:
    """Start, in ONE batched p2p call, every send of `sends` [(tensor, group rank, tag)] and
    every receive of `recvs` [(contiguous buffer it fills, group rank, tag)], in the order
    given (NCCL matches a pair's messages by order: both sides list them in the same order).
    Tensors without elements are skipped. `wait()` returns `result`."""
    ops, staged = [], []
    for tensor, peer, tag in sends:
        if tensor.numel():
            tensor = (tensor.to("cpu") if _STAGING[0] else tensor).contiguous()
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
    return Exchange(works, result, what or f"{len(ops)} batched p2p transfers", group, staged,
                    ops)


def is_warm(group) -> bool:
    """Whether `group` has run a collective here (None, no group, needs none)."""
    return group is None or any(g is group for g in _WARM)


def warm_up(group, device) -> None:
    """Run one collective on `group` the first time it is seen (every rank of it calls this at
    the same point: the entry of an attention call), so that later batched p2p calls may
    involve only the ranks with something to move."""
    if is_warm(group):
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
