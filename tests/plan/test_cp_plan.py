"""`plan_context_parallel`'s interface: rank -> tokens, the Ulysses degree rule, and errors
that name the broken rule for every invalid input."""

import numpy as np
import pytest
import torch

from megatron_eod import plan_context_parallel
from megatron_eod.plan import ulysses_degree_for
from tests.plan.mixes import make_cu_seqlens


def test_ulysses_ranks_hold_consecutive_shards_of_their_group():
    cu = make_cu_seqlens("heavy", 2, 4096, 8, seed=3)
    for algo, degree in (("ulysses", None), ("hybrid", 2), ("hybrid", 4), ("ring", None)):
        plan = plan_context_parallel(torch.from_numpy(cu), 8, algo, degree)
        u = plan.ulysses_degree
        for rank in range(8):
            group, shard = divmod(rank, u)
            assert plan.group_of(rank) == group
            tokens = plan.group_tokens(group)
            assert torch.equal(plan.token_index(rank), tokens[shard * 1024:(shard + 1) * 1024])
    ulysses = plan_context_parallel(torch.from_numpy(cu), 8, "ulysses")
    assert torch.equal(ulysses.token_index(1), torch.arange(1024, 2048))  # contiguous


@pytest.mark.parametrize("algo,cp,given,degree", [
    ("ring", 8, None, 1), ("ring", 8, 1, 1), ("ulysses", 8, None, 8), ("ulysses", 8, 8, 8),
    ("hybrid", 8, 2, 2), ("hybrid", 8, 1, 1), ("hybrid", 8, 8, 8), ("hybrid", 1, 1, 1)])
def test_ulysses_degree_rule(algo, cp, given, degree):
    assert ulysses_degree_for(algo, cp, given) == degree
    plan = plan_context_parallel(list(range(0, 9 * cp + 1, 9)), cp, algo, given)
    assert plan.ulysses_degree == degree and plan.ring_size == cp // degree


@pytest.mark.parametrize("kwargs,message", [
    (dict(cu_seqlens=[0, 10], cp_size=4), r"b\*s \(10 tokens\) must be divisible by cp_size"),
    (dict(cu_seqlens=[0, 5], cp_size=8), r"cp_size \(--context-parallel-size 8\) must not "
                                         r"exceed the tokens of the micro-batch \(b\*s = 5\)"),
    (dict(cu_seqlens=[0, 8], cp_size=0), "cp_size .* must be a positive int"),
    (dict(cu_seqlens=[0, 8], cp_size=2.0), "cp_size .* must be a positive int"),
    (dict(cu_seqlens=[0, 8], cp_size=True), "cp_size .* must be a positive int"),
    (dict(cu_seqlens=[0, 8], cp_size=2, algo="zigzag"), "must be one of"),
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="hybrid"), "needs ulysses_degree"),
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="hybrid", ulysses_degree=3),
     r"ulysses_degree \(--ulysses-degree-in-cp\) 3 must be a positive int that divides"),
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="hybrid", ulysses_degree=0), "positive int"),
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="ring", ulysses_degree=2), "None or 1"),
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="ulysses", ulysses_degree=2), "None or cp_size"),
    (dict(cu_seqlens=[1, 8], cp_size=2), "must start at 0"),
    (dict(cu_seqlens=[0, 4, 4, 8], cp_size=2), "strictly increase"),
    (dict(cu_seqlens=[0, 6, 4, 8], cp_size=2), "strictly increase"),
    (dict(cu_seqlens=[0], cp_size=1), "must start at 0 and strictly increase"),
    (dict(cu_seqlens=[], cp_size=1), "must start at 0 and strictly increase"),
    (dict(cu_seqlens=[0, 10.5, 20], cp_size=2), "must hold integers, got float64"),
    (dict(cu_seqlens=[0.0, 10.0, 20.0], cp_size=2), "must hold integers"),
    (dict(cu_seqlens=torch.tensor([0.0, 8.0]), cp_size=2), "must hold integers, got dtype "
                                                           "torch.float32"),
    (dict(cu_seqlens=torch.tensor([False, True]), cp_size=1), "must hold integers"),
    (dict(cu_seqlens=np.array([0, 4, 8], dtype=np.float16), cp_size=2), "must hold integers"),
    (dict(cu_seqlens=["0", "8"], cp_size=2), "must hold integers"),
    (dict(cu_seqlens=[[0, 4], [4, 8]], cp_size=2), "must be 1-D"),
    # A helper's sweep of the public API: these failed inside numpy or torch.
    (dict(cu_seqlens=[[0, 4], [8]], cp_size=2), "must be a 1-D sequence of integer offsets"),
    (dict(cu_seqlens=torch.tensor([0, 4, 8], device="meta"), cp_size=2),
     "must be a dense tensor with values, got a meta one"),
    (dict(cu_seqlens=torch.tensor([0, 4, 8]).to_sparse(), cp_size=2),
     "must be a dense tensor with values, got a torch.sparse_coo one"),
    # The same degree rule for every algorithm (ring took 1.0 and True, hybrid refused 2.0).
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="ring", ulysses_degree=1.0),
     r"ulysses_degree .* must be None or an int, got 1.0"),
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="ring", ulysses_degree=True), "None or an int"),
    (dict(cu_seqlens=[0, 8], cp_size=4, algo="ulysses", ulysses_degree=4.0), "None or an int"),
    (dict(cu_seqlens=[0, 2**31 + 2], cp_size=2), r"must be below 2\*\*31: the varlen kernels "
                                                 r"take int32 cu_seqlens"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_context_parallel(**kwargs)


@pytest.mark.parametrize("device,message", [
    ("nonsense", "device must name a torch device .* got 'nonsense'"),
    (None, "got None"),
    (torch.float16, "got torch.float16"),
    pytest.param("cuda", "device cuda: CUDA is not available here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
    pytest.param(0, "device cuda:0: CUDA is not available here",  # an index is a CUDA device
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
])
def test_bad_devices_are_named_when_the_plan_moves(device, message):
    """(It moved to 'cuda' without one and failed at the first schedule; the others failed
    inside torch.device.)"""
    with pytest.raises(ValueError, match=message):
        plan_context_parallel([0, 8], 2).to(device)


@pytest.mark.parametrize("rank", [2, -1, 1.0, True, "0"])
def test_bad_rank(rank):
    plan = plan_context_parallel([0, 8], 2)
    with pytest.raises(ValueError, match=r"cp_rank must be an int in \[0, 2\)"):
        plan.token_index(rank)


def test_integer_inputs_of_every_kind_are_accepted():
    want = plan_context_parallel([0, 3, 8], 2).pieces.start
    for cu in (torch.tensor([0, 3, 8], dtype=torch.int32), np.array([0, 3, 8], np.uint16),
               np.array([0, 3, 8], np.int64), (0, 3, 8)):
        assert np.array_equal(plan_context_parallel(cu, 2).pieces.start, want)


def test_a_callers_index_is_its_own():
    """Changing the index a rank was given leaves the plan's answers (and other ranks',
    which shared its memory under hybrid) as they were."""
    plan = plan_context_parallel([0, 3, 8, 16], 4, "hybrid", 2)
    before = [plan.token_index(r).clone() for r in range(4)]
    plan.token_index(0).add_(1000)
    plan.group_tokens(1).add_(1000)
    assert all(torch.equal(plan.token_index(r), before[r]) for r in range(4))
