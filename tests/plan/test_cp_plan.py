"""`plan_context_parallel` and the partitioner: exact token counts, every token placed once,
stats that agree with the independent cost model, determinism, and clear errors."""

import numpy as np
import pytest
import torch

from megatron_eod import build_doc_layout, plan_context_parallel
from megatron_eod.plan.cost import kv_tokens_received_per_rank, pairs_per_rank
from megatron_eod.plan.partition import partition_documents
from tests.reference import random_layout_tokens

EOD = 50


def lognormal_cu(n, median, sigma, seed):
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(median), sigma, size=n)).astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    cu = cu[cu < n]
    return np.concatenate([cu, [n]])


LAYOUTS = {
    "web": lambda seed: lognormal_cu(16384, 600, 1.0, seed),
    "heavy": lambda seed: lognormal_cu(16384, 300, 2.0, seed),
    "one_document": lambda seed: np.array([0, 8192]),
    "tiny_docs": lambda seed: lognormal_cu(4096, 2, 0.5, seed),
    "mixed_rows": lambda seed: build_doc_layout(
        random_layout_tokens("mixed", 4, 512, EOD, seed), EOD).cu_seqlens.numpy(),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 8])
def test_partition_places_every_token_once_with_equal_counts(name, groups):
    for seed in range(3):
        cu = LAYOUTS[name](seed)
        n = int(cu[-1])
        if n % groups:
            continue
        pieces = partition_documents(cu, groups)
        owners = np.full(n, -1)
        for g in range(groups):
            idx = pieces.token_index(g)
            assert idx.size == n // groups, (g, idx.size)
            assert (owners[idx] == -1).all()
            owners[idx] = g
        assert (owners >= 0).all()
        # Every piece lies inside one document.
        doc_of_start = np.searchsorted(cu, pieces.start, side="right") - 1
        doc_of_last = np.searchsorted(cu, pieces.end - 1, side="right") - 1
        assert (doc_of_start == pieces.doc).all() and (doc_of_last == pieces.doc).all()
        # Determinism: the same input gives the same pieces.
        again = partition_documents(cu, groups)
        assert all((getattr(again, f) == getattr(pieces, f)).all()
                   for f in ("start", "end", "doc", "group"))


@pytest.mark.parametrize("algo,cp,degree", [("ring", 4, None), ("ring", 8, None),
                                            ("hybrid", 8, 2), ("ulysses", 4, None)])
def test_stats_agree_with_the_cost_model(algo, cp, degree):
    cu = LAYOUTS["web"](1)
    plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, degree)
    stats = plan.stats()
    groups = plan.ring_size
    owner = np.empty(int(cu[-1]), dtype=np.int64)
    for g in range(groups):
        owner[plan.pieces.token_index(g)] = g
    pairs = pairs_per_rank(cu, owner, groups)
    kv = kv_tokens_received_per_rank(cu, owner, groups)
    u = plan.ulysses_degree
    assert stats["pairs_per_rank"] == [int(pairs[r // u]) for r in range(cp)]
    assert stats["kv_tokens_received_per_rank"] == [int(kv[r // u]) for r in range(cp)]
    assert stats["wasted_pairs_ratio"] == 1.0 and stats["padding_tokens"] == 0
    assert stats["pairs_needed"] == int(pairs.sum())


def test_token_index_partitions_the_stream():
    cu = LAYOUTS["heavy"](0)
    for algo, degree in (("ring", None), ("ulysses", None), ("hybrid", 2)):
        plan = plan_context_parallel(torch.from_numpy(cu), 4, algo, degree)
        idx = torch.cat([plan.token_index(r) for r in range(4)])
        assert torch.equal(idx.sort().values, torch.arange(int(cu[-1])))
    ulysses = plan_context_parallel(torch.from_numpy(cu), 4, "ulysses")
    assert torch.equal(ulysses.token_index(1), torch.arange(4096, 8192))  # contiguous shards


@pytest.mark.parametrize("kwargs,message", [
    (dict(cu_seqlens=[0, 10], cp_size=4), r"b\*s \(10 tokens\) must be divisible by cp_size"),
    (dict(cu_seqlens=[0, 8], cp_size=0), "cp_size .* must be a positive int"),
    (dict(cu_seqlens=[0, 8], cp_size=2, algo="zigzag"), "must be one of"),
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="hybrid"), "needs ulysses_degree"),
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="hybrid", ulysses_degree=3), "must divide"),
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="ring", ulysses_degree=2), "None or 1"),
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="ulysses", ulysses_degree=2), "None or cp_size"),
    (dict(cu_seqlens=[1, 8], cp_size=2), "must start at 0"),
    (dict(cu_seqlens=[0, 4, 4, 8], cp_size=2), "strictly increase"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_context_parallel(**kwargs)


def test_bad_rank():
    plan = plan_context_parallel([0, 8], 2)
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, 2\)"):
        plan.token_index(2)


def test_partition_never_fails_on_random_small_streams():
    rng = np.random.default_rng(5)
    for trial in range(300):
        groups = int(rng.choice([2, 3, 4, 8]))
        n = groups * int(rng.integers(1, 40))
        cuts = np.unique(rng.integers(1, n, size=int(rng.integers(0, n)))) if n > 1 else []
        cu = np.concatenate([[0], cuts, [n]]).astype(np.int64)
        pieces = partition_documents(cu, groups)
        counts = [pieces.token_index(g).size for g in range(groups)]
        assert counts == [n // groups] * groups, (cu.tolist(), groups, counts)
