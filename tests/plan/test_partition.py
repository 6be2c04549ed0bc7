"""The planner over its whole valid input space (hypothesis): CP 2..128, ring / ulysses /
hybrid with every Ulysses degree, b >= 1 rows, up to 1M tokens, the mixes of mixes.py.

Each case asserts the contract: every rank gets exactly b*s/cp tokens and together they are
a partition of the stream; every piece lies in one document; `stats()` (read from the
schedules' own relation) equals the independent cost model, evaluates exactly the pairs a
document mask needs (wasted ratio 1.0) and pads nothing; and the busiest group is within the
one balance bound (`cost.balance_bound`). CI runs a derandomized few hundred cases;
`bash scripts/test_cpu.sh tests/plan --hypothesis-profile=long` runs thousands.
"""

import numpy as np
import pytest
import torch
from hypothesis import assume, event, given, settings, target
from hypothesis import strategies as st

from megatron_eod import plan_context_parallel
from megatron_eod.plan.cost import balance_bound, doc_pairs, group_kv_received, group_pairs
from megatron_eod.plan.partition import partition_documents
from megatron_eod.plan.sweep import sweep_documents
from tests.plan.mixes import examples, make_cu_seqlens, packing_inputs, plan_inputs

def check_plan(plan, cu):
    n, cp, groups = int(cu[-1]), plan.cp_size, plan.ring_size
    per_rank = n // cp
    # Exact tokens per rank; together a partition of the stream.
    index = [plan.token_index(r) for r in range(cp)]
    assert all(i.numel() == per_rank for i in index), [i.numel() for i in index]
    assert torch.equal(torch.cat(index).sort().values, torch.arange(n))
    # Pieces lie in one document each.
    p = plan.pieces
    assert ((p.start >= p.doc_start) & (p.end <= cu[p.doc + 1]) & (p.end > p.start)).all()
    assert (p.tokens_per_group() == n // groups).all()
    # stats() from the schedules' relation == the independent cost model.
    stats = plan.stats()
    pairs, kv = group_pairs(p), group_kv_received(p)
    u = plan.ulysses_degree
    assert stats["pairs_per_rank"] == [int(pairs[r // u]) for r in range(cp)]
    assert stats["kv_tokens_received_per_rank"] == [int(kv[r // u]) for r in range(cp)]
    needed = int(doc_pairs(np.diff(cu)).sum())
    assert stats["pairs_needed"] == needed == int(pairs.sum())
    assert stats["wasted_pairs_ratio"] == 1.0 and stats["padding_tokens"] == 0
    # The one balance bound.
    bound = balance_bound(needed / groups, int(np.diff(cu).max()))
    assert pairs.max() <= bound, (pairs.max() / (needed / groups), stats["balance_limit"])
    assert stats["balance"] <= stats["balance_limit"]
    # Which layout won is reported; no candidate may have failed (that would be a bug that
    # the fallback hid).
    assert stats["planner"] in stats["planners"]
    if groups > 1:  # the choice never moves more keys than the sweep alone would
        assert kv.max() <= group_kv_received(sweep_documents(cu, groups)).max()
    assert not [v for v in stats["planners"].values() if v.startswith("failed")], stats
    return stats


@pytest.mark.slow
@settings(max_examples=examples(300))
@given(plan_inputs())
def test_every_valid_input_is_planned_exactly_and_balanced(case):
    cu, cp, algo, degree, _ = case
    event(f"log2 tokens {int(np.log2(cu[-1]))}")
    plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, degree)
    stats = check_plan(plan, cu)
    # Steer the search towards the bound: hypothesis reports the highest score it found.
    target((stats["balance"] - 1) / (stats["balance_limit"] - 1), label="share of the slack used")
    event(f"planner {stats['planner'].split('(')[0]}")


@settings(max_examples=examples(100))
@given(packing_inputs(), st.sampled_from(["ring", "hybrid"]))
def test_where_the_packing_candidates_run_the_contract_holds(case, algo):
    """The inputs where partition.py also tries its optimizers (R <= 32, <= 2,048
    documents): the general property test rarely lands there."""
    cu, groups = case
    degree = 2 if algo == "hybrid" else None
    assume(int(cu[-1]) % (groups * (degree or 1)) == 0)
    stats = check_plan(plan_context_parallel(cu, groups * (degree or 1), algo, degree), cu)
    event(f"planner {stats['planner'].split('(')[0]}")


@settings(max_examples=examples(60))
@given(plan_inputs(max_log2_tokens=14), st.integers(0, 3))
def test_plans_are_deterministic_and_independent_of_the_input_type(case, kind):
    cu, cp, algo, degree, _ = case
    forms = [torch.from_numpy(cu), torch.from_numpy(cu).to(torch.int32), cu, cu.tolist()]
    a = plan_context_parallel(forms[kind], cp, algo, degree)
    b = plan_context_parallel(torch.from_numpy(cu), cp, algo, degree)
    for field in ("start", "end", "doc", "group"):
        assert np.array_equal(getattr(a.pieces, field), getattr(b.pieces, field))


def test_long_and_one_document_rows_at_the_largest_sizes():
    """The largest inputs, checked in CI every time (hypothesis samples them rarely): 1M tokens
    at CP 128 as one document, as 1-7-token documents (also at CP 2, where the previous
    planner asked numpy for a 128 GiB array) and as one-token documents, and hybrid u=8 at
    CP 64."""
    n = 1 << 20
    rng = np.random.default_rng(0)
    tiny = np.concatenate([[0], np.cumsum(rng.integers(1, 8, n))])
    cases = [(np.array([0, n]), 128, "ring", None),
             (np.concatenate([tiny[tiny < n], [n]]), 128, "ring", None),
             (np.concatenate([tiny[tiny < n], [n]]), 2, "ring", None),  # was 128 GiB
             (np.arange(0, n + 1, 8), 64, "hybrid", 8),
             (np.arange(n // 8 + 1), 128, "ring", None)]
    for cu, cp, algo, degree in cases:
        check_plan(plan_context_parallel(cu, cp, algo, degree), cu)


def test_reported_crashes_are_planned():
    """Inputs that made the previous planner raise `max() arg is an empty sequence`."""
    lengths = [4637, 13557, 1508, 1053, 28667, 42273, 1248, 1608, 23699, 547, 12275]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    check_plan(plan_context_parallel(torch.from_numpy(cu), 8, "ring"), cu)
    cu = np.array([0, 41, 87, 133, 199, 200])
    check_plan(plan_context_parallel(cu, 8, "ring"), cu)
    rng = np.random.default_rng(7)  # lognormal mixes at CP 32 (80% failed before)
    for cp in (16, 32, 64, 128):
        for seed in range(3):
            cu = make_cu_seqlens("web", 1, cp * 1024, cp, int(rng.integers(1 << 31)) + seed)
            check_plan(plan_context_parallel(cu, cp, "ring"), cu)
            check_plan(plan_context_parallel(cu, cp, "hybrid", 2), cu)


def test_the_bound_is_tight_where_exact_token_counts_force_imbalance():
    """One 2-token document on 2 ranks cannot do better than 1 and 2 pairs: the bound's
    granularity term allows it, and the planner finds exactly that."""
    plan = plan_context_parallel([0, 2], 2)
    assert sorted(plan.stats()["pairs_per_rank"]) == [1, 2]
    assert plan.stats()["balance"] <= plan.stats()["balance_limit"]


def test_optimizers_are_skipped_where_they_would_cost_too_much():
    """Planning cost must not grow with documents x CP: beyond 32 groups or 2,048 documents
    only the sweep runs."""
    many_docs = np.arange(0, 8 * 4096 + 1, 8)  # 4,096 documents
    assert list(partition_documents(many_docs, 4).tried) == [("sweep", "chosen")]
    wide = make_cu_seqlens("web", 1, 64 * 1024, 64, seed=1)
    assert list(partition_documents(wide, 64).tried) == [("sweep", "chosen")]
    small = make_cu_seqlens("web", 1, 32768, 4, seed=0)
    assert len(partition_documents(small, 4).tried) == 5


def test_on_a_web_batch_without_long_documents_whole_document_packing_wins():
    """The first web batch of tools/bench_cp.py (32k tokens, CP 4, no document above 0.61 of
    a share): the sweep cuts medium documents at group boundaries, the packer keeps them
    whole and cuts only short filler."""
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(np.log(600), 1.0, 337)).astype(int)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    cu = np.concatenate([cu[cu < 32768], [32768]])
    placement = partition_documents(cu, 4)
    sweep = int(group_kv_received(sweep_documents(cu, 4)).max())
    chosen = int(group_kv_received(placement.pieces).max())
    assert placement.planner.startswith("pack") and chosen < sweep / 2, (placement.tried,
                                                                         chosen, sweep)


BROKEN = {  # pieces (start, end, doc, group) of cu = [0, 3, 8] on 2 groups, each wrong
    "overlap": [(0, 3, 0, 0), (3, 4, 1, 0), (3, 7, 1, 1)],  # token 3 twice, token 7 never
    "outside": [(0, 4, 0, 0), (4, 8, 1, 1)],  # piece 0 crosses into document 1
    "bad group": [(0, 3, 0, 0), (3, 4, 1, 0), (4, 8, 1, 2)],
    "tokens": [(0, 3, 0, 0), (3, 8, 1, 1)],  # 3 and 5 tokens
}


@pytest.mark.parametrize("broken", ["raises"] + sorted(BROKEN))
def test_a_broken_optimizer_is_reported_and_never_used(monkeypatch, broken):
    """A bug in an optimizer must not stop a run: its candidate is rejected with the reason,
    and the plan is still the exact, balanced sweep."""
    from megatron_eod.plan import partition
    from megatron_eod.plan.pieces import Pieces

    cu = np.array([0, 3, 8])

    def bad(cu_seqlens, groups, *setting):
        if broken == "raises":
            raise IndexError("boom")
        start, end, doc, group = (np.array(c, np.int64) for c in zip(*BROKEN[broken]))
        return Pieces(start, end, doc, group, cu[doc], groups)

    monkeypatch.setattr(partition, "pack_documents", bad)
    placement = partition.partition_documents(cu, 2)
    outcomes = dict(placement.tried)
    packs = [v for k, v in outcomes.items() if k.startswith("pack")]
    assert len(packs) == 3 and all(v.startswith("failed") for v in packs), outcomes
    assert not placement.planner.startswith("pack")
    assert partition._not_a_partition(placement.pieces, cu, 4) == ""
    if broken != "raises":  # and the check names what is wrong
        assert partition._not_a_partition(bad(cu, 2), cu, 4) == {
            "overlap": "a token is held twice", "outside": "a piece crosses a document "
            "boundary", "bad group": "group index out of range",
            "tokens": "token counts are not exact"}[broken]
