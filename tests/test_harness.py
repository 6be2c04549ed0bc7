"""The multi-rank harness itself: collectives on sub-groups, failure and hang reporting."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks


def _all_to_all(rank, world_size):
    # all_to_all_single (what Ulysses uses; gloo has no list-form all_to_all before torch
    # 2.13, and the GPU machine has 2.11), even, then uneven: rank r sends r+1 values to each.
    even = torch.empty(2 * world_size)
    dist.all_to_all_single(even, torch.cat([torch.full((2,), float(10 * rank + p))
                                            for p in range(world_size)]))
    even = list(even.split(2))
    send = torch.cat([torch.full((rank + 1,), float(100 * rank + p)) for p in range(world_size)])
    recv = torch.empty(sum(p + 1 for p in range(world_size)))
    dist.all_to_all_single(recv, send, output_split_sizes=[p + 1 for p in range(world_size)],
                           input_split_sizes=[rank + 1] * world_size)
    return [t.tolist() for t in even], recv.tolist()


def test_all_to_all_on_four_ranks():
    results = run_ranks(_all_to_all, 4)
    for rank, (even, uneven) in enumerate(results):
        assert even == [[float(10 * peer + rank)] * 2 for peer in range(4)]
        assert uneven == [float(100 * peer + rank) for peer in range(4) for _ in range(peer + 1)]


def _subgroups(rank, world_size, inner):
    # Hybrid-CP shape: consecutive ranks form the inner groups, strided ranks the outer ones.
    inner_groups = [list(range(g * inner, (g + 1) * inner)) for g in range(world_size // inner)]
    outer_groups = [list(range(i, world_size, inner)) for i in range(inner)]
    mine = {}
    for name, groups in (("inner", inner_groups), ("outer", outer_groups)):
        for ranks in groups:
            group = dist.new_group(ranks)  # every rank creates every group, as required
            if rank in ranks:
                mine[name] = (group, ranks)
    out = {}
    for name, (group, ranks) in mine.items():
        gathered = [torch.zeros(1) for _ in ranks]
        dist.all_gather(gathered, torch.tensor([float(rank)]), group=group)
        out[name] = [int(t.item()) for t in gathered]
    return out


@pytest.mark.parametrize("world_size,inner", [(4, 2), (8, 2), (8, 4)])
def test_subgroup_layout(world_size, inner):
    results = run_ranks(_subgroups, world_size, inner)
    for rank, out in enumerate(results):
        base = rank - rank % inner
        assert out["inner"] == list(range(base, base + inner))
        assert out["outer"] == list(range(rank % inner, world_size, inner))


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("deliberate failure")
    return rank


def test_failure_names_the_rank():
    with pytest.raises(AssertionError, match=r"rank 1 failed(.|\n)*deliberate failure"):
        run_ranks(_fail_on_rank_one, 2)


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends
    else:
        time.sleep(60)  # stays alive, so rank 0 waits instead of seeing a closed connection
    return rank


def test_hang_names_the_rank():
    with pytest.raises(AssertionError, match="rank 0 hung"):
        run_ranks(_hang_on_rank_zero, 2, timeout=3)
