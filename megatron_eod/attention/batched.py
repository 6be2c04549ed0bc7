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

With concurrent_calls (on a GPU) the local call runs on a side stream beside the received
keys' call, each filling the other's tail (streams.py); where the kernel writes into given
tensors, in its two parts (plan/local_split.py): the part with the longest document first,
the received keys' call, the other part, on three streams, writing into slices of one out
(one dq, dk, dv).

A message is a run of the sender's local rows (kv_batched.py splits messages there), so its
keys and values leave as views of k and v, nothing gathered or stacked to send; they land in
the two halves of one [2, N, G, D] buffer, so the call's k and v are contiguous views of it.
The gradients go back the same way: views of the kernel's dk, dv of the received rows, into
one [2, S, G, D] buffer. (Sent views must be contiguous: ring.py makes k and v so where the
group sends, a no-op for the Ulysses all-to-all's output, one copy of v per forward where
Megatron hands it over as a view of its fused qkv projection.)

Shape key: T = local rows, H = query heads, G = key/value heads, D = head dim, S = rows sent,
N = rows received, W = rows a sum of returned gradients covers; 2 = keys and values.
"""

from __future__ import annotations

import torch

from megatron_eod.attention.backends import accumulation_dtype
from megatron_eod.attention import fused
from megatron_eod.attention.lse import merge_into
from megatron_eod.attention.streams import Beside, fork_point

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


def _keys(recv_2NGD):
    """(k, v) of the call's key rows, which are the received buffer (kv_batched.py): two
    contiguous [N, G, D] views."""
    return recv_2NGD[0], recv_2NGD[1]


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


def _local_parts(schedule, concurrent_calls, backend, writes):
    """The local call's two parts (plan/local_split.py) where they run: with
    concurrent_calls, where the kernel writes into given tensors (its attribute `writes`,
    "writes_out" or "writes_grads", True: else joining the parts' results would cost a copy
    of them) and the call splits; else None."""
    in_place = getattr(backend, writes, False)  # a caller's own backend may not say
    return schedule.local_parts if concurrent_calls and in_place else None


def _empty_like(x):
    """A contiguous tensor like x (what the kernels return), for the parts to write into."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


class _LocalCalls:
    """The local call's kernels, launched around the received keys' call: the whole call
    (on a side stream with concurrent_calls, where there is a received keys' call), or its
    two `parts` (`_local_parts`: the first before the received keys' call on one side
    stream, the other after it on the other, waiting only for what was queued before the
    first). `run(call, rows)` makes a call's kernels over its rows (a slice; None: all)."""

    def __init__(self, run, schedule, device, concurrent_calls, received_call, parts):
        self._run, self._device, self.parts = run, device, parts
        if parts is None:
            self._launched = [Beside(lambda: run(schedule.local, None), device,
                                     concurrent_calls and received_call)]
            return
        self._fork = fork_point(device, True)
        self._launched = [self._beside(self.parts[0], 0, None)]

    def _beside(self, part, which, after):
        rows = slice(*part.q_span)
        return Beside(lambda: self._run(part, rows), self._device, True, which, after)

    def launch_rest(self):
        """After the received keys' call is queued: the second part."""
        if self.parts is not None:
            self._launched.append(self._beside(self.parts[1], 1, self._fork))

    def results(self):
        """The results of the launched calls, in row order; the current stream waits."""
        done = [launched.result() for launched in self._launched]
        if self.parts is not None and self.parts[0].q_span[0] > self.parts[1].q_span[0]:
            done.reverse()
        return done


def _rows(x, rows):
    return x if rows is None else x[rows]


def batched_forward(q_THD, k_TGD, v_TGD, schedule, transport, backend, scale,
                    keep_received=False, concurrent_calls=False):
    """-> (out [T, H, D] in q's dtype, lse [T, H] float32/float64), and with keep_received
    the received [2, N, G, D] buffer too (None without a batched form, empty when nothing
    is received), for `batched_backward(received_2NGD=...)`. concurrent_calls: on a GPU,
    the local call runs on side streams beside the received keys' call (streams.py), in two
    parts where the kernel writes into a given out (`_LocalCalls`)."""
    _check(schedule)
    pending = transport.start_all_kv(schedule, k_TGD, v_TGD) if schedule.batched else None
    if hasattr(backend, "forward_tiles"):
        if schedule.forward_tiles is None:
            raise ValueError("the fused forward (--cp-fused-forward, TritonForwardBackend) "
                             "needs a plan with its tiles: plan_context_parallel(..., "
                             "fused_tiles=True), EodGPTSteps(..., fused_tiles=True)")
        out_THD, lse_TH, recv_2NGD = fused.fused_forward(q_THD, k_TGD, v_TGD, schedule, pending,
                                                         backend, scale, concurrent_calls)
        return (out_THD, lse_TH, recv_2NGD) if keep_received else (out_THD, lse_TH)
    call = schedule.batched.call if schedule.batched else None
    parts = _local_parts(schedule, concurrent_calls, backend, "writes_out")
    out_THD = _empty_like(q_THD) if parts is not None else None

    def local_forward(local, rows):  # over the local rows in order: no gather
        given = {} if rows is None else {"out": out_THD[rows]}
        return backend.forward(_rows(q_THD, rows), _rows(k_TGD, rows), _rows(v_TGD, rows),
                               local.cu_seqlens_q, local.cu_seqlens_k, local.max_seqlen_q,
                               local.max_seqlen_k, local.causal, scale, **given)

    local_calls = _LocalCalls(local_forward, schedule, q_THD.device, concurrent_calls,
                              call is not None, parts)
    recv_2NGD = None if pending is None else pending.wait()
    if call is not None:
        k, v = _keys(recv_2NGD)
        o, lse = call_forward(backend, q_THD, k, v, call, scale)
    local_calls.launch_rest()
    done = local_calls.results()
    if local_calls.parts is None:
        out_THD, lse_TH = done[0]
    else:  # one [H, T] lse of the parts' (the layout of a single call's), one launch
        lse_TH = torch.cat([part_lse.transpose(0, 1) for _, part_lse in done],
                           dim=1).transpose(0, 1)
    lse_TH = lse_TH.to(accumulation_dtype(q_THD.dtype))
    if call is not None:
        merge_into(out_THD, lse_TH, call.q_index, o, lse.to(lse_TH.dtype), span=call.q_span)
    return (out_THD, lse_TH, recv_2NGD) if keep_received else (out_THD, lse_TH)


def batched_backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH, schedule, transport,
                     backend, scale, keep_received=False, received_2NGD=None,
                     concurrent_calls=False):
    """-> (dq, dk, dv) in the dtypes of q, k, v. keep_received: the forward kept its buffer,
    `received_2NGD` (on every rank of the ring: nobody sends again); then the received
    keys' backward runs first, so that their gradients travel while the local backward
    runs. Else the exchange is redone while the local backward runs, and the gradients
    travel after. concurrent_calls: on a GPU, the local backward runs on a side stream
    beside the received keys' backward (queued first, so that both overlap), in two parts
    where the kernel writes into given gradients (`_LocalCalls`)."""
    _check(schedule)
    if fused.fuses_backward(backend, schedule):
        return fused.fused_backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH, schedule,
                                    transport, backend, scale, keep_received, received_2NGD,
                                    concurrent_calls)
    batched = schedule.batched
    parts = _local_parts(schedule, concurrent_calls, backend, "writes_grads")
    grads = None if parts is None else tuple(_empty_like(x) for x in (q_THD, k_TGD, v_TGD))

    def local_backward(local, rows):
        given = {} if rows is None else {"grads": tuple(g[rows] for g in grads)}
        return backend.backward(*(_rows(x, rows) for x in (dout_THD, q_THD, k_TGD, v_TGD,
                                                           out_THD, lse_TH)),
                                local.cu_seqlens_q, local.cu_seqlens_k, local.max_seqlen_q,
                                local.max_seqlen_k, local.causal, scale, **given)

    def launch_local(received_call):
        return _LocalCalls(local_backward, schedule, q_THD.device, concurrent_calls,
                           received_call, parts)

    def local_grads(local_calls):
        done = local_calls.results()
        return grads if local_calls.parts is not None else done[0]

    if batched is None:
        local_calls = launch_local(False)
        local_calls.launch_rest()
        return local_grads(local_calls)

    def received_backward(recv_2NGD):
        """(dq of the call's rows or None, the transfer of the received rows' gradients)."""
        call, gq, gk, gv = batched.call, None, None, None
        if call is not None:
            k, v = _keys(recv_2NGD)
            gq, gk, gv = call_backward(backend, dout_THD, q_THD, k, v, out_THD, lse_TH, call,
                                       scale)
        # Back to their owners as the kernel made them (each received row is read once, and
        # a message's rows are a run of them: views); the gradients of the rows this group
        # sent come here.
        return gq, transport.start_all_grad(schedule, gk, gv, k_TGD.shape[1:], k_TGD.dtype,
                                            q_THD.device)

    beside = concurrent_calls and (batched.call is not None or parts is not None)
    # Kept rows, one stream: the received keys' backward first, so its gradients travel
    # during the local backward. Otherwise the local backward is queued first (beside: on
    # side streams, which must fork before the received keys' work is queued).
    if keep_received and not beside:
        gq, returning = received_backward(received_2NGD)
        local_calls = launch_local(False)
    else:
        pending = None if keep_received else transport.start_all_kv(schedule, k_TGD, v_TGD)
        local_calls = launch_local(batched.call is not None)
        gq, returning = received_backward(received_2NGD if keep_received else pending.wait())
    local_calls.launch_rest()
    dq, dk, dv = local_grads(local_calls)
    if gq is not None:  # two terms per row: one sum, rounded once (in float32 for half
        span = batched.call.q_span  # precision)
        if span is not None:
            dq[span[0]:span[1]].add_(gq)
        else:
            dq.index_add_(0, batched.call.q_index, gq)
    return (dq,) + _land(returning.wait(), dk, dv, batched, k_TGD.dtype)


def _land(returned_2SGD, dk, dv, batched, dtype):
    """(dk, dv) with the gradients returned for the rows this group sent added, each row's
    sum rounded once (in float32 for half precision)."""
    if returned_2SGD is None or not returned_2SGD.numel():
        return dk, dv
    span, landing = batched.send_span, batched.landing
    if span is not None:  # each row sent once, as one run: one add each
        dk[span[0]:span[1]].add_(returned_2SGD[0])
        dv[span[0]:span[1]].add_(returned_2SGD[1])
        return dk, dv
    if landing is None:  # each row sent once: one add each, by index
        dk.index_add_(0, batched.send_index, returned_2SGD[0])
        dv.index_add_(0, batched.send_index, returned_2SGD[1])
        return dk, dv
    # A row sent several times gets several gradients: summed with the local one in float32,
    # then rounded once, over the run that covers the rows sent (or over all rows where that
    # costs no more: then the sum's cast makes the result, one launch less than copying back).
    acc = accumulation_dtype(dtype)
    start, stop = landing.start, landing.stop
    whole = not _land_in_run(dk, stop - start)
    if whole:
        start, stop = 0, dk.shape[0]
    dkv_2WGD = torch.empty((2, stop - start) + tuple(dk.shape[1:]), dtype=acc, device=dk.device)
    dkv_2WGD[0].copy_(dk[start:stop])  # cast as they are copied: no half-precision stack
    dkv_2WGD[1].copy_(dv[start:stop])
    if _add_by_message(dk, batched, acc):  # each message a run: added as it is, in float32
        for m in batched.sends:
            at = m.row - start
            dkv_2WGD[:, at:at + m.stop - m.start].add_(returned_2SGD[:, m.start:m.stop])
    else:  # cast all, then one index_add
        index = batched.send_index if whole else landing.index
        dkv_2WGD.index_add_(1, index, returned_2SGD.to(acc))
    if whole:
        dkv_2WGD = dkv_2WGD.to(dtype)
        return dkv_2WGD[0], dkv_2WGD[1]
    dk[start:stop].copy_(dkv_2WGD[0])
    dv[start:stop].copy_(dkv_2WGD[1])
    return dk, dv


def _add_by_message(dk, batched, acc) -> bool:
    """Whether to add the returned gradients message by message (a launch each; each add
    reads the kernel's dtype and computes in float32) rather than cast them all to float32
    and index_add (2 launches): worth it where the cast's float32 copy of the S rows outweighs
    the launches added. Shapes only."""
    if acc == dk.dtype:  # nothing to cast
        return False
    cast_bytes = 2 * batched.send_index.numel() * dk[0].numel() * acc.itemsize
    return cast_bytes > (len(batched.sends) - 2) * LAUNCH_BYTES


def _land_in_run(dk, run_rows: int) -> bool:
    """Whether to sum over the run covering the rows sent (a launch more than over all T
    rows: two copies back instead of one cast) rather than over all rows: worth it where the
    rows outside it, copied to float32 and back, outweigh that launch. Shapes only."""
    row_bytes = dk[0].numel() * (accumulation_dtype(dk.dtype).itemsize + dk.element_size())
    return 2 * (dk.shape[0] - run_rows) * row_bytes > LAUNCH_BYTES
