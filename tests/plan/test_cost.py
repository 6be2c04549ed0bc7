"""The cost model against its definition, token by token, on random token -> rank maps."""

import numpy as np
import pytest

from megatron_eod.plan.cost import (BALANCE_TOLERANCE, balance_bound, doc_pairs,
                                    group_kv_received, group_pairs, kv_tokens_received_per_rank,
                                    pairs_per_rank, pieces_from_owner, range_pairs)


def brute_force(cu, owner, world):
    """Pairs: sum of (position + 1) over a rank's queries. Keys: tokens of a document the rank
    does not hold that lie before its last query of that document."""
    pairs, kv = np.zeros(world, np.int64), np.zeros(world, np.int64)
    for d in range(len(cu) - 1):
        for rank in range(world):
            mine = [p for p in range(cu[d], cu[d + 1]) if owner[p] == rank]
            pairs[rank] += sum(p - cu[d] + 1 for p in mine)
            if mine:
                kv[rank] += sum(1 for p in range(cu[d], max(mine)) if owner[p] != rank)
    return pairs, kv


@pytest.mark.parametrize("seed", range(40))
def test_pairs_and_traffic_match_the_definition(seed):
    rng = np.random.default_rng(seed)
    world = int(rng.integers(1, 6))
    n = int(rng.integers(1, 120))
    cuts = np.unique(rng.integers(1, n, int(rng.integers(0, 12)))) if n > 1 else []
    cu = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    # Runs of one owner make pieces that touch, interleave and skip ranks.
    owner = np.repeat(rng.integers(0, world, n), 1)
    if seed % 2:
        owner = np.sort(owner) if seed % 4 == 1 else owner[np.argsort(rng.random(n))]
    pairs, kv = brute_force(cu, owner, world)
    assert pairs_per_rank(cu, owner, world).tolist() == pairs.tolist()
    assert kv_tokens_received_per_rank(cu, owner, world).tolist() == kv.tolist()
    pieces = pieces_from_owner(cu, owner, world)
    assert group_pairs(pieces).sum() == doc_pairs(np.diff(cu)).sum()
    assert group_kv_received(pieces).tolist() == kv.tolist()


def test_range_pairs_agrees_on_ints_and_arrays():
    a, b = np.array([0, 3, 10]), np.array([5, 4, 1000])
    assert range_pairs(a, b).tolist() == [range_pairs(int(x), int(y)) for x, y in zip(a, b)]
    assert range_pairs(0, 5) == 15 and range_pairs(3, 4) == 4
    assert range_pairs(0, 1 << 20) == (1 << 20) * ((1 << 20) + 1) // 2  # no int64 overflow


def test_balance_bound_is_one_percent_plus_granularity():
    assert BALANCE_TOLERANCE == 0.01
    assert balance_bound(1e9, 1000) == pytest.approx(1.01e9 + 2000)
    # One 2-token document on 2 ranks: 1 and 2 pairs is the best exact split; it is allowed.
    assert 2 <= balance_bound(1.5, 2)
