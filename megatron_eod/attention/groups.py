"""Hybrid CP sub-groups: Ulysses groups on consecutive ranks, Ring groups strided across them.

One job: build, once at start-up, the two sub-groups every rank of a CP group needs for
Hybrid attention, and find them again later. `torch.distributed.new_group` must be called by
every rank of the world with the same arguments in the same order, so the CP groups of all
ranks are first gathered (one all_gather_object) and every sub-group of every CP group is
created in a fixed order. The cache is keyed by (CP ranks, degree); nothing is created at
import time. Where megatron-core's parallel_state already built the same sub-groups
(`initialize_model_parallel(hierarchical_context_parallel_sizes=[u, cp // u])`), the trainer
hands them over with `register_hybrid_groups` instead of creating new ones.
"""

from __future__ import annotations

import numbers
from typing import Dict, Tuple

import torch.distributed as dist

__all__ = ["create_hybrid_groups", "get_hybrid_groups", "register_hybrid_groups"]

_CACHE: Dict[Tuple[Tuple[int, ...], int], Tuple[object, object]] = {}


def _key(cp_group, degree):
    return tuple(dist.get_process_group_ranks(cp_group)), int(degree)


def create_hybrid_groups(cp_group, ulysses_degree: int):
    """Collective over the whole world: returns this rank's (ulysses_group, ring_group)."""
    if not isinstance(cp_group, dist.ProcessGroup):
        raise ValueError(f"cp_group must be a torch.distributed ProcessGroup (the CP group, "
                         f"e.g. parallel_state.get_context_parallel_group()), got "
                         f"{type(cp_group).__name__}")
    ranks = dist.get_process_group_ranks(cp_group)
    if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, numbers.Integral) \
            or ulysses_degree < 1 or len(ranks) % ulysses_degree:
        raise ValueError(f"ulysses_degree (--ulysses-degree-in-cp) must divide the CP size "
                         f"({len(ranks)}), got {ulysses_degree!r}")
    key = _key(cp_group, ulysses_degree)
    if key in _CACHE:
        return _CACHE[key]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, key)
    me = dist.get_rank()
    for cp_ranks, u in sorted(set(everyone)):
        size = len(cp_ranks)
        ulysses = [cp_ranks[i:i + u] for i in range(0, size, u)]
        ring = [cp_ranks[j::u] for j in range(u)]
        made = {}
        for name, lists in (("ulysses", ulysses), ("ring", ring)):
            for members in lists:
                group = dist.new_group(list(members))
                if me in members:
                    made[name] = group
        if me in cp_ranks:
            _CACHE[(cp_ranks, u)] = (made["ulysses"], made["ring"])
    return _CACHE[key]


def get_hybrid_groups(cp_group, ulysses_degree: int):
    key = _key(cp_group, ulysses_degree)
    if key not in _CACHE:
        raise ValueError(f"no hybrid sub-groups for this CP group and ulysses_degree "
                         f"{ulysses_degree}: call megatron_eod.create_hybrid_groups(cp_group, "
                         f"{ulysses_degree}) on every rank first")
    return _CACHE[key]


def register_hybrid_groups(cp_group, ulysses_degree: int, ulysses_group, ring_group):
    """Cache sub-groups built elsewhere (megatron-core's hierarchical CP groups) after
    checking they are the layout Hybrid needs: consecutive Ulysses ranks, strided Ring."""
    cp_ranks = dist.get_process_group_ranks(cp_group)
    u, me = int(ulysses_degree), dist.get_rank()
    pos = cp_ranks.index(me)
    want_u = cp_ranks[pos - pos % u:pos - pos % u + u]
    want_r = cp_ranks[pos % u::u]
    got_u = dist.get_process_group_ranks(ulysses_group)
    got_r = dist.get_process_group_ranks(ring_group)
    if got_u != want_u or got_r != want_r:
        raise ValueError(f"hybrid sub-groups have ranks {got_u} / {got_r}; Ulysses groups must "
                         f"be consecutive ({want_u}) and Ring groups strided ({want_r})")
    _CACHE[_key(cp_group, u)] = (ulysses_group, ring_group)
    return ulysses_group, ring_group
