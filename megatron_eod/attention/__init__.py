"""Stage 3, attention: `context_parallel_attention` over a `CPPlan` (Ring, Ulysses, Hybrid).

Shape key: n = local tokens (b*s // cp), H = query heads, G = key/value heads, D = head dim.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from megatron_eod.attention.backends import get_backend
from megatron_eod.attention.groups import create_hybrid_groups, get_hybrid_groups
from megatron_eod.attention.hybrid import ulysses_ring_attention
from megatron_eod.attention.ring import ring_attention

__all__ = ["context_parallel_attention", "create_hybrid_groups"]


def _check(q, k, v, plan, group_size):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v must match each other, and q in tokens and head_dim; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention heads ({q.shape[1]}) must be divisible by key/value heads "
                         f"({k.shape[1]})")
    if group_size != plan.cp_size:
        raise ValueError(f"the plan is for cp_size {plan.cp_size} but the process group has "
                         f"{group_size} ranks")
    expected = plan.num_tokens // plan.cp_size
    if q.shape[0] != expected:
        raise ValueError(f"q has {q.shape[0]} tokens but the plan gives each rank {expected} "
                         f"(b*s // cp = {plan.num_tokens} // {plan.cp_size})")


def context_parallel_attention(q, k, v, plan, group=None, causal=True, softmax_scale=None,
                               backend=None):
    """Document-masked causal attention of this rank's rows `plan.token_index(rank)`.

    q: [n, H, D], k/v: [n, G, D] -> [n, H, D]; differentiable in q, k, v. For algo='hybrid'
    every rank must have called `create_hybrid_groups(group, plan.ulysses_degree)` once.
    """
    if not causal:
        raise ValueError("causal=False is not supported: EoD-reset training is causal")
    if plan.cp_size == 1 and group is None:
        rank = 0  # no context parallelism: one local varlen call, no process group needed
        _check(q, k, v, plan, 1)
    else:
        group = group if group is not None else dist.group.WORLD
        _check(q, k, v, plan, dist.get_world_size(group))
        rank = dist.get_rank(group)
    backend = backend or get_backend(q.device, q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    schedule = plan.schedule(rank)
    if schedule.local.q_index.device != q.device:
        schedule = schedule.to(q.device)
    if plan.cp_size == 1:
        return ring_attention(q, k, v, schedule, None, backend, scale)
    if plan.algo == "ring":
        return ring_attention(q, k, v, schedule, group, backend, scale)
    if plan.algo == "ulysses":
        return ulysses_ring_attention(q, k, v, schedule, group, None, plan.cp_size, backend,
                                      scale)
    ulysses_group, ring_group = get_hybrid_groups(group, plan.ulysses_degree)
    return ulysses_ring_attention(q, k, v, schedule, ulysses_group, ring_group,
                                  plan.ulysses_degree, backend, scale)
