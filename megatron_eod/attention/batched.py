"""The batched ring: a group's ring steps as one exchange, one extra kernel call, one merge.

One job: exact causal document-masked attention for the rows a ring group holds, as ring.py
computes it, with its `BatchedExchange` (plan/kv_batched.py) instead of step after step.
Forward: all key/value rows the peers need leave in one batched p2p call and all rows this
group needs arrive in one, while the local call runs over the local rows as they are; then
ONE non-causal varlen call of the split documents' query pieces against every received row of
their documents before them, and ONE log-sum-exp merge into the local result. Backward: the
same exchange again while the local backward runs (or, with keep_received, the forward's
buffer, saved), one backward call over the received rows, and the received rows' key/value
gradients return to their owners in one batched call.

Against ring.py's steps: 2 kernel calls per direction instead of up to R, 1 merge instead of
up to R - 1, no float32 copies of out or dq (one merge and one sum round once, in float32
inside the merge); the received keys are views of the buffer (it is laid out as the call
reads them) and their gradients travel back in the kernel's dtype (each received row has one
reader: nothing to sum before the owner's float32 sum); in exchange all received rows are
held at once, a key row read by two query pieces arrives twice, and the exchange overlaps the
local call only (the steps overlap each transfer with the previous step's compute).

Messages are row-major, [rows, 2, G, D] (k and v of a row together), so that each message
is a contiguous slice of one send or receive buffer.

Shape key: T = local rows, H = query heads, G = key/value heads, D = head dim, S = rows sent,
N = rows received; 2 = keys and values.
"""

from __future__ import annotations

import torch

from megatron_eod.attention.backends import accumulation_dtype
from megatron_eod.attention.lse import merge_into

__all__ = ["batched_forward", "batched_backward", "call_forward", "call_backward",
           "runs_batched"]


def take_rows(x, index, span):
    """Rows `index` of x: a slice (a view, no copy) when they are the run `span`."""
    return x[span[0]:span[1]] if span is not None else x[index]


def call_forward(backend, q_THD, k, v, call, scale):
    """A planned call's (out, lse) for its query rows of q against the keys k, v (both ring
    executors make their calls over received keys through this and `call_backward`)."""
    return backend.forward(take_rows(q_THD, call.q_index, call.q_span), k, v,
                           call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q,
                           call.max_seqlen_k, call.causal, scale)


def call_backward(backend, dout_THD, q_THD, k, v, out_THD, lse_TH, call, scale):
    """(dq of the call's query rows, dk, dv of k, v) from the rows' FINAL out and lse."""
    rows, span = call.q_index, call.q_span
    return backend.backward(take_rows(dout_THD, rows, span), take_rows(q_THD, rows, span), k, v,
                            take_rows(out_THD, rows, span), take_rows(lse_TH, rows, span),
                            call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q,
                            call.max_seqlen_k, call.causal, scale)


# A kernel launch costs about as much device time as moving this many bytes (a few
# microseconds at an H100's ~3 TB/s).
LAUNCH_BYTES = 8 << 20


def _pick_first(k_TGD, sent_rows: int) -> bool:
    """Whether to gather the sent rows of k and v, then stack them (3 launches), rather than
    stack all T rows, then gather (2 launches): the first moves 2 (T - S) rows of k and v
    less, worth it where that outweighs a launch. Shapes only: no device sync."""
    row_bytes = 2 * k_TGD[0].numel() * k_TGD.element_size()
    return 2 * (k_TGD.shape[0] - sent_rows) * row_bytes > LAUNCH_BYTES


def _start_kv(k_TGD, v_TGD, schedule, transport):
    """Send every row the peers need and receive every row this group needs, in one call."""
    batched = schedule.batched
    span, index = batched.send_span, batched.send_index
    if span is not None:  # one run of local rows: stack just those
        send_S2GD = torch.stack([k_TGD[span[0]:span[1]], v_TGD[span[0]:span[1]]], dim=1)
    elif not index.numel():  # nothing to send
        send_S2GD = k_TGD.new_empty((0, 2) + tuple(k_TGD.shape[1:]))
    elif _pick_first(k_TGD, index.numel()):
        send_S2GD = torch.stack([k_TGD.index_select(0, index), v_TGD.index_select(0, index)],
                                dim=1)
    else:
        send_S2GD = torch.stack([k_TGD, v_TGD], dim=1).index_select(0, index)
    return transport.start_all_kv(schedule, send_S2GD)


def _keys(recv_N2GD):
    """(k, v) of the call's key rows, which are the received buffer (kv_batched.py): views
    with row stride 2 x G x D, the layout flash kernels take for packed k/v."""
    return recv_N2GD[:, 0], recv_N2GD[:, 1]


def runs_batched(schedule) -> bool:
    """Whether the batched executor can run `schedule`: it has no ring steps, or their
    batched form (plan/kv_batched.py leaves it out where the steps hold far less data)."""
    return not schedule.steps or schedule.batched is not None


def _check(schedule):
    if not runs_batched(schedule):  # else received keys would be ignored
        raise ValueError("this GroupSchedule has ring steps but no batched form: run it with "
                         "the steps executor (ring.py; ring_attention falls back by itself)")
    batched = schedule.batched
    if batched is not None and batched.call is not None and \
            batched.call.k_span != (0, batched.recv_count):
        raise ValueError("the batched call must read its receive buffer once, in order "
                         "(k_span (0, recv_count)): build it with kv_batched.build_batched")


def batched_forward(q_THD, k_TGD, v_TGD, schedule, transport, backend, scale,
                    keep_received=False):
    """-> (out [T, H, D] in q's dtype, lse [T, H] float32/float64), and with keep_received
    the received [N, 2, G, D] buffer too (None when nothing is received), for
    `batched_backward(received_N2GD=...)`."""
    _check(schedule)
    pending = _start_kv(k_TGD, v_TGD, schedule, transport) if schedule.batched else None
    local = schedule.local  # over the local rows in order: no gather
    out_THD, lse_TH = backend.forward(q_THD, k_TGD, v_TGD, local.cu_seqlens_q,
                                      local.cu_seqlens_k, local.max_seqlen_q,
                                      local.max_seqlen_k, local.causal, scale)
    lse_TH = lse_TH.to(accumulation_dtype(q_THD.dtype))
    recv_N2GD = None if pending is None else pending.wait()
    call = schedule.batched.call if schedule.batched else None
    if call is not None:
        k, v = _keys(recv_N2GD)
        o, lse = call_forward(backend, q_THD, k, v, call, scale)
        merge_into(out_THD, lse_TH, call.q_index, o, lse.to(lse_TH.dtype), span=call.q_span)
    return (out_THD, lse_TH, recv_N2GD) if keep_received else (out_THD, lse_TH)


def batched_backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH, schedule, transport,
                     backend, scale, keep_received=False, received_N2GD=None):
    """-> (dq, dk, dv) in the dtypes of q, k, v. keep_received: the forward kept its buffer,
    `received_N2GD` (on every rank of the ring: nobody sends again); then the received
    keys' backward runs first, so that their gradients travel while the local backward
    runs. Else the exchange is redone while the local backward runs, and the gradients
    travel after."""
    _check(schedule)
    batched = schedule.batched
    local = schedule.local

    def local_backward():
        return backend.backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH,
                                local.cu_seqlens_q, local.cu_seqlens_k, local.max_seqlen_q,
                                local.max_seqlen_k, local.causal, scale)

    if batched is None:
        return local_backward()

    def received_backward(recv_N2GD):
        """(dq of the call's rows or None, the transfer of the received rows' gradients)."""
        call, gq, grad_N2GD = batched.call, None, None
        if call is not None:
            k, v = _keys(recv_N2GD)
            gq, gk, gv = call_backward(backend, dout_THD, q_THD, k, v, out_THD, lse_TH, call,
                                       scale)
            grad_N2GD = torch.stack([gk, gv], dim=1)  # [N, 2, G, D], the buffer's rows
        # Back to their owners as the kernel made them (each received row is read once);
        # the gradients of the rows this group sent come here.
        return gq, transport.start_all_grad(schedule, grad_N2GD, k_TGD.shape[1:],
                                            k_TGD.dtype, q_THD.device)

    if keep_received:
        gq, returning = received_backward(received_N2GD)
        dq, dk, dv = local_backward()
    else:
        pending = _start_kv(k_TGD, v_TGD, schedule, transport)
        dq, dk, dv = local_backward()
        gq, returning = received_backward(pending.wait())
    if gq is not None:  # two terms per row: one sum, rounded once (in float32 for half
        span = batched.call.q_span  # precision)
        if span is not None:
            dq[span[0]:span[1]].add_(gq)
        else:
            dq.index_add_(0, batched.call.q_index, gq)
    return (dq,) + _land(returning.wait(), dk, dv, batched, k_TGD.dtype)


def _land(returned_S2GD, dk, dv, batched, dtype):
    """(dk, dv) with the gradients returned for the rows this group sent added."""
    if returned_S2GD is None or not returned_S2GD.numel():
        return dk, dv
    if batched.send_span is not None:  # each row sent once: one add each, computed in float32
        start, stop = batched.send_span  # for half precision and rounded once into dk, dv
        dk[start:stop].add_(returned_S2GD[:, 0])
        dv[start:stop].add_(returned_S2GD[:, 1])
        return dk, dv
    # A row sent several times (to several peers, or to two query pieces of one) gets several
    # gradients: summed by index in float32 (for half precision) with the local one, then
    # rounded once.
    acc = accumulation_dtype(dtype)
    dkv_2TGD = torch.empty((2,) + tuple(dk.shape), dtype=acc, device=dk.device)
    dkv_2TGD[0].copy_(dk)  # cast as they are copied: no half-precision stack first
    dkv_2TGD[1].copy_(dv)
    dkv_2TGD.index_add_(1, batched.send_index, returned_S2GD.transpose(0, 1).to(acc))
    dkv_2TGD = dkv_2TGD.to(dtype)
    return dkv_2TGD[0], dkv_2TGD[1]
