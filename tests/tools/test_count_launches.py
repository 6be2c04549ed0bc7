"""tools/count_launches.py: the ring executors' glue stays a few launches per attention call,
and taking planned runs of rows as slices is what keeps it there (the same plans with every
row by index launch more); the batched executor makes 2 attention calls per direction and
launches less glue than the steps. Counts, not times: deterministic on any machine."""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import count_launches  # noqa: E402
from bench_cp import web_row  # noqa: E402
from megatron_eod import plan_context_parallel  # noqa: E402
from tests.reference import schedule_without_spans  # noqa: E402

# The GPU backend's own glue and the landing of returned gradients included: 3.0-6.0 on the
# bench mixes for the batched executor (ring and hybrid), up to 7.0 for the steps there
# (docs/BENCHMARKS.md); the rows here (8k-16k) stay within these.
GLUE_PER_CALL = {"batched": 6, "steps": 7}


@pytest.mark.parametrize("exchange", ["batched", "steps"])
@pytest.mark.parametrize("n,cp,algo,degree", [(8192, 4, "ring", None), (16384, 8, "ring", None),
                                              (16384, 8, "hybrid", 2)])
def test_glue_launches_per_attention_call_stay_few(n, cp, algo, degree, exchange):
    cu = web_row(n, np.random.default_rng(cp))
    plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, degree)
    q = torch.zeros(n, 4, 8, dtype=torch.bfloat16)
    kv = torch.zeros(n, 2, 8, dtype=torch.bfloat16)
    worse = 0
    for g in range(plan.ring_size):
        calls, glue, _, _ = count_launches.group_launches(plan, g, (q, kv, kv, q),
                                                          exchange=exchange)
        assert glue <= GLUE_PER_CALL[exchange] * calls, (g, calls, glue)
        if exchange == "batched":
            assert calls <= 4, (g, calls)  # local + received, forward and backward
            steps = count_launches.group_launches(plan, g, (q, kv, kv, q), exchange="steps")
            assert glue <= steps[1] and calls <= steps[0], (g, glue, steps[:2])
        stripped = count_launches.group_launches(plan, g, (q, kv, kv, q),
                                                 schedule_map=schedule_without_spans,
                                                 exchange=exchange)[1]
        assert stripped >= glue
        worse += stripped > glue
    assert worse, "no group used a planned run of rows"


def test_report_lists_every_mix_and_layout(capsys):
    count_launches.main(["--samples", "1", "--configs", "4096:4"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    # header + (stdlib, web) x (ring, hybrid) x (batched, steps, batched with the fused forward)
    assert len(rows) == 1 + 12
    assert sum("(fused forward)" in row for row in rows) == 4


@pytest.mark.parametrize("algo,degree", [("ring", None), ("hybrid", 2)])
def test_the_fused_forward_makes_no_merge_and_less_glue(algo, degree):
    """The default on GPUs (--cp-fused-forward): two launches for the forward, no log-sum-exp
    merge and no forward glue, so never more glue than the batched executor's."""
    n, cp = 8192, 4
    plan = plan_context_parallel(torch.from_numpy(web_row(n, np.random.default_rng(1))), cp,
                                 algo, degree)
    q = torch.zeros(n, 4, 8, dtype=torch.bfloat16)
    kv = torch.zeros(n, 2, 8, dtype=torch.bfloat16)
    fewer = 0
    for g in range(plan.ring_size):
        fused = count_launches.group_launches(plan, g, (q, kv, kv, q), fused=True)
        plain = count_launches.group_launches(plan, g, (q, kv, kv, q))
        assert not any(op.startswith("fused merge") for op in fused.ops), fused.ops
        assert fused.calls <= 4 and fused.glue <= plain.glue, (g, fused, plain)
        fewer += fused.glue < plain.glue
    assert fewer, "the fused forward saved no launch in any group"


def test_tile_floor_of_the_plans_is_near_the_ideal(capsys):
    """Split pieces cost partial tiles, but little: every layout's busiest group is within
    1.15x of the whole row's tiles / cp (1.01-1.06 on the bench mixes, docs/BENCHMARKS.md),
    and never below the pair balance allows."""
    count_launches.main(["--samples", "1", "--configs", "16384:4"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| mix")]
    for cells in rows:
        fwd, bwd = (float(x) for x in cells[-1].rstrip(" |").split(" / "))
        assert 0.99 <= fwd <= 1.15 and 0.99 <= bwd <= 1.15, cells
