"""The batched executors' fused path: forward and backward as Triton kernels over the tiles.

One job: what `batched_forward` / `batched_backward` (batched.py) run instead of their kernel
calls and merges where the backend fuses (`TritonForwardBackend`, --cp-fused-forward and
--cp-fused-backward) and the schedule carries its tiles (plan/forward_tiles.py,
plan/key_tiles.py). Same exchange, same messages, same landing of returned gradients
(batched.py's transport calls and `_land`); only the compute differs.

Forward: the query tiles needing no received key while the keys travel, then the others,
each row's out and lse written once (no merge). Backward: delta = rowsum(dout * out); the
local keys' dk/dv while the keys travel (or, with the forward's buffer kept, after the
received keys' dk/dv, whose gradients then travel during it); the received keys' dk/dv, sent
back to their owners; dq of every row from its received and local keys (one launch); the
returned gradients landed as the batched executor lands them. With concurrent calls the
local keys' dk/dv runs on a side stream beside the rest (streams.py). With the backend's
`atomic_dq` (triton_backward.ATOMIC_DQ, for benchmarks) the dk/dv kernels add dq into one
float32 buffer and no dq kernel runs.

What it does not do: no kernels (triton_forward.py, triton_backward.py), no communication of
its own.
"""

from __future__ import annotations

import torch

from megatron_eod.attention import batched
from megatron_eod.attention.backends import accumulation_dtype
from megatron_eod.attention.streams import Beside, fork_point

__all__ = ["fused_forward", "fused_backward", "fuses_backward"]


def fuses_backward(backend, schedule) -> bool:
    """Whether `batched_backward` runs the fused backward for this backend and schedule."""
    return bool(getattr(backend, "fused_backward", False)) and \
        schedule.key_tiles is not None and schedule.forward_tiles is not None


def fused_forward(q_THD, k_TGD, v_TGD, schedule, pending, backend, scale, concurrent_calls):
    """(out, lse, received buffer) by the backend's fused kernel over the forward's tiles:
    the tiles needing no received key while the keys travel (`pending`), then the others;
    each row written once (disjoint rows), no merge. concurrent_calls (on a GPU): the first
    launch on a side stream, so that the second one's programs fill its tail (streams.py),
    unless the backend's `forward_beside` is False."""
    tiles = schedule.forward_tiles
    out_THD = batched._empty_like(q_THD)
    # [T, H] over H-major memory, as a varlen kernel's lse (the backward reads it so).
    lse_TH = torch.empty((q_THD.shape[1], q_THD.shape[0]), dtype=accumulation_dtype(
        q_THD.dtype), device=q_THD.device).transpose(0, 1)

    def launch(tables, k, v):
        backend.forward_tiles(q_THD, k_TGD, v_TGD, k, v, tables, tiles.row_start, out_THD,
                              lse_TH, scale, tiles.block_m)

    received = tiles.with_received.shape[0] > 0
    local = Beside(lambda: launch(tiles.local_only, None, None), q_THD.device,
                   concurrent_calls and received and getattr(backend, "forward_beside", True))
    recv_2NGD = None if pending is None else pending.wait()
    if received:
        launch(tiles.with_received, *batched._keys(recv_2NGD))
    local.result()
    return out_THD, lse_TH, recv_2NGD


def fused_backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH, schedule, transport,
                   backend, scale, keep_received=False, received_2NGD=None,
                   concurrent_calls=False):
    """(dq, dk, dv) in the dtypes of q, k, v by the fused kernels (see the module).
    concurrent_calls (on a GPU): the local keys' dk/dv on a side stream beside the other
    launches (their received keys' dk/dv and dq: separate outputs), joined before the
    returned gradients land in dk, dv (streams.py)."""
    tiles, keys, exchange = schedule.forward_tiles, schedule.key_tiles, schedule.batched
    dout_THD = dout_THD if dout_THD.stride(-1) == 1 else dout_THD.contiguous()
    delta_TH = backend.row_delta(dout_THD, out_THD)
    dk, dv = batched._empty_like(k_TGD), batched._empty_like(v_TGD)
    common = (dout_THD, q_THD, lse_TH, delta_TH, tiles.row_start, scale)
    # dq by the dk/dv kernels' atomic adds (triton_backward.ATOMIC_DQ), or by its own kernel
    dq32 = torch.zeros(q_THD.shape, dtype=torch.float32, device=q_THD.device) \
        if getattr(backend, "atomic_dq", False) else None
    dq = batched._empty_like(q_THD) if dq32 is None else None

    def local_dkdv():
        backend.dkdv_tiles(*common, k_TGD, v_TGD, keys.local, dk, dv, schedule.local.causal,
                           keys.block_n, dq32)

    def received_dkdv(recv_2NGD):
        """The received rows' gradients, on their way back to their owners."""
        gk = gv = None
        if exchange.call is not None:
            k, v = batched._keys(recv_2NGD)
            gk, gv = batched._empty_like(k), batched._empty_like(v)
            backend.dkdv_tiles(*common, k, v, keys.received, gk, gv, exchange.call.causal,
                               keys.block_n, dq32)
        return transport.start_all_grad(schedule, gk, gv, k_TGD.shape[1:], k_TGD.dtype,
                                        q_THD.device)

    def all_dq(recv_2NGD):
        """Every row's dq in one launch, longest tiles first (local-only tiles read no
        received row)."""
        if dq32 is not None:  # added by the dk/dv kernels
            return
        received = batched._keys(recv_2NGD) if tiles.with_received.shape[0] else (None, None)
        backend.dq_tiles(*common, k_TGD, v_TGD, *received, tiles.every, dq, tiles.block_m)

    def beside_local(after=None):
        return Beside(local_dkdv, q_THD.device, concurrent_calls, after=after)

    def joined(local):
        """dq once the local keys' dk/dv (whose adds it may hold) is done."""
        local.result()
        return dq if dq32 is None else dq32.to(q_THD.dtype)

    if exchange is None:  # nothing exchanged (Ulysses, CP=1, a lone group)
        local = beside_local()
        all_dq(None)
        return joined(local), dk, dv
    if keep_received:  # the received keys' gradients first: they travel meanwhile
        recv_2NGD = received_2NGD
        fork = fork_point(q_THD.device, concurrent_calls)  # beside their dk/dv too
        returning = received_dkdv(recv_2NGD)
        local = beside_local(fork)
    else:
        pending = transport.start_all_kv(schedule, k_TGD, v_TGD)
        local = beside_local()
        recv_2NGD = pending.wait()
        returning = received_dkdv(recv_2NGD)
    all_dq(recv_2NGD)
    return (joined(local),) + batched._land(returning.wait(), dk, dv, exchange, k_TGD.dtype)
