"""The batched executor's landing of returned key/value gradients (batched.py `_land`): each
row's local gradient plus every gradient returned for it, summed, then rounded ONCE to the
kernel's dtype, on each of its paths: the rows sent as one run, each once by index, a row sent
several times (summed in float32 over the run covering the rows sent, or over all rows;
message by message, or cast and index_added). The values are multiples of 1/64 below 4 (8
bits: exact in bf16 and float32), whose sums need more bits than bf16 has: a second rounding
(an add in bf16 before the sum is complete) changes some of them.
"""

import numpy as np
import pytest
import torch

from megatron_eod.attention import batched
from megatron_eod.plan.kv_batched import BatchedExchange, Message, _landing
from megatron_eod.plan.kv_schedule import span_of

T, G, D = 48, 2, 4


def _send_index(kind, rng):
    if kind == "run":
        return np.arange(10, 30)
    if kind == "once":
        return rng.permutation(T)[:20]
    rows = rng.permutation(np.arange(8, 40))[:20]  # some rows more than once, not in order
    return np.concatenate([rows, rows[:12], rows[3:7]])


def _grid(shape, gen):
    return (torch.randint(-255, 256, shape, generator=gen).double() / 64).to(torch.bfloat16)


def _sends(send_index):
    """The messages of a send order: its runs of consecutive local rows (as kv_batched
    makes them), all to peer 1."""
    cut = np.flatnonzero(np.diff(send_index) != 1) + 1
    bounds = [0, *cut.tolist(), send_index.size]
    return tuple(Message(1, a, b, i, int(send_index[a]))
                 for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])))


@pytest.mark.parametrize("in_run,by_message", [(True, True), (True, False), (False, True),
                                               (False, False)])
@pytest.mark.parametrize("kind", ["run", "once", "repeats"])
def test_returned_gradients_land_rounded_once(kind, in_run, by_message, monkeypatch):
    """Every path: over the covering run or all rows, added message by message or cast and
    index_added (the choices `LAUNCH_BYTES` makes by shapes, forced here)."""
    monkeypatch.setattr(batched, "_land_in_run", lambda *args: in_run)
    monkeypatch.setattr(batched, "_add_by_message", lambda *args: by_message)
    rng, gen = np.random.default_rng(3), torch.Generator().manual_seed(3)
    send_index = _send_index(kind, rng)
    span = span_of(send_index)
    exchange = BatchedExchange(torch.from_numpy(send_index), _sends(send_index), (), None, span,
                               None if span is not None else _landing(send_index))
    assert (span is not None) == (kind == "run")
    assert (exchange.landing is not None) == (kind == "repeats")
    dk, dv = _grid((T, G, D), gen), _grid((T, G, D), gen)
    returned = _grid((2, send_index.size, G, D), gen)
    expected = []
    for local, back in zip((dk, dv), returned):
        exact = local.double().index_add(0, exchange.send_index, back.double())
        expected.append(exact.to(torch.bfloat16))  # one rounding
    got = batched._land(returned, dk.clone(), dv.clone(), exchange, torch.bfloat16)
    for mine, ref in zip(got, expected):
        assert torch.equal(mine, ref)
    if kind == "repeats":  # the values above catch a sum rounded on the way (added in bf16,
        stepwise = dk.clone()  # gradient after gradient)
        for j, row in enumerate(send_index.tolist()):
            stepwise[row] += returned[0, j]
        assert not torch.equal(stepwise, expected[0])


def test_landing_covers_the_rows_sent():
    send_index = np.array([9, 4, 7, 4, 12, 9])
    landing = _landing(send_index)
    assert (landing.start, landing.stop) == (4, 13)
    assert torch.equal(landing.index + landing.start, torch.from_numpy(send_index))
    assert _landing(np.array([5, 3, 8])) is None  # each row once
    assert _landing(np.zeros(0, np.int64)) is None


@pytest.mark.parametrize("by_message", [True, False])
def test_planned_messages_land_like_their_send_order(by_message, monkeypatch):
    """The same on real plans (ring CP 8, rows sent to several peers): the planned messages,
    added as the runs of local rows they are, give what the send order gives by index."""
    from megatron_eod import plan_context_parallel
    from tests.plan.mixes import make_cu_seqlens

    monkeypatch.setattr(batched, "_add_by_message", lambda *args: by_message)
    gen = torch.Generator().manual_seed(5)
    landed = 0
    for seed in range(3):
        cu = make_cu_seqlens("long", 2, 512, 8, seed)
        plan = plan_context_parallel(torch.from_numpy(cu), 8, "ring")
        for schedule in plan.schedules:
            exchange = schedule.batched
            if exchange is None or exchange.landing is None:
                continue
            rows, sent = schedule.num_tokens, exchange.send_index
            dk, dv = _grid((rows, G, D), gen), _grid((rows, G, D), gen)
            returned = _grid((2, sent.numel(), G, D), gen)
            got = batched._land(returned, dk.clone(), dv.clone(), exchange, torch.bfloat16)
            for mine, local, back in zip(got, (dk, dv), returned):
                exact = local.double().index_add(0, sent, back.double())
                assert torch.equal(mine, exact.to(torch.bfloat16))
            landed += 1
    assert landed, "no group sent a row twice"
