"""Each group's rows ordered for the exchange (local_order.py), over the planner's whole input
space: the same pieces on the same groups, every document still one run in position order,
"needs received keys" exactly as defined, and the rows that need them one run (so the
received-keys call slices them) wherever a group has at most one mixed document run; a group
is reordered only where its rows were not one run already."""

import numpy as np
import torch
from hypothesis import event, given, settings

from megatron_eod import plan_context_parallel
from megatron_eod.plan.local_order import needs_received_keys, order_for_exchange
from megatron_eod.plan.partition import partition_documents
from megatron_eod.plan.pieces import ranges
from tests.plan.mixes import examples, make_cu_seqlens, plan_inputs


def _brute_needs(p):
    """Piece i needs received keys: an earlier piece of its document is on another group."""
    return np.array([bool(np.any((p.doc == p.doc[i]) & (p.start < p.start[i]) &
                                 (p.group != p.group[i]))) for i in range(p.start.size)])


def _runs(p, g):
    """[(doc, [piece indices])] of group g's document runs, in local order."""
    out = []
    for i in range(p.group_offsets[g], p.group_offsets[g + 1]):
        if out and out[-1][0] == p.doc[i]:
            out[-1][1].append(i)
        else:
            out.append((int(p.doc[i]), [i]))
    return out


def _check(before, after):
    assert after.groups == before.groups
    assert np.array_equal(np.sort(after.group), after.group)  # grouped, ascending
    for g in range(after.groups):
        lo, hi = after.group_offsets[[g, g + 1]]
        blo, bhi = before.group_offsets[[g, g + 1]]
        assert sorted(zip(after.start[lo:hi], after.end[lo:hi])) == \
            sorted(zip(before.start[blo:bhi], before.end[blo:bhi]))
        runs = _runs(after, g)
        docs = [d for d, _ in runs]
        assert len(docs) == len(set(docs)), "a document is split into two runs of a group"
        for _, idx in runs:
            assert np.all(np.diff(after.start[idx]) > 0)  # position order
    needs = needs_received_keys(after)
    assert np.array_equal(needs, _brute_needs(after))
    local = after.local_start()
    for g in range(after.groups):
        lo, hi = after.group_offsets[[g, g + 1]]
        runs = _runs(after, g)
        mixed = sum(1 for _, idx in runs if not needs[idx[0]] and needs[idx[-1]])
        rows = ranges(local[lo:hi][needs[lo:hi]],
                      local[lo:hi][needs[lo:hi]] + after.length[lo:hi][needs[lo:hi]])
        total = int(after.length[lo:hi].sum())
        event(f"mixed runs on a group: {min(mixed, 2)}{'+' if mixed > 2 else ''}")
        blo, bhi = before.group_offsets[[g, g + 1]]
        kept = np.array_equal(after.start[lo:hi], before.start[blo:bhi])
        before_needs = np.flatnonzero(needs_received_keys(before)[blo:bhi])
        one_run_before = before_needs.size == 0 or np.ptp(before_needs) + 1 == before_needs.size
        assert kept or not one_run_before  # a group is reordered only where it gains
        if mixed <= 1 or one_run_before:  # the headline: one run (the last rows if reordered)
            assert rows.size == 0 or np.array_equal(rows, np.arange(rows[0], rows[0] + rows.size))
            assert kept or rows[-1] == total - 1


@settings(max_examples=examples(150))
@given(plan_inputs(max_log2_tokens=13))
def test_rows_needing_received_keys_are_one_run_at_the_end(case):
    cu, cp, algo, degree, _ = case
    plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, degree)
    before = partition_documents(cu, plan.ring_size).pieces
    after = order_for_exchange(before)
    _check(before, after)
    assert np.array_equal(plan.pieces.start, after.start)  # the plan uses this order
    if plan.batched_ring:  # the received-keys call reads exactly the needing rows
        needs, local = needs_received_keys(after), after.local_start()
        for g, schedule in enumerate(plan.schedules):
            lo, hi = after.group_offsets[[g, g + 1]]
            sel = needs[lo:hi]
            rows = np.sort(ranges(local[lo:hi][sel], local[lo:hi][sel] + after.length[lo:hi][sel]))
            call = schedule.batched.call if schedule.batched else None
            got = np.zeros(0, np.int64) if call is None else np.sort(call.q_index.numpy())
            assert np.array_equal(got, rows)


def test_the_received_keys_call_slices_its_query_rows_on_long_document_mixes():
    """Where every group has at most one mixed run, every batched call's query rows are a
    span (no gather of q, dout, out, lse); before the reordering about half were."""
    spans = total = 0
    for seed in range(6):
        cu = make_cu_seqlens("long", 1, 8192, 4, seed)
        plan = plan_context_parallel(torch.from_numpy(cu), 4, "ring")
        needs = needs_received_keys(plan.pieces)
        for g, schedule in enumerate(plan.schedules):
            call = schedule.batched.call if schedule.batched else None
            if call is None:
                continue
            runs = _runs(plan.pieces, g)
            mixed = sum(1 for _, idx in runs if not needs[idx[0]] and needs[idx[-1]])
            total += 1
            spans += call.q_span is not None
            if mixed <= 1:
                assert call.q_span is not None
    assert total >= 6 and spans >= total - 2


def test_nothing_to_reorder_keeps_the_pieces():
    cu = np.array([0, 5, 9, 16], np.int64)  # no document split on 1 group
    pieces = partition_documents(cu, 1).pieces
    assert order_for_exchange(pieces) is pieces
