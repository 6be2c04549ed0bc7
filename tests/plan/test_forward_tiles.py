"""The fused forward's tiles against the document mask: over random plans (every algorithm,
CP size and layout the plan tests draw) and tile sizes, every group's tiles, each row's keys
expanded into (query, key) stream positions, give exactly the causal same-document pairs of
the group's queries, each once; every local row is in one tile; a tile has at most block_m
rows of one document; the tiles needing no received key are launched apart; each launch's
tiles come longest first."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_eod import plan_context_parallel
from megatron_eod.plan.forward_tiles import DEFAULT_BLOCK_M, forward_tiles, with_fused_tiles
from tests.plan.mixes import examples, plan_inputs, simulated_max_cp
from tests.plan.test_kv_schedule import _CODE, expected_pairs, receive_buffer


def _tile_pairs(tiles, row_start, own, received):
    """Codes of the (query, key) stream positions of every row of `tiles` as the kernel reads
    them: the received rows r_start:r_stop and the local rows from l_start up to the row
    that are in its document (from row_start[row] on); own: the group's local rows'
    positions, received: its receive buffer's."""
    out = [np.zeros(0, np.int64)]
    for q_start, q_stop, r_start, r_stop, l_start in tiles.tolist():
        for row in range(q_start, q_stop):
            local = np.arange(l_start, row + 1)
            local = local[local >= row_start[row]]
            keys = np.concatenate([received[r_start:r_stop], own[local]])
            out.append(own[row] * _CODE + keys)
    return np.concatenate(out)


def _cost(tiles):
    t = tiles.long()
    return (t[:, 3] - t[:, 2]) + (t[:, 1] - t[:, 4])


@settings(max_examples=examples(80))
@given(plan_inputs(max_log2_tokens=10, max_cp=simulated_max_cp()),
       st.sampled_from([16, 32, DEFAULT_BLOCK_M]))
def test_tiles_cover_exactly_the_document_mask(case, block_m):
    cu, cp, algo, degree, _ = case
    plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, degree)
    tokens = [plan.group_tokens(g) for g in range(plan.ring_size)]
    schedules = plan.schedules
    for g, schedule in enumerate(schedules):
        if schedule.steps and schedule.batched is None:  # the steps executor runs it
            assert schedule.forward_tiles is None
            continue
        assert schedule.forward_tiles.block_m == DEFAULT_BLOCK_M
        tiles = with_fused_tiles(schedule, block_m).forward_tiles
        own = tokens[g].numpy()
        received = receive_buffer(schedules, tokens, g).numpy() if schedule.batched else \
            np.zeros(0, np.int64)
        row_start = tiles.row_start.numpy()
        pairs = np.sort(np.concatenate([
            _tile_pairs(tiles.local_only, row_start, own, received),
            _tile_pairs(tiles.with_received, row_start, own, received)]))
        assert np.array_equal(pairs, expected_pairs(cu, own))
        both = torch.cat([tiles.local_only, tiles.with_received]).long()
        rows = np.concatenate([np.arange(a, b) for a, b in both[:, :2].tolist()] +
                              [np.zeros(0, np.int64)])
        assert np.array_equal(np.sort(rows), np.arange(schedule.num_tokens))
        assert bool(((both[:, 1] > both[:, 0]) & (both[:, 1] - both[:, 0] <= block_m)).all())
        # row_start: each row's document's first local row; a tile reads its local keys from
        # its first row's, which no later row's precedes; a piece with received keys is one
        # document.
        doc = np.searchsorted(cu, own, side="right") - 1
        assert np.array_equal(doc[row_start], doc) and bool(
            np.all((row_start == 0) | (doc[np.maximum(row_start - 1, 0)] != doc)))
        for q_start, q_stop, _, _, l_start in both.tolist():
            assert l_start == row_start[q_start] <= row_start[q_stop - 1]
        for q_start, q_stop, *_ in tiles.with_received.tolist():
            assert doc[q_start] == doc[q_stop - 1]
        assert bool((tiles.local_only[:, 2] == tiles.local_only[:, 3]).all())
        assert bool((tiles.with_received[:, 3] > tiles.with_received[:, 2]).all())
        for launch in (tiles.local_only, tiles.with_received, tiles.every):
            assert launch.dtype == torch.int32 and launch.shape[1] == 5
            cost = _cost(launch)
            assert bool((cost[:-1] >= cost[1:]).all())
        # the backward's one dq launch: both launches' tiles, each once
        assert sorted(tiles.every.tolist()) == sorted(both.tolist())


def _key_tile_pairs(tiles, row_start, own, received, causal):
    """Codes of the (query, key) pairs of key tiles as the dk/dv kernel reads them."""
    out = [np.zeros(0, np.int64)]
    for k_start, k_stop, q_start, q_stop in tiles.tolist():
        for key in range(k_start, k_stop):
            rows = np.arange(q_start, q_stop)
            if causal:
                rows = rows[(row_start[rows] <= key) & (key <= rows)]
                out.append(own[rows] * _CODE + own[key])
            else:
                out.append(own[rows] * _CODE + received[key])
    return np.concatenate(out)


@settings(max_examples=examples(60))
@given(plan_inputs(max_log2_tokens=10, max_cp=simulated_max_cp()),
       st.sampled_from([16, 64]))
def test_key_tiles_cover_exactly_the_document_mask(case, block_n):
    """The fused backward's key tiles (plan/key_tiles.py): their (query, key) pairs are the
    document mask's, each once; every key row in one tile of at most block_n; longest first."""
    from megatron_eod.plan.key_tiles import key_tiles

    cu, cp, algo, degree, _ = case
    plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, degree)
    tokens = [plan.group_tokens(g) for g in range(plan.ring_size)]
    schedules = plan.schedules
    for g, schedule in enumerate(schedules):
        if schedule.forward_tiles is None:
            assert schedule.key_tiles is None
            continue
        call = schedule.batched.call if schedule.batched else None
        keys = key_tiles(schedule.local.cu_seqlens_q.numpy(),
                         *(None, None, None) if call is None else
                         (call.q_index.numpy(), call.cu_seqlens_q.numpy(),
                          call.cu_seqlens_k.numpy()), block_n=block_n)
        own = tokens[g].numpy()
        received = receive_buffer(schedules, tokens, g).numpy() if schedule.batched else \
            np.zeros(0, np.int64)
        row_start = schedule.forward_tiles.row_start.numpy()
        pairs = np.concatenate([_key_tile_pairs(keys.local, row_start, own, received, True),
                                _key_tile_pairs(keys.received, row_start, own, received,
                                                False)])
        assert np.array_equal(np.sort(pairs), expected_pairs(cu, own))
        for table, rows in ((keys.local, schedule.num_tokens), (keys.received, received.size)):
            t = table.long()
            covered = np.concatenate([np.arange(a, b) for a, b in t[:, :2].tolist()] +
                                     [np.zeros(0, np.int64)])
            assert np.array_equal(np.sort(covered), np.arange(rows))
            assert bool((t[:, 1] - t[:, 0] <= block_n).all())
            cost = t[:, 3] - t[:, 2]
            assert bool((cost[:-1] >= cost[1:]).all())
        # What the kernels' unmasked blocks rely on (attention/triton_backward_kernels.py):
        # a local key tile's readers start at its first key and end where its last key's
        # document does; row starts never decrease; a query tile's l_start is its first
        # row's document start.
        local = keys.local.long().numpy()
        assert np.array_equal(local[:, 2], local[:, 0])
        last = row_start[local[:, 1] - 1]
        assert np.array_equal(row_start[local[:, 3] - 1], last)
        after = np.append(row_start, -1)[local[:, 3]]  # the row after the readers' last
        assert bool((after != last).all())
        assert bool((np.diff(row_start) >= 0).all())
        for table in (schedule.forward_tiles.local_only, schedule.forward_tiles.with_received):
            t = table.long().numpy()
            assert np.array_equal(t[:, 4], row_start[t[:, 0]])


def test_tiles_of_a_small_group_by_hand():
    """Local runs 0:10 (one document), 10:40 (another, whose rows 10:25 read received keys
    0:7 of the buffer), 40:43; 16-row tiles: the piece alone, the other rows in 16-row tiles
    across documents (25:41 holds rows of the second and third), longest first."""
    tiles = forward_tiles(np.array([0, 10, 40, 43]), np.arange(10, 25), np.array([0, 15]),
                          np.array([0, 7]), block_m=16)
    assert tiles.local_only.tolist() == [[25, 41, 0, 0, 10], [0, 10, 0, 0, 0],
                                         [41, 43, 0, 0, 40]]
    assert tiles.with_received.tolist() == [[10, 25, 0, 7, 10]]
    assert tiles.row_start.tolist() == [0] * 10 + [10] * 30 + [40] * 3
    assert forward_tiles(np.array([0, 40]), block_m=16).local_only.tolist() == [
        [32, 40, 0, 0, 0], [16, 32, 0, 0, 0], [0, 16, 0, 0, 0]]
    # Consecutive short documents share tiles (5 and 4 rows: one tile); a document of a tile
    # or more is cut from its first row (9:30), as is the one after it (30:33, 33:35 share).
    assert forward_tiles(np.array([0, 5, 9, 30, 33, 35]), block_m=16).local_only.tolist() == [
        [25, 30, 0, 0, 9], [9, 25, 0, 0, 9], [0, 9, 0, 0, 0], [30, 35, 0, 0, 30]]


@pytest.mark.parametrize("block_m", [0, 3, 48, 16.0])
def test_block_m_must_be_a_power_of_two(block_m):
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        forward_tiles(np.array([0, 8]), block_m=block_m)


def test_a_received_piece_must_be_a_run_inside_one_local_sequence():
    with pytest.raises(ValueError, match="run of local rows inside one local sequence"):
        forward_tiles(np.array([0, 10, 20]), np.arange(5, 15), np.array([0, 10]),
                      np.array([0, 4]), block_m=16)


def test_a_plan_without_fused_tiles_builds_none_and_keeps_saying_so():
    """fused_tiles=False (the trainers without --cp-fused-forward): no tiles, before and after
    the plan moves; the executor refuses a fused backend on it (test_triton_forward.py)."""
    cu = torch.tensor([0, 5, 40, 41, 64], dtype=torch.int32)
    plan = plan_context_parallel(cu, 4, "ring", fused_tiles=False)
    assert all(s.forward_tiles is None and s.key_tiles is None for s in plan.schedules)
    moved = plan.to("cpu")
    assert not moved.fused_tiles
    assert plan_context_parallel(cu, 4, "ring").schedules[0].forward_tiles is not None
