"""Schedules against the document mask, pair by pair: every group's local call and ring
steps, expanded into (query, key) stream positions, cover exactly the causal same-document
pairs of its queries, each once; what a group sends at step t is what its peer receives; the
runs of rows marked for slicing (spans) are exactly the index arrays that are runs, and a
step's received keys are read in the order they arrive."""

import numpy as np
import torch
from hypothesis import given, settings

from megatron_eod import plan_context_parallel
from megatron_eod.plan.kv_batched import MAX_RECEIVED_PER_ROW
from megatron_eod.plan.kv_schedule import RingStep
from tests.plan.mixes import examples, plan_inputs, simulated_max_cp


_CODE = 1 << 32  # a (query, key) pair of stream positions as one int64: query * _CODE + key


def call_pairs(call, q_stream, k_stream):
    """int64 codes of the (query, key) stream positions one kernel call evaluates."""
    out = [np.zeros(0, np.int64)]
    cu_q, cu_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q = q_stream[call.q_index[cu_q[i]:cu_q[i + 1]]].numpy()
        k = k_stream[call.k_index[cu_k[i]:cu_k[i + 1]]].numpy()
        visible = np.ones((q.size, k.size), dtype=bool)
        if call.causal:  # bottom-right aligned: query row r sees keys 0 .. r + (sk - sq)
            visible = np.arange(k.size)[None, :] <= (np.arange(q.size) + k.size - q.size)[:, None]
        out.append((q[:, None] * _CODE + k[None, :])[visible])
    return np.concatenate(out)


def _run(index):
    """(start, stop) when index is start, start+1, .., stop-1; else None."""
    values = index.tolist()
    if values and values == list(range(values[0], values[0] + len(values))):
        return values[0], values[0] + len(values)
    return None


def expected_pairs(cu, queries):
    """Codes of the causal same-document pairs of `queries` (stream positions)."""
    queries = np.asarray(queries, np.int64)
    doc = np.searchsorted(cu, queries, side="right") - 1
    counts = queries - cu[doc] + 1
    keys = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + \
        np.repeat(cu[doc], counts)
    return np.sort(np.repeat(queries, counts) * _CODE + keys)


def receive_buffer(schedules, tokens, g):
    """Group g's batched receive buffer in stream positions: each message as its sender
    (`schedules[peer].batched`) sends it; `tokens[peer]`: the peer's local rows' positions."""
    parts = [torch.zeros(0, dtype=torch.int64)]
    for m in schedules[g].batched.recvs:
        sender = schedules[m.peer].batched
        sent = next(s for s in sender.sends if s.peer == g and s.ordinal == m.ordinal)
        parts.append(tokens[m.peer][sender.send_index[sent.start:sent.stop]])
    return torch.cat(parts)


@settings(max_examples=examples(120))
@given(plan_inputs(max_log2_tokens=10, max_cp=simulated_max_cp()))
def test_schedules_cover_exactly_the_document_mask(case):
    cu, cp, algo, degree, _ = case
    plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, degree)
    groups = plan.ring_size
    tokens = [plan.group_tokens(g) for g in range(groups)]
    schedules = plan.schedules
    for g, schedule in enumerate(schedules):
        assert schedule.group == g and schedule.num_tokens == tokens[g].numel()
        assert [s.step for s in schedule.steps] == list(range(1, groups))
        pairs = [call_pairs(schedule.local, tokens[g], tokens[g])]
        for step in schedule.steps:
            assert isinstance(step, RingStep)
            sender = schedules[step.recv_from].steps[step.step - 1]
            assert sender.send_to == g and step.send_to == (g + step.step) % groups
            assert sender.send_index.numel() == step.recv_count
            received = tokens[step.recv_from][sender.send_index]
            assert step.send_span == _run(step.send_index)
            if step.call is None:
                assert step.recv_count == 0
            else:
                pairs.append(call_pairs(step.call, tokens[g], received))
                call = step.call
                assert call.q_span == _run(call.q_index) and call.k_span == _run(call.k_index)
                # Every received row is read (ring.py: a run of keys is the whole buffer).
                assert set(call.k_index.tolist()) == set(range(step.recv_count))
                assert call.k_span in (None, (0, step.recv_count))
                # Sent in the order the call reads: its keys are the buffer in order,
                # unless a received row is read by two query pieces.
                if np.unique(call.k_index.numpy()).size == call.k_index.numel():
                    assert call.k_span == (0, step.recv_count)
        pairs = np.sort(np.concatenate(pairs))
        assert np.array_equal(pairs, expected_pairs(cu, tokens[g].numpy())), f"group {g}"
        assert pairs.size == schedule.pairs  # (equal sorted arrays: no pair twice either)


def test_a_rank_builds_only_its_own_schedule():
    """At CP 128 a rank needs one schedule, not 128 (the old planner built all of them)."""
    n = 1 << 17
    plan = plan_context_parallel(torch.tensor([0, n]), 128, "ring")
    schedule = plan.schedule(5)
    assert plan.schedule(5) is schedule  # built once
    built = [key for key in plan._cache if key[0] == "schedule"]
    assert built == [("schedule", 5)]
    assert len(schedule.steps) == 127 and schedule.kv_tokens_received > 0


def test_to_device_keeps_pieces_and_moves_schedules():
    """`to` moves schedules built already (plan-ahead builds them on a worker thread before
    the step moves the plan) and builds later ones on the device."""
    plan = plan_context_parallel(torch.tensor([0, 5, 40, 64]), 4, "hybrid", 2)
    built = plan.schedule(3)  # before `to`
    moved = plan.to("cpu")
    assert moved.pieces is plan.pieces and moved.device == torch.device("cpu")
    assert moved._cache[("schedule", plan.group_of(3))] is not built  # moved, not rebuilt
    for rank in (3, 0):  # one moved, one built after `to`
        a, b = plan.schedule(rank), moved.schedule(rank)
        assert torch.equal(a.local.cu_seqlens_q, b.local.cu_seqlens_q)
        assert [s.recv_count for s in a.steps] == [s.recv_count for s in b.steps]
        assert all(torch.equal(x.send_index, y.send_index) for x, y in zip(a.steps, b.steps))


@settings(max_examples=examples(60))
@given(plan_inputs(max_log2_tokens=10, max_cp=simulated_max_cp()))
def test_batched_exchange_is_the_steps_at_once(case):
    """The batched form (kv_batched.py) of every group: its one call evaluates exactly the
    pairs of all ring steps, each once, reading its keys as the one run of the buffer its
    peers fill, every row once; each pair of groups lists the same messages (sizes, in
    order, numbered 0, 1, ..) on both sides, each inside one query piece's keys. Plans where a
    group would receive too much carry no batched form at all."""
    cu, cp, algo, degree, _ = case
    plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, degree)
    tokens = [plan.group_tokens(g) for g in range(plan.ring_size)]
    schedules = plan.schedules
    # Batched forms everywhere or nowhere: nowhere when some group would hold more than
    # MAX_RECEIVED_PER_ROW x its rows of received keys at once.
    received = plan.stats()["kv_tokens_received_batched_per_rank"][::plan.ulysses_degree]
    assert plan.batched_ring == all(n <= MAX_RECEIVED_PER_ROW * s.num_tokens
                                    for n, s in zip(received, schedules))
    assert plan.stats()["batched_ring"] == plan.batched_ring
    for g, schedule in enumerate(schedules):
        batched = schedule.batched
        if not schedule.steps or not plan.batched_ring:
            assert batched is None
            continue
        assert batched.send_span == _run(batched.send_index)
        # Each sent message is a run of local rows (k and v leave as views), from its `row`.
        for m in batched.sends:
            assert batched.send_index[m.start:m.stop].tolist() == list(
                range(m.row, m.row + m.stop - m.start))
        assert all(m.row == -1 for m in batched.recvs)
        # Repeated rows: their gradients are summed over the run covering the rows sent.
        sent = batched.send_index
        assert (batched.landing is None) == (sent.unique().numel() == sent.numel())
        if batched.landing is not None:
            landing = batched.landing
            assert (landing.start, landing.stop) == (int(sent.min()), int(sent.max()) + 1)
            assert torch.equal(landing.index + landing.start, sent)
        for messages, size in ((batched.sends, batched.send_index.numel()),
                               (batched.recvs, batched.recv_count)):
            assert [m.start for m in messages] == [0, *[m.stop for m in messages]][:len(messages)]
            assert (messages[-1].stop if messages else 0) == size
        assert batched.recv_count == received[g]
        for peer in range(plan.ring_size):
            mine = [m for m in batched.recvs if m.peer == peer]
            theirs = [m for m in schedules[peer].batched.sends if m.peer == g] if \
                schedules[peer].batched else []
            assert [m.ordinal for m in mine] == list(range(len(mine)))
            assert [m.ordinal for m in theirs] == list(range(len(theirs)))
            assert [m.stop - m.start for m in mine] == [m.stop - m.start for m in theirs]
        buffer = receive_buffer(schedules, tokens, g)
        step_pairs = [np.zeros(0, np.int64)]
        for step in schedule.steps:
            if step.call is not None:
                sent = schedules[step.recv_from].steps[step.step - 1].send_index
                step_pairs.append(call_pairs(step.call, tokens[g], tokens[step.recv_from][sent]))
        step_pairs = np.sort(np.concatenate(step_pairs))
        if batched.call is None:
            assert step_pairs.size == 0 and batched.recv_count == 0
            continue
        call = batched.call
        pairs = np.sort(call_pairs(call, tokens[g], buffer))
        assert not call.causal and pairs.size == np.unique(pairs).size == call.pairs
        assert np.array_equal(pairs, step_pairs)
        assert call.q_span == _run(call.q_index)
        assert call.k_span == (0, batched.recv_count) == _run(call.k_index)
        # One sequence per query piece: distinct, increasing runs of local rows; each message
        # lies inside one sequence's keys.
        cu_q, cu_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
        firsts = [int(call.q_index[a]) for a in cu_q[:-1]]
        assert firsts == sorted(set(firsts))
        for a, b in zip(cu_q[:-1], cu_q[1:]):
            assert _run(call.q_index[a:b]) is not None
        for m in batched.recvs:
            i = np.searchsorted(cu_k, m.start, side="right") - 1
            assert m.stop <= cu_k[i + 1]


def test_messages_split_where_the_senders_rows_do_not_follow():
    """A message is a run of the sender's local rows (its k and v leave as views): key pieces
    of one query piece from one peer that are not consecutive there go as two messages. (Plans
    keep a document's pieces on a group consecutive, so this guards a future placement.)"""
    from megatron_eod.plan.kv_batched import Message, _messages

    length = np.array([5, 5, 3, 4, 2])
    local_start = np.array([0, 5, 10, 13, 20])  # piece 4 does not follow piece 3
    q, k, peer = np.array([0, 0, 0, 1]), np.array([2, 3, 4, 4]), np.array([1, 1, 1, 1])
    assert _messages(q, k, peer, length, local_start) == (
        Message(1, 0, 7, 0, 10), Message(1, 7, 9, 1, 20), Message(1, 9, 11, 2, 20))
