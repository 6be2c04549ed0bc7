"""tools/dispatch_model.py: its CTAs are the tile model's tiles, its scheduling is list
scheduling, calls on concurrent streams never take longer than in sequence, and the local
call's split (plan/local_split.py) shortens the modelled tail where it was written to."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import dispatch_model  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from dispatch_model import DispatchModel, cta_costs, makespan  # noqa: E402
import torch  # noqa: E402
from tile_model import TILES, call_tiles, plan_calls  # noqa: E402

from megatron_eod import plan_context_parallel  # noqa: E402

TILES_ONLY = DispatchModel(cta_cost=0.0, masked_tile=1.0, empty_cta=0.0)


def _random_call(rng, causal):
    lq = rng.integers(0, 700, size=rng.integers(1, 12))
    lk = lq + (rng.integers(0, 900, size=lq.size) if causal else rng.integers(0, 900, lq.size))
    if not causal:
        lk = np.where(lq == 0, 0, lk)
    return np.r_[0, np.cumsum(lq)], np.r_[0, np.cumsum(lk)]


@pytest.mark.parametrize("direction", list(TILES))
@pytest.mark.parametrize("causal", [True, False])
def test_ctas_hold_exactly_the_tile_models_tiles(direction, causal):
    """With tiles only (no fixed, masked or empty cost), a call's CTAs add up to the tile
    model's count for every head: the two models agree on the work, the dispatch model
    only adds when it runs."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        cu_q, cu_k = _random_call(rng, causal)
        if cu_q[-1] == 0:
            continue
        heads = int(rng.integers(1, 4))
        costs = cta_costs(cu_q, cu_k, causal, heads, direction, TILES_ONLY)
        assert costs.sum() == heads * call_tiles(cu_q, cu_k, causal, *TILES[direction])


def test_grid_order_and_size():
    """Grid (blocks of the longest sequence, sequences, heads), the block fastest: shorter
    sequences' surplus CTAs are empty; heads repeat the same order."""
    model = DispatchModel(cta_cost=0.0, masked_tile=1.0, empty_cta=0.5)
    costs = cta_costs([0, 256, 320], [0, 256, 320], True, 2, "forward", model)
    # forward tiles 128 x 64: sequence 0 has blocks of 2 and 4 key tiles, sequence 1 one
    # block of one key tile, then an empty CTA
    assert costs.tolist() == [2, 4, 1, 0.5] * 2


def test_makespan_is_list_scheduling():
    assert makespan([], 4) == 0
    assert makespan([1.0] * 10, 4) == 3  # three waves
    assert makespan([1.0] * 7 + [5.0], 4) == 6  # the long CTA starts late (at 1): the tail
    assert makespan([5.0] + [1.0] * 7, 4) == 5  # first, it hides behind the others
    rng = np.random.default_rng(1)
    for _ in range(100):
        costs = rng.exponential(size=rng.integers(1, 60))
        slots = int(rng.integers(1, 9))
        span = makespan(costs, slots)
        assert span >= max(costs.sum() / slots, costs.max()) - 1e-12
        assert span <= costs.sum() / slots + costs.max() + 1e-12  # Graham's bound


def test_concurrent_calls_never_take_longer_than_in_sequence():
    rng = np.random.default_rng(2)
    for _ in range(100):
        a, b = (rng.exponential(size=rng.integers(1, 40)) for _ in range(2))
        slots = int(rng.integers(1, 9))
        assert makespan(np.concatenate([a, b]), slots) <= \
            makespan(a, slots) + makespan(b, slots) + 1e-12


def test_small_run_prints_every_layout(capsys):
    dispatch_model.main(["--samples", "1", "--configs", "4096:4", "--heads", "4",
                         "--slots", "16"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "layout" not in line]
    names = [r.split(" | ")[0][2:] for r in rows]
    assert names == ["ours ring", "ours ring (concurrent)", "ours ring (concurrent, split)",
                     "ours ring (one call)", "ours hybrid u=2", "ours hybrid u=2 (concurrent)",
                     "ours hybrid u=2 (concurrent, split)", "ours hybrid u=2 (one call)",
                     "contiguous", "doc-zigzag (padded)"] * 2
    for r in rows:
        fwd, bwd = (float(x) for x in r.split(" | ")[1].rstrip(" |").split(" / "))
        assert fwd > 0.5 and bwd > 0.5


def test_split_calls_put_the_local_parts_around_the_received_keys_call():
    cu = np.array([0, 100, 1000, 1100, 4096], np.int64)
    plan = plan_context_parallel(torch.from_numpy(cu), 2, "ring")
    for schedule, calls in zip(plan.schedules, dispatch_model.split_calls(plan)):
        first, then = schedule.local_parts
        middle = [schedule.batched.call] if schedule.batched and schedule.batched.call else []
        assert calls == [first] + middle + [then]


def test_the_split_shortens_the_modelled_tail_on_the_web_mix():
    """The reason for plan/local_split.py, in the model: on a web-mix row at 32k / CP 4 the
    busiest ring rank's kernels with the local call split run at least 0.04 of the ideal
    faster than with the whole local call beside the received keys' call, both directions."""
    from bench_selection import mix_rows, parse_configs

    (_, _, cp, cus), = [row for row in mix_rows(parse_configs(None, "32768:4"), 1, 0)
                        if row[0] == "web"]
    ideal = dispatch_model.ideal_times(cus[0], cp, 32)
    plan = plan_context_parallel(torch.from_numpy(cus[0]), cp, "ring")
    whole = dispatch_model.dispatch_over_ideal(plan_calls(plan, "batched"), ideal, 32, True)
    split = dispatch_model.dispatch_over_ideal(dispatch_model.split_calls(plan), ideal, 32,
                                               True)
    for direction in whole:
        assert split[direction] <= whole[direction] - 0.04, (direction, split, whole)
