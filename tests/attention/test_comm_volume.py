"""The bytes the process group really moves in one forward equal what `plan.stats()` says.

Each rank wraps torch.distributed's point-to-point and all-to-all entry points and counts
the bytes it receives from other ranks during one forward pass.
"""

import math

import pytest
import torch
import torch.distributed as dist

from megatron_eod import (build_doc_layout, context_parallel_attention, create_hybrid_groups,
                          plan_context_parallel)
from tests.harness import run_ranks
from tests.reference import random_layout_tokens

EOD, HEADS, KV_HEADS, DIM = 50, 8, 2, 4
ELEM = 8  # float64


def _count_forward_bytes(rank, world, algo, degree, exchange):
    tokens = random_layout_tokens("mixed", 2, 128, EOD, seed=3)
    plan = plan_context_parallel(build_doc_layout(tokens, EOD).cu_seqlens, world, algo, degree)
    if algo == "hybrid":
        create_hybrid_groups(dist.group.WORLD, degree)
    got = {"p2p": 0, "a2a": 0}
    batch, a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def counting_batch(ops):
        for op in ops:
            if op.op is dist.irecv:
                got["p2p"] += op.tensor.numel() * op.tensor.element_size()
        return batch(ops)

    def counting_a2a(output, input, *args, group=None, **kwargs):
        size = dist.get_world_size(group)
        got["a2a"] += output.numel() * output.element_size() * (size - 1) // size
        return a2a(output, input, *args, group=group, **kwargs)

    dist.batch_isend_irecv, dist.all_to_all_single = counting_batch, counting_a2a
    try:
        n = plan.num_tokens // world
        q = torch.randn(n, HEADS, DIM, dtype=torch.float64)
        k = torch.randn(n, KV_HEADS, DIM, dtype=torch.float64)
        context_parallel_attention(q, k, k.clone(), plan, group=dist.group.WORLD,
                                   ring_exchange=exchange)
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = batch, a2a
    return got, plan.stats()


@pytest.mark.parametrize("exchange", ["batched", "steps"])
@pytest.mark.parametrize("algo,world,degree", [("ring", 4, None), ("ring", 8, None),
                                               ("ulysses", 4, None), ("hybrid", 8, 2),
                                               ("hybrid", 8, 4)])
def test_forward_bytes_match_plan_stats(algo, world, degree, exchange):
    """The batched executor receives a key row once per query piece that reads it, the
    steps once: their own stats; on this layout the two differ."""
    results = run_ranks(_count_forward_bytes, world, algo, degree, exchange)
    u = {"ring": 1, "ulysses": world, "hybrid": degree}[algo]
    kv_heads_per_rank = KV_HEADS * (u // math.gcd(KV_HEADS, u)) // u
    moved_any = differ = False
    for rank, (got, stats) in enumerate(results):
        batched = exchange == "batched" and stats["batched_ring"]
        kv_tokens = stats["kv_tokens_received_batched_per_rank" if batched else
                          "kv_tokens_received_per_rank"][rank]
        differ |= (stats["kv_tokens_received_batched_per_rank"][rank] !=
                   stats["kv_tokens_received_per_rank"][rank])
        a2a_tokens = stats["ulysses_tokens_received_per_rank"][rank]
        expected_p2p = kv_tokens * 2 * max(kv_heads_per_rank, 1) * DIM * ELEM
        channels_in = HEADS // u + 2 * max(kv_heads_per_rank, 1)
        expected_a2a = a2a_tokens * (channels_in + HEADS // u) * DIM * ELEM if u > 1 else 0
        assert got == {"p2p": expected_p2p, "a2a": expected_a2a}, (rank, got, stats)
        moved_any |= got["p2p"] > 0
    assert moved_any or algo == "ulysses", "the layout must make the ring move data"
    assert differ or algo != "ring", "the layout must make some key row travel twice"
