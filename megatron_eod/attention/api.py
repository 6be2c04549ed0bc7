"""The entry of stage 3: `context_parallel_attention`, one pipeline for Ring, Ulysses, Hybrid.

One job: check the inputs (their kinds, then their shapes against the plan), then run this
rank's part of the plan: optional Ulysses all-to-all (sequence- to head-sharded, ulysses.py)
-> the document-aware ring schedule executor over the ring group (ring.py; no steps for pure
Ulysses, or at CP 1) -> all-to-all back. The default softmax scale and the kernel backend
come from backends.py.

Shape key: n = local tokens (b*s // cp), H = query heads, G = key/value heads, D = head dim.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_eod.attention.backends import default_scale, get_backend, unit_stride_heads
from megatron_eod.attention.groups import get_hybrid_groups
from megatron_eod.attention.ring import check_ring_exchange, ring_attention
from megatron_eod.attention.ulysses import head_to_seq, seq_to_head
from megatron_eod.plan.cp_plan import CPPlan

__all__ = ["context_parallel_attention"]


def _check_arguments(q, k, v, plan, group, causal, softmax_scale, backend):
    """The arguments' kinds, before any is used (shapes: `_check`)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor [tokens, heads, head_dim], got "
                             f"{type(t).__name__}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, "
                         f"{v.device}")
    if not isinstance(plan, CPPlan):
        raise ValueError(f"plan must be the CPPlan plan_context_parallel returns, got "
                         f"{type(plan).__name__}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup (the CP group, e.g. "
                         f"parallel_state.get_context_parallel_group()), got "
                         f"{type(group).__name__}")
    if not causal:
        raise ValueError(f"causal must be True (EoD-reset training is causal), got {causal!r}")
    if softmax_scale is not None:
        try:  # any real number: a float, numpy's, a 0-d tensor, a Decimal
            finite = not isinstance(softmax_scale, (bool, str, bytes)) and \
                math.isfinite(float(softmax_scale))
        except (TypeError, ValueError, RuntimeError):
            finite = False
        if not finite:
            raise ValueError(f"softmax_scale must be None (1/sqrt(head_dim)) or a finite "
                             f"number, got {softmax_scale!r}")
    if backend is not None and not (callable(getattr(backend, "forward", None))
                                    and callable(getattr(backend, "backward", None))):
        raise ValueError(f"backend must be None (chosen by device and dtype) or a kernel "
                         f"backend object with forward/backward (attention/backends.py), got "
                         f"{backend!r}")


def _check(q, k, v, plan, group_size):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v must match each other, and q in tokens and head_dim; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] < 1 or k.shape[1] < 1 or q.shape[2] < 1:
        raise ValueError(f"q, k, v need at least one attention head, one key/value head and "
                         f"head_dim >= 1; got q {tuple(q.shape)}, k {tuple(k.shape)}")
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
                               backend=None, ring_exchange="batched", concurrent_calls=False):
    """Document-masked causal attention of this rank's rows `plan.token_index(rank)`.

    q: [n, H, D], k/v: [n, G, D] -> [n, H, D]; differentiable in q, k, v. For algo='hybrid'
    every rank must have called `create_hybrid_groups(group, plan.ulysses_degree)` once.
    ring_exchange (ring and hybrid): "batched" (all of a ring group's transfers at once, two
    kernel calls), "batched-keep" (the same, the received rows kept for the backward instead
    of sent again) or "steps" (a transfer, a call and a merge per ring step); see ring.py.
    concurrent_calls (batched executors, on a GPU): the local call runs on a side CUDA stream
    beside the call over received keys, so that each fills the other's tail (streams.py),
    and in two parts where the kernel writes into given tensors (plan/local_split.py).
    """
    _check_arguments(q, k, v, plan, group, causal, softmax_scale, backend)
    check_ring_exchange(ring_exchange)
    if plan.cp_size == 1 and group is None:
        rank = 0  # no context parallelism: one local varlen call, no process group needed
        _check(q, k, v, plan, 1)
    else:
        group = group if group is not None else dist.group.WORLD
        _check(q, k, v, plan, dist.get_world_size(group))
        rank = dist.get_rank(group)
    q, k, v = unit_stride_heads(q, k, v)  # a dense head_dim, as every kernel reads it
    backend = backend or get_backend(q.device, q.dtype)
    scale = float(softmax_scale) if softmax_scale is not None else default_scale(q.shape[-1])
    schedule = plan.schedule(rank)
    if schedule.local.q_index.device != q.device:
        schedule = schedule.to(q.device)
    # The pipeline: [Ulysses all-to-all] -> ring schedule over the groups -> [all-to-all back].
    degree, ulysses_group, ring_group = _groups(plan, group)
    if degree > 1:
        q, k, v = seq_to_head(q, k, v, ulysses_group, degree)
    out = ring_attention(q, k, v, schedule, ring_group, backend, scale, ring_exchange,
                         concurrent_calls)
    return head_to_seq(out, ulysses_group, degree) if degree > 1 else out


def _groups(plan, group):
    """(Ulysses degree, Ulysses group, ring group): ring is u = 1 over the whole CP group,
    Ulysses is u = cp with no ring (its schedule has no steps: one local varlen call over the
    group's whole documents), hybrid is Ulysses inside u consecutive ranks and a ring across."""
    if plan.cp_size == 1:
        return 1, None, None
    if plan.algo == "ring":
        return 1, None, group
    if plan.algo == "ulysses":
        return plan.cp_size, group, None
    ulysses_group, ring_group = get_hybrid_groups(group, plan.ulysses_degree)
    return plan.ulysses_degree, ulysses_group, ring_group
