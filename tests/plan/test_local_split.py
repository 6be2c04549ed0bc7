"""The local call in two parts (local_split.py), over the planner's whole input space and over
any sequence lengths: the parts are two adjacent runs of rows covering the local rows once,
their sequences are the local call's, in order (so they compute exactly its pairs), the first
holds the longest sequence and is the side of it with fewer pairs."""

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from megatron_eod import plan_context_parallel
from megatron_eod.plan.kv_schedule import local_call, make_call
from megatron_eod.plan.local_split import split_local_call
from tests.plan.mixes import examples, plan_inputs


def _local(lengths):
    lengths = np.asarray(lengths, np.int64)
    rows = np.arange(int(lengths.sum()), dtype=np.int64)
    return make_call(lengths, lengths, rows, rows, causal=True)


def _pairs(lengths):
    lengths = np.asarray(lengths, np.int64)
    return int((lengths * (lengths + 1) // 2).sum())


def _check(local, parts):
    lengths = np.diff(local.cu_seqlens_q.numpy().astype(np.int64))
    if lengths.size < 2:
        assert parts is None
        return
    first, then = parts
    spans = sorted([first.q_span, then.q_span])
    total = int(lengths.sum())
    assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == total
    by_rows = sorted(parts, key=lambda part: part.q_span)
    seqs = [np.diff(part.cu_seqlens_q.numpy().astype(np.int64)) for part in by_rows]
    assert np.array_equal(np.concatenate(seqs), lengths)  # the same sequences, in order
    for part, part_lengths in zip(by_rows, seqs):
        assert part_lengths.size >= 1 and part.causal
        assert part.q_span == part.k_span
        assert torch.equal(part.cu_seqlens_q, part.cu_seqlens_k)
        assert part.cu_seqlens_q.dtype == torch.int32 and int(part.cu_seqlens_q[0]) == 0
        assert np.array_equal(part.q_index.numpy(), np.arange(*part.q_span))
        assert part.max_seqlen_q == part.max_seqlen_k == int(part_lengths.max())
    assert first.pairs + then.pairs == local.pairs == _pairs(lengths)
    longest = int(np.argmax(lengths))
    first_lengths = np.diff(first.cu_seqlens_q.numpy().astype(np.int64))
    assert first_lengths.max() == lengths.max()
    # The side of the longest sequence with fewer pairs (a side that is the whole call
    # is not one).
    sides = [lengths[:longest + 1], lengths[longest:]]
    sides = [side for side in sides if side.size < lengths.size]
    assert first.pairs == min(_pairs(side) for side in sides)


@settings(max_examples=examples(50))  # the split itself: test_any_lengths, 200 examples
@given(plan_inputs(max_log2_tokens=13))
def test_every_group_local_call_splits_into_its_own_sequences(case):
    """Every group's local call (built alone: the ring steps are kv_schedule's tests), and
    the parts the plan attaches to the schedule a rank builds are that split."""
    cu, cp, algo, degree, _ = case
    plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, degree)
    for group in range(plan.ring_size):
        local = local_call(plan.pieces, group)
        parts = split_local_call(local)
        _check(local, parts)
        event("split" if parts is not None else "one sequence: not split")
    schedule = plan.schedule(cp - 1)
    _check(schedule.local, schedule.local_parts)
    assert torch.equal(schedule.local.cu_seqlens_q, local_call(
        plan.pieces, plan.group_of(cp - 1)).cu_seqlens_q)


@settings(max_examples=examples(200))
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=40))
def test_any_lengths(lengths):
    _check(_local(lengths), split_local_call(_local(lengths)))


@pytest.mark.parametrize("lengths, first_rows", [
    ([5, 100, 60], (0, 105)),     # the rows up to the longest: fewer pairs
    ([60, 100, 5], (60, 165)),    # the rows from it on
    ([100, 1, 1], (0, 100)),      # the longest first: only the rows up to it are a side
    ([1, 1, 100], (2, 102)),      # the longest last: only the rows from it on
    ([7, 7, 7], (0, 7)),          # ties: the first longest
])
def test_which_part_goes_first(lengths, first_rows):
    first, then = split_local_call(_local(lengths))
    assert first.q_span == first_rows


def test_a_call_over_received_keys_is_refused():
    rows = np.arange(4, dtype=np.int64)
    cross = make_call([2, 2], [3, 1], rows, rows, causal=False)
    with pytest.raises(ValueError, match="local call"):
        split_local_call(cross)


def test_moved_with_the_schedule():
    cu = torch.tensor([0, 100, 1000, 1100, 4096])
    schedule = plan_context_parallel(cu, 2, "ring").schedule(0)
    moved = schedule.to("meta")  # another device, without one
    assert moved.local_parts is not None
    for a, b in zip(schedule.local_parts, moved.local_parts):
        assert a.q_span == b.q_span and a.max_seqlen_q == b.max_seqlen_q
        for t in (b.cu_seqlens_q, b.cu_seqlens_k, b.q_index, b.k_index):
            assert t.device.type == "meta"
        assert b.cu_seqlens_q.shape == a.cu_seqlens_q.shape
