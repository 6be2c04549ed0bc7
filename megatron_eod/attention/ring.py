"""Document-aware Ring attention: an autograd function over a group's `GroupSchedule`.

One job: exact causal document-masked attention for the rows a ring group holds, computing
only (query piece, key piece) pairs of the same document, with either executor:
* "batched" (default; batched.py): all of a group's transfers in one batched p2p call while
  the local call runs, then one call over everything received and one log-sum-exp merge;
  "batched-keep": the same, the received rows saved for the backward instead of sent again;
* "steps" (here): the local call over the local rows as they are (no gather; it initialises
  out and lse), then for each ring step the peer's needed key/value rows arrive (the next
  step's transfer is started before this step's compute) and the partial result is merged by
  log-sum-exp. Backward: the same transfers again (only q, k and v (stacked when some step
  sends them), out and lse are saved, so memory stays at one or two steps' buffers), block
  gradients from the final out/lse, and the key/value gradients of received rows go back to
  their owners. Float32 accumulators exist only when some step has data.
Both compute the same pairs; "steps" holds less received data at once and overlaps every
transfer with compute, "batched" makes 2 kernel calls per direction instead of up to R.
Where some group would receive more than kv_batched.MAX_RECEIVED_PER_ROW x its rows, the
plan gives no schedule a batched form (`CPPlan.batched_ring`, the same on every rank: the
two executors' messages differ in layout, so the ranks of a ring never mix them) and the
steps run under "batched" and "batched-keep" too.

The executors take a transport (who moves the step data): `GroupTransport` (transport.py)
over a process group here, or the in-process one of simulate.py that runs every group on one
device, so single-GPU checks and benchmarks exercise this very code.

With a schedule of one group (Ulysses) this is plain local varlen attention.

Shape key: T = local rows, H = query heads, G = key/value heads, D = head dim, N = received rows;
2 = keys and values stacked first, so that k and v of a received run are contiguous views.
"""

from __future__ import annotations

import warnings

import torch

from megatron_eod.attention.backends import accumulation_dtype
from megatron_eod.attention.batched import (batched_backward, batched_forward, call_backward,
                                            call_forward, runs_batched)
from megatron_eod.attention.comm import warm_up
from megatron_eod.attention.lse import merge_into
from megatron_eod.attention.transport import GroupTransport

__all__ = ["ring_attention", "ring_forward", "ring_backward", "stack_kv", "RING_EXCHANGES",
           "BATCHED", "check_ring_exchange", "executor_for"]

# How a group's ring steps run: "batched" (batched.py: all transfers at once, one call over
# everything received, one merge; the backward exchanges again), "batched-keep" (the same,
# with the received key/values kept from the forward for the backward: no second exchange,
# and the gradients' return overlaps the local backward, for the memory of the received rows
# per layer) or "steps" (this module: one transfer, call and merge per step, each transfer
# overlapping the previous step's compute).
RING_EXCHANGES = ("batched", "batched-keep", "steps")
BATCHED = ("batched", "batched-keep")


def check_ring_exchange(exchange) -> None:
    """ValueError naming the argument and its flag unless `exchange` is in RING_EXCHANGES."""
    if exchange not in RING_EXCHANGES:
        raise ValueError(f"ring_exchange (--cp-ring-exchange) must be one of {RING_EXCHANGES}, "
                         f"got {exchange!r}")


def executor_for(schedule, exchange: str) -> str:
    """The executor that runs `schedule` under `exchange`: "batched" and "batched-keep" fall
    back to "steps" where the plan left the batched forms out (CPPlan.batched_ring, the same
    on every rank)."""
    return exchange if exchange in BATCHED and runs_batched(schedule) else "steps"


def _keys(kv_2NGD, call):
    """(k, v) of a call's key rows: contiguous views of the received buffer when they are one
    run (most ring steps), else one gather for both."""
    if call.k_span is not None:
        start, stop = call.k_span
        return kv_2NGD[0, start:stop], kv_2NGD[1, start:stop]
    kv = kv_2NGD[:, call.k_index]  # [2, n, G, D], contiguous
    return kv[0], kv[1]


def stack_kv(k_TGD, v_TGD, schedule):
    """[2, T, G, D]: what ring steps send (k and v in one message), made once per call and
    kept for the backward; None when the schedule has no steps."""
    return torch.stack([k_TGD, v_TGD]) if schedule.steps else None


def ring_forward(q_THD, k_TGD, v_TGD, schedule, transport, backend, scale, kv_2TGD=None):
    """-> (out [T, H, D] in q's dtype, lse [T, H] float32/float64). kv_2TGD: stack_kv(k, v),
    when the caller has it."""
    steps = schedule.steps
    if kv_2TGD is None:
        kv_2TGD = stack_kv(k_TGD, v_TGD, schedule)
    pending = transport.start_kv(steps[0], kv_2TGD) if steps else None
    local = schedule.local  # over the local rows in order: no gather
    out_THD, lse_TH = backend.forward(q_THD, k_TGD, v_TGD, local.cu_seqlens_q,
                                      local.cu_seqlens_k, local.max_seqlen_q,
                                      local.max_seqlen_k, local.causal, scale)
    acc = accumulation_dtype(q_THD.dtype)
    lse_TH = lse_TH.to(acc)
    if any(step.call is not None for step in steps):
        out_THD = out_THD.to(acc)
    for i, step in enumerate(steps):
        kv_2NGD = pending.wait()
        pending = transport.start_kv(steps[i + 1], kv_2TGD) if i + 1 < len(steps) else None
        call = step.call
        if call is None:
            continue
        k, v = _keys(kv_2NGD, call)
        o, lse = call_forward(backend, q_THD, k, v, call, scale)
        merge_into(out_THD, lse_TH, call.q_index, o, lse.to(acc), span=call.q_span)
    return out_THD.to(q_THD.dtype), lse_TH


def ring_backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH, schedule, transport,
                  backend, scale, kv_2TGD=None):
    """-> (dq, dk, dv) in the dtypes of q, k, v."""
    steps = schedule.steps
    acc = accumulation_dtype(q_THD.dtype)
    local = schedule.local
    dq, dk, dv = backend.backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH,
                                  local.cu_seqlens_q, local.cu_seqlens_k, local.max_seqlen_q,
                                  local.max_seqlen_k, local.causal, scale)
    if not steps:
        return dq, dk, dv
    if kv_2TGD is None:
        kv_2TGD = stack_kv(k_TGD, v_TGD, schedule)
    pending = transport.start_kv(steps[0], kv_2TGD)
    if any(step.call is not None for step in steps):
        dq = dq.to(acc)
    sends = any(step.send_index.numel() for step in steps)
    dkv_2TGD = torch.stack([dk, dv]).to(acc) if sends else None
    returning = []  # (pending gradient exchange, the step)
    for i, step in enumerate(steps):
        kv_2NGD = pending.wait()
        pending = transport.start_kv(steps[i + 1], kv_2TGD) if i + 1 < len(steps) else None
        grad_2NGD = None
        call = step.call
        if call is not None:
            rows, span = call.q_index, call.q_span
            k, v = _keys(kv_2NGD, call)
            gq, gk, gv = call_backward(backend, dout_THD, q_THD, k, v, out_THD, lse_TH, call,
                                       scale)
            if span is not None:
                dq[span[0]:span[1]].add_(gq)
            else:
                dq.index_add_(0, rows, gq.to(acc))
            grad_2NGD = _key_grads(gk, gv, call, step.recv_count, acc)
        # Gradients travel back the way the keys came: to recv_from, from send_to.
        returning.append((transport.start_grad(step, grad_2NGD, kv_2TGD.shape[2:], acc,
                                               q_THD.device), step))
        if len(returning) > 1:  # keep at most one step's gradients in flight
            _land(returning.pop(0), dkv_2TGD)
    for item in returning:
        _land(item, dkv_2TGD)
    if dkv_2TGD is not None:
        dkv_2TGD = dkv_2TGD.to(k_TGD.dtype)  # one cast for both
        dk, dv = dkv_2TGD[0], dkv_2TGD[1]
    return dq.to(q_THD.dtype), dk.to(k_TGD.dtype), dv.to(v_TGD.dtype)


def _key_grads(gk_nGD, gv_nGD, call, recv_count, acc):
    """[2, N, G, D] gradients of a step's received rows in `acc`: the kernel's where the call
    reads every received row once, in order (most steps); else rows read by several query
    pieces (two pieces of one document after them) summed by index."""
    if call.k_span == (0, recv_count):
        grad = torch.empty((2, recv_count) + tuple(gk_nGD.shape[1:]), dtype=acc,
                           device=gk_nGD.device)
        grad[0].copy_(gk_nGD)
        grad[1].copy_(gv_nGD)
        return grad
    grad = torch.zeros((2, recv_count) + tuple(gk_nGD.shape[1:]), dtype=acc,
                       device=gk_nGD.device)
    grad.index_add_(1, call.k_index, torch.stack([gk_nGD, gv_nGD]).to(acc))
    return grad


def _land(item, dkv_2TGD):
    pending, step = item
    received = pending.wait()
    if received is not None:
        span = step.send_span
        if span is not None:
            dkv_2TGD[:, span[0]:span[1]].add_(received)
        else:
            dkv_2TGD.index_add_(1, step.send_index, received)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, k_TGD, v_TGD, schedule, group, backend, scale, exchange,
                concurrent_calls):
        warm_up(group, q_THD.device)  # before the group's first batched p2p call (NCCL rule)
        transport = GroupTransport(group)
        exchange = executor_for(schedule, exchange)
        if exchange in BATCHED:
            if schedule.batched is not None and schedule.batched.sends:  # sent as views of
                k_TGD, v_TGD = k_TGD.contiguous(), v_TGD.contiguous()  # runs: one copy, if any
            out_THD, lse_TH, *kept = batched_forward(q_THD, k_TGD, v_TGD, schedule, transport,
                                                     backend, scale,
                                                     keep_received=exchange != "batched",
                                                     concurrent_calls=concurrent_calls)
            kv = (k_TGD, v_TGD, *kept)  # and the received buffer when kept
        else:
            kv_2TGD = stack_kv(k_TGD, v_TGD, schedule)
            out_THD, lse_TH = ring_forward(q_THD, k_TGD, v_TGD, schedule, transport, backend,
                                           scale, kv_2TGD)
            # The stacked copy is saved instead of k and v: the backward needs no re-stacking.
            kv = (k_TGD, v_TGD) if kv_2TGD is None else (kv_2TGD,)
        ctx.save_for_backward(q_THD, out_THD, lse_TH, *kv)
        ctx.schedule, ctx.transport, ctx.backend, ctx.scale = schedule, transport, backend, scale
        ctx.exchange, ctx.concurrent_calls = exchange, concurrent_calls
        return out_THD

    @staticmethod
    def backward(ctx, dout_THD):
        q_THD, out_THD, lse_TH, *kv = ctx.saved_tensors
        dout_THD = dout_THD.contiguous()
        if ctx.exchange in BATCHED:
            k_TGD, v_TGD, *kept = kv
            dq, dk, dv = batched_backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH,
                                          ctx.schedule, ctx.transport, ctx.backend, ctx.scale,
                                          bool(kept), *kept,
                                          concurrent_calls=ctx.concurrent_calls)
            return dq, dk, dv, None, None, None, None, None, None
        kv_2TGD = kv[0] if len(kv) == 1 else None
        k_TGD, v_TGD = (kv_2TGD[0], kv_2TGD[1]) if kv_2TGD is not None else kv
        dq, dk, dv = ring_backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH,
                                   ctx.schedule, ctx.transport, ctx.backend, ctx.scale,
                                   kv_2TGD)
        return dq, dk, dv, None, None, None, None, None, None


_SAID = set()


def _say_unfused(exchange):
    """Once per process: a fused-forward backend (--cp-fused-forward) on a schedule the
    steps executor runs, whose forward is then the base kernel's calls."""
    if exchange in _SAID:
        return
    _SAID.add(exchange)
    why = ("--cp-ring-exchange steps" if exchange not in BATCHED else
           "a rank would receive over 4x its own rows at once, so this plan has no batched "
           "form")
    warnings.warn(f"--cp-fused-forward: a micro-batch's attention runs the steps executor "
                  f"({why}); its forward is not fused (said once)")


def ring_attention(q_THD, k_TGD, v_TGD, schedule, group, backend, softmax_scale,
                   exchange="batched", concurrent_calls=False):
    """Document-masked causal attention of the local rows (see module docstring);
    `exchange`: one of RING_EXCHANGES (checked by the caller, api.py); concurrent_calls: the
    batched executors run the local call (in two parts where the kernel writes into given
    tensors) beside the received keys' call on a GPU (batched.py, streams.py; the steps
    executor ignores it)."""
    if hasattr(backend, "forward_tiles") and executor_for(schedule, exchange) == "steps":
        _say_unfused(exchange)
    return _RingAttention.apply(q_THD, k_TGD, v_TGD, schedule, group, backend, softmax_scale,
                                exchange, concurrent_calls)
