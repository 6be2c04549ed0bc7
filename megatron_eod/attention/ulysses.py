"""Ulysses all-to-alls: sequence-sharded <-> head-sharded, q/k/v in ONE fused exchange.

One job: autograd functions that move attention inputs from "each rank holds n tokens, all
heads" to "each rank holds the group's u*n tokens, H/u heads" (and the output back), before
any flattening to varlen, so the varlen call sees whole documents. q, k and v travel in one
all_to_all (their head slices packed side by side); key/value heads are repeated only as far
as the degree needs (GQA): by u / gcd(G, u), so each rank gets whole key/value heads.

Shape key: n = local tokens, u = Ulysses degree, H = query heads, G = key/value heads,
D = head dim, c = channels packed per rank (H/u + 2 G/u).
"""

from __future__ import annotations

import math

import torch

from megatron_eod.attention.comm import all_to_all_equal

__all__ = ["kv_repeat_for_degree", "seq_to_head", "head_to_seq"]


def kv_repeat_for_degree(q_heads: int, kv_heads: int, degree: int) -> int:
    """How many times each key/value head must be repeated for `degree` ranks (>= 1)."""
    if q_heads % degree:
        raise ValueError(f"attention heads ({q_heads}, after tensor parallelism) must be "
                         f"divisible by the Ulysses degree ({degree})")
    if q_heads % kv_heads:
        raise ValueError(f"attention heads ({q_heads}) must be divisible by key/value heads "
                         f"({kv_heads}, --num-query-groups)")
    repeat = degree // math.gcd(kv_heads, degree)
    if q_heads % (kv_heads * repeat):
        raise ValueError(f"key/value heads ({kv_heads}) cannot be spread over Ulysses degree "
                         f"{degree} with {q_heads} attention heads")
    return repeat


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_nHD, k_nGD, v_nGD, group, degree):
        n, H, D = q_nHD.shape
        G = k_nGD.shape[1]
        hq, hk = H // degree, G // degree
        packed_nuCD = torch.cat([q_nHD.reshape(n, degree, hq, D), k_nGD.reshape(n, degree, hk, D),
                                 v_nGD.reshape(n, degree, hk, D)], dim=2)
        recv_unCD = all_to_all_equal(packed_nuCD.transpose(0, 1), group)
        recv_TCD = recv_unCD.reshape(degree * n, hq + 2 * hk, D)
        ctx.group, ctx.degree, ctx.dims = group, degree, (n, hq, hk, D)
        return (recv_TCD[:, :hq].contiguous(), recv_TCD[:, hq:hq + hk].contiguous(),
                recv_TCD[:, hq + hk:].contiguous())

    @staticmethod
    def backward(ctx, dq_THD, dk_TGD, dv_TGD):
        n, hq, hk, D = ctx.dims
        u = ctx.degree
        packed_unCD = torch.cat([dq_THD, dk_TGD, dv_TGD], dim=1).reshape(u, n, hq + 2 * hk, D)
        back_nuCD = all_to_all_equal(packed_unCD, ctx.group).transpose(0, 1)
        dq = back_nuCD[:, :, :hq].reshape(n, u * hq, D)
        dk = back_nuCD[:, :, hq:hq + hk].reshape(n, u * hk, D)
        dv = back_nuCD[:, :, hq + hk:].reshape(n, u * hk, D)
        return dq, dk, dv, None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_THD, group, degree):
        T, hq, D = out_THD.shape
        n = T // degree
        recv_unHD = all_to_all_equal(out_THD.reshape(degree, n, hq, D), group)
        ctx.group, ctx.degree = group, degree
        return recv_unHD.transpose(0, 1).reshape(n, degree * hq, D)

    @staticmethod
    def backward(ctx, dout_nHD):
        n, H, D = dout_nHD.shape
        u = ctx.degree
        send_unHD = dout_nHD.reshape(n, u, H // u, D).transpose(0, 1)
        return all_to_all_equal(send_unHD, ctx.group).reshape(u * n, H // u, D), None, None


def seq_to_head(q_nHD, k_nGD, v_nGD, group, degree):
    """-> q [u*n, H/u, D], k/v [u*n, G'/u, D] (G' = G * repeat), tokens in group order."""
    repeat = kv_repeat_for_degree(q_nHD.shape[1], k_nGD.shape[1], degree)
    if repeat > 1:
        k_nGD = k_nGD.repeat_interleave(repeat, dim=1)
        v_nGD = v_nGD.repeat_interleave(repeat, dim=1)
    return _SeqToHead.apply(q_nHD, k_nGD, v_nGD, group, degree)


def head_to_seq(out_THD, group, degree):
    """[u*n, H/u, D] -> [n, H, D]: this rank's tokens, all heads."""
    return _HeadToSeq.apply(out_THD, group, degree)
