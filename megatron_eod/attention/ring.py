"""Document-aware Ring attention: an autograd function over a group's `GroupSchedule`.

One job: exact causal document-masked attention for the rows a ring group holds, computing
only (query piece, key piece) pairs of the same document. Forward: the local call, then for
each ring step the peer's needed key/value rows arrive (the next step's transfer is started
before this step's compute) and the partial result is merged by log-sum-exp. Backward: the
same transfers again (nothing but q, k, v, out and lse is saved, so memory stays at one or two
steps' buffers), block gradients from the final out/lse, and the key/value gradients of
received rows go back to their owners.

With a schedule of one group (Ulysses) this is plain local varlen attention.

Shape key: T = local rows, H = query heads, G = key/value heads, D = head dim, N = received rows.
"""

from __future__ import annotations

import torch

from megatron_eod.attention.comm import exchange
from megatron_eod.attention.lse import merge_into

__all__ = ["ring_attention"]


# Every rank walks ALL ring steps in the same order, even those where it sends and receives
# nothing: transfers between a pair of ranks are then started in the same order on both
# sides, which NCCL needs (it matches point-to-point messages by order, not by tag).
_GRAD_TAG = 1 << 16  # tags tell key/value transfers from gradient returns (gloo uses them)


def _start_kv(step, kv_T2GD, group):
    send = kv_T2GD[step.send_index] if step.send_index.numel() else None
    shape = (step.recv_count,) + tuple(kv_T2GD.shape[1:])
    return exchange(send, step.send_to, shape, step.recv_from, group, kv_T2GD.dtype,
                    kv_T2GD.device, tag=step.step)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, k_TGD, v_TGD, schedule, group, backend, scale):
        acc = torch.float64 if q_THD.dtype == torch.float64 else torch.float32
        out_THD = torch.zeros(q_THD.shape, dtype=acc, device=q_THD.device)
        lse_TH = torch.full(q_THD.shape[:2], float("-inf"), dtype=acc, device=q_THD.device)
        kv_T2GD = torch.stack([k_TGD, v_TGD], dim=1)
        steps = schedule.steps
        pending = _start_kv(steps[0], kv_T2GD, group) if steps else None

        local = schedule.local
        o, lse = backend.forward(q_THD[local.q_index], k_TGD[local.k_index],
                                 v_TGD[local.k_index], local.cu_seqlens_q, local.cu_seqlens_k,
                                 local.max_seqlen_q, local.max_seqlen_k, True, scale)
        merge_into(out_THD, lse_TH, local.q_index, o, lse.to(acc))
        for i, step in enumerate(steps):
            kv_N2GD = pending.wait()
            pending = _start_kv(steps[i + 1], kv_T2GD, group) if i + 1 < len(steps) else None
            call = step.call
            if call is None:
                continue
            o, lse = backend.forward(q_THD[call.q_index], kv_N2GD[call.k_index, 0],
                                     kv_N2GD[call.k_index, 1], call.cu_seqlens_q,
                                     call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k,
                                     False, scale)
            merge_into(out_THD, lse_TH, call.q_index, o, lse.to(acc))
        out_THD = out_THD.to(q_THD.dtype)
        ctx.save_for_backward(q_THD, k_TGD, v_TGD, out_THD, lse_TH)
        ctx.schedule, ctx.group, ctx.backend, ctx.scale = schedule, group, backend, scale
        return out_THD

    @staticmethod
    def backward(ctx, dout_THD):
        q_THD, k_TGD, v_TGD, out_THD, lse_TH = ctx.saved_tensors
        schedule, group, backend, scale = ctx.schedule, ctx.group, ctx.backend, ctx.scale
        acc = torch.float64 if q_THD.dtype == torch.float64 else torch.float32
        dq = torch.zeros(q_THD.shape, dtype=acc, device=q_THD.device)
        dkv_T2GD = torch.zeros((k_TGD.shape[0], 2) + tuple(k_TGD.shape[1:]), dtype=acc,
                               device=q_THD.device)
        kv_T2GD = torch.stack([k_TGD, v_TGD], dim=1)
        steps = schedule.steps
        pending = _start_kv(steps[0], kv_T2GD, group) if steps else None

        def block(call, k_src, v_src, causal):
            rows = call.q_index
            return backend.backward(dout_THD[rows], q_THD[rows], k_src, v_src, out_THD[rows],
                                    lse_TH[rows], call.cu_seqlens_q, call.cu_seqlens_k,
                                    call.max_seqlen_q, call.max_seqlen_k, causal, scale)

        local = schedule.local
        gq, gk, gv = block(local, k_TGD[local.k_index], v_TGD[local.k_index], True)
        dq.index_add_(0, local.q_index, gq.to(acc))
        dkv_T2GD[:, 0].index_add_(0, local.k_index, gk.to(acc))
        dkv_T2GD[:, 1].index_add_(0, local.k_index, gv.to(acc))
        returning = []  # (exchange, send_index) of key/value gradients coming back
        for i, step in enumerate(steps):
            kv_N2GD = pending.wait()
            pending = _start_kv(steps[i + 1], kv_T2GD, group) if i + 1 < len(steps) else None
            grad_N2GD = None
            if step.call is not None:
                call = step.call
                gq, gk, gv = block(call, kv_N2GD[call.k_index, 0], kv_N2GD[call.k_index, 1],
                                   False)
                dq.index_add_(0, call.q_index, gq.to(acc))
                grad_N2GD = torch.zeros((step.recv_count,) + tuple(kv_N2GD.shape[1:]),
                                        dtype=acc, device=q_THD.device)
                grad_N2GD[:, 0].index_add_(0, call.k_index, gk.to(acc))
                grad_N2GD[:, 1].index_add_(0, call.k_index, gv.to(acc))
            # Gradients travel back the way the keys came: to recv_from, from send_to.
            back_shape = (step.send_index.numel(),) + tuple(dkv_T2GD.shape[1:])
            returning.append((exchange(grad_N2GD, step.recv_from, back_shape, step.send_to,
                                       group, acc, q_THD.device, tag=_GRAD_TAG + step.step),
                              step.send_index))
            if len(returning) > 1:  # keep at most one step's gradients in flight
                _land(returning.pop(0), dkv_T2GD)
        for item in returning:
            _land(item, dkv_T2GD)
        return (dq.to(q_THD.dtype), dkv_T2GD[:, 0].to(k_TGD.dtype),
                dkv_T2GD[:, 1].to(v_TGD.dtype), None, None, None, None)


def _land(item, dkv_T2GD):
    pending, send_index = item
    received = pending.wait()
    if received is not None:
        dkv_T2GD.index_add_(0, send_index, received)


def ring_attention(q_THD, k_TGD, v_TGD, schedule, group, backend, softmax_scale):
    """Document-masked causal attention of the local rows (see module docstring)."""
    return _RingAttention.apply(q_THD, k_TGD, v_TGD, schedule, group, backend, softmax_scale)
