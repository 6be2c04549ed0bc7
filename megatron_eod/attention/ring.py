"""Document-aware Ring attention: an autograd function over a group's `GroupSchedule`.

One job: exact causal document-masked attention for the rows a ring group holds, computing
only (query piece, key piece) pairs of the same document. Forward: the local call over the
local rows as they are (no gather; it initialises out and lse), then for each ring step the
peer's needed key/value rows arrive (the next step's transfer is started before this step's
compute) and the partial result is merged by log-sum-exp. Backward: the same transfers again
(nothing but q, k, v, out and lse is saved, so memory stays at one or two steps' buffers),
block gradients from the final out/lse, and the key/value gradients of received rows go back
to their owners. Float32 accumulators exist only when some step has data.

`ring_forward`/`ring_backward` take a transport (who moves the step data): `GroupTransport`
over a process group here, or the in-process one of simulate.py that runs every group on one
device, so single-GPU checks and benchmarks exercise this very code.

With a schedule of one group (Ulysses) this is plain local varlen attention.

Shape key: T = local rows, H = query heads, G = key/value heads, D = head dim, N = received rows.
"""

from __future__ import annotations

import torch

from megatron_eod.attention.backends import accumulation_dtype
from megatron_eod.attention.comm import exchange, warm_up
from megatron_eod.attention.lse import merge_into

__all__ = ["ring_attention", "ring_forward", "ring_backward", "GroupTransport"]


# Every rank walks ALL ring steps in the same order, even those where it sends and receives
# nothing: transfers between a pair of ranks are then started in the same order on both
# sides, which NCCL needs (it matches point-to-point messages by order, not by tag).
_GRAD_TAG = 1 << 16  # tags tell key/value transfers from gradient returns (gloo uses them)


class GroupTransport:
    """Ring step transfers over a process group (ranks of `group` are ring groups)."""

    def __init__(self, group):
        self.group = group

    def start_kv(self, step, kv_T2GD):
        send = kv_T2GD[step.send_index] if step.send_index.numel() else None
        shape = (step.recv_count,) + tuple(kv_T2GD.shape[1:])
        return exchange(send, step.send_to, shape, step.recv_from, self.group, kv_T2GD.dtype,
                        kv_T2GD.device, tag=step.step)

    def start_grad(self, step, grad_N2GD, row_shape, dtype, device):
        """Send the gradients of rows received at `step` back; receive those of rows sent."""
        shape = (step.send_index.numel(),) + tuple(row_shape)
        return exchange(grad_N2GD, step.recv_from, shape, step.send_to, self.group, dtype,
                        device, tag=_GRAD_TAG + step.step)


def ring_forward(q_THD, k_TGD, v_TGD, schedule, transport, backend, scale):
    """-> (out [T, H, D] in q's dtype, lse [T, H] float32/float64)."""
    steps = schedule.steps
    kv_T2GD = torch.stack([k_TGD, v_TGD], dim=1) if steps else None
    pending = transport.start_kv(steps[0], kv_T2GD) if steps else None
    local = schedule.local  # over the local rows in order: no gather
    out_THD, lse_TH = backend.forward(q_THD, k_TGD, v_TGD, local.cu_seqlens_q,
                                      local.cu_seqlens_k, local.max_seqlen_q,
                                      local.max_seqlen_k, local.causal, scale)
    acc = accumulation_dtype(q_THD.dtype)
    lse_TH = lse_TH.to(acc)
    if any(step.call is not None for step in steps):
        out_THD = out_THD.to(acc)
    for i, step in enumerate(steps):
        kv_N2GD = pending.wait()
        pending = transport.start_kv(steps[i + 1], kv_T2GD) if i + 1 < len(steps) else None
        call = step.call
        if call is None:
            continue
        o, lse = backend.forward(q_THD[call.q_index], kv_N2GD[call.k_index, 0],
                                 kv_N2GD[call.k_index, 1], call.cu_seqlens_q,
                                 call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k,
                                 call.causal, scale)
        merge_into(out_THD, lse_TH, call.q_index, o, lse.to(acc))
    return out_THD.to(q_THD.dtype), lse_TH


def ring_backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH, schedule, transport,
                  backend, scale):
    """-> (dq, dk, dv) in the dtypes of q, k, v."""
    steps = schedule.steps
    acc = accumulation_dtype(q_THD.dtype)
    local = schedule.local
    dq, dk, dv = backend.backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH,
                                  local.cu_seqlens_q, local.cu_seqlens_k, local.max_seqlen_q,
                                  local.max_seqlen_k, local.causal, scale)
    if not steps:
        return dq, dk, dv
    kv_T2GD = torch.stack([k_TGD, v_TGD], dim=1)
    pending = transport.start_kv(steps[0], kv_T2GD)
    if any(step.call is not None for step in steps):
        dq = dq.to(acc)
    sends = any(step.send_index.numel() for step in steps)
    dkv_T2GD = torch.stack([dk, dv], dim=1).to(acc) if sends else None
    returning = []  # (pending gradient exchange, send_index)
    for i, step in enumerate(steps):
        kv_N2GD = pending.wait()
        pending = transport.start_kv(steps[i + 1], kv_T2GD) if i + 1 < len(steps) else None
        grad_N2GD = None
        call = step.call
        if call is not None:
            rows = call.q_index
            gq, gk, gv = backend.backward(dout_THD[rows], q_THD[rows], kv_N2GD[call.k_index, 0],
                                          kv_N2GD[call.k_index, 1], out_THD[rows], lse_TH[rows],
                                          call.cu_seqlens_q, call.cu_seqlens_k,
                                          call.max_seqlen_q, call.max_seqlen_k, call.causal,
                                          scale)
            dq.index_add_(0, rows, gq.to(acc))
            grad_N2GD = torch.zeros((step.recv_count,) + tuple(kv_N2GD.shape[1:]), dtype=acc,
                                    device=q_THD.device)
            grad_N2GD[:, 0].index_add_(0, call.k_index, gk.to(acc))
            grad_N2GD[:, 1].index_add_(0, call.k_index, gv.to(acc))
        # Gradients travel back the way the keys came: to recv_from, from send_to.
        returning.append((transport.start_grad(step, grad_N2GD, kv_T2GD.shape[1:], acc,
                                               q_THD.device), step.send_index))
        if len(returning) > 1:  # keep at most one step's gradients in flight
            _land(returning.pop(0), dkv_T2GD)
    for item in returning:
        _land(item, dkv_T2GD)
    if dkv_T2GD is not None:
        dk, dv = dkv_T2GD[:, 0], dkv_T2GD[:, 1]
    return dq.to(q_THD.dtype), dk.to(k_TGD.dtype), dv.to(v_TGD.dtype)


def _land(item, dkv_T2GD):
    pending, send_index = item
    received = pending.wait()
    if received is not None:
        dkv_T2GD.index_add_(0, send_index, received)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, k_TGD, v_TGD, schedule, group, backend, scale):
        warm_up(group, q_THD.device)  # before the group's first batched p2p call (NCCL rule)
        transport = GroupTransport(group)
        out_THD, lse_TH = ring_forward(q_THD, k_TGD, v_TGD, schedule, transport, backend, scale)
        ctx.save_for_backward(q_THD, k_TGD, v_TGD, out_THD, lse_TH)
        ctx.schedule, ctx.transport, ctx.backend, ctx.scale = schedule, transport, backend, scale
        return out_THD

    @staticmethod
    def backward(ctx, dout_THD):
        q_THD, k_TGD, v_TGD, out_THD, lse_TH = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout_THD.contiguous(), q_THD, k_TGD, v_TGD, out_THD, lse_TH,
                                   ctx.schedule, ctx.transport, ctx.backend, ctx.scale)
        return dq, dk, dv, None, None, None, None


def ring_attention(q_THD, k_TGD, v_TGD, schedule, group, backend, softmax_scale):
    """Document-masked causal attention of the local rows (see module docstring)."""
    return _RingAttention.apply(q_THD, k_TGD, v_TGD, schedule, group, backend, softmax_scale)
