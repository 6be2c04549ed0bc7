"""The batched executor's landing of returned key/value gradients (batched.py `_land`): each
row's local gradient plus every gradient returned for it, summed, then rounded ONCE to the
kernel's dtype, on each of its paths: the rows sent as one run, each once by index, a row sent
several times (summed in float32 over the run covering the rows sent, or over all rows).
The values are multiples of 1/64 below 4 (8 bits: exact in bf16 and float32), whose sums need more bits than
bf16 has: a second rounding (an add in bf16 before the sum is complete) changes some of them.
"""

import numpy as np
import pytest
import torch

from megatron_eod.attention import batched
from megatron_eod.plan.kv_batched import BatchedExchange, _landing
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


@pytest.mark.parametrize("launch_bytes", [-1, 1 << 40], ids=["covering-run", "all-rows"])
@pytest.mark.parametrize("kind", ["run", "once", "repeats"])
def test_returned_gradients_land_rounded_once(kind, launch_bytes, monkeypatch):
    monkeypatch.setattr(batched, "LAUNCH_BYTES", launch_bytes)
    rng, gen = np.random.default_rng(3), torch.Generator().manual_seed(3)
    send_index = _send_index(kind, rng)
    span = span_of(send_index)
    exchange = BatchedExchange(torch.from_numpy(send_index), (), (), None, span,
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
