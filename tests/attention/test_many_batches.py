"""Many random batches through ONE set of gloo ranks: the run-for-weeks check.

A long run meets every layout the data can make, so a crash or a wrong gradient on one batch in
a thousand is a lost run. Here each rank loops over a seeded sequence of random cases and
runs `context_parallel_attention` forward and backward on each, as a trainer does batch after
batch in one process group; every case draws afresh:

- the algorithm (ring, hybrid with any Ulysses degree, ulysses) and the ring executor
  (batched, batched-keep, steps);
- the documents (tests/plan/mixes.py: web, heavy-tailed, 1-7-token, longer than a share,
  uniform, no EoD, mixtures), b rows of s tokens;
- key/value heads (GQA 8:1 to none), the softmax scale, and the landing of returned key/value
  gradients (`batched.LAUNCH_BYTES`: chosen by shapes, or each path forced).

Every case's output and q/k/v gradients must equal the float64 document-masked oracle to
1e-10 on every rank (the oracle runs per rank over the documents its rows touch), and every
p2p operation of the whole sequence is recorded and held to NCCL's rules
(tests/attention/test_nccl_rules.py): groups warmed up before their first p2p, and for every
pair of ranks the same messages, in the same order, on both sides, across all cases.

CI runs 160 cases of a fixed seed at CP 2, 4, 8 and 16 (`examples`: the hypothesis profile's
scale); ten times as many, from a fresh seed, run with `bash scripts/test_cpu.sh
tests/attention/test_many_batches.py --hypothesis-profile=long` (about 3 minutes). A failure names the case's seed, index and draws;
`_case(world, index, seed)` rebuilds it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import settings

from megatron_eod import context_parallel_attention, create_hybrid_groups, plan_context_parallel
from megatron_eod.attention import batched
from tests.attention.test_nccl_rules import recording, violations
from tests.harness import run_ranks
from tests.plan.mixes import MIXES, examples, make_cu_seqlens
from tests.reference import dense_document_attention

HEADS, DIM, TOL = 8, 8, 1e-10
SEED = 20261124


def _case(world: int, index: int, seed: int = SEED) -> dict:
    """The index-th case of a world's sequence: every draw the case makes."""
    rng = np.random.default_rng([seed, world, index])
    algo = str(rng.choice(["ring", "hybrid", "ring", "hybrid", "ulysses"]))
    degree = None
    if algo == "hybrid":
        degree = int(rng.choice([u for u in range(1, world + 1) if world % u == 0]))
    b = int(rng.integers(1, 4))
    s = world * int(rng.integers(1, 1 + 768 // (b * world)))  # b*s <= 768 tokens
    return dict(seed=seed, world=world, index=index, algo=algo, degree=degree, b=b, s=s,
                exchange=str(rng.choice(["batched", "batched-keep", "steps"])),
                mix=str(rng.choice(MIXES)), layout_seed=int(rng.integers(2**32)),
                kv_heads=int(rng.choice([1, 2, 4, 8])),
                scale=float(rng.choice([DIM ** -0.5, rng.uniform(0.05, 1.0)])),
                launch_bytes=int(rng.choice([batched.LAUNCH_BYTES, -1, 1 << 40])))


def _oracle_rows(q, k, v, dout, cu, rows, scale):
    """(out, dq, dk, dv) of `rows` from the dense oracle over the documents holding them."""
    doc = np.searchsorted(cu, rows, side="right") - 1
    docs = np.unique(doc)
    spans = [np.arange(cu[d], cu[d + 1]) for d in docs]
    sub = torch.from_numpy(np.concatenate(spans))
    sub_cu = torch.from_numpy(np.concatenate([[0], np.cumsum([x.size for x in spans])]))
    qs, ks, vs = (t[sub].detach().clone().requires_grad_() for t in (q, k, v))
    out = dense_document_attention(qs, ks, vs, sub_cu, scale)
    (out * dout[sub]).sum().backward()
    where = torch.from_numpy(np.searchsorted(sub.numpy(), rows))  # sub is sorted
    return tuple(t[where] for t in (out.detach(), qs.grad, ks.grad, vs.grad))


def _run_case(rank: int, world: int, case: dict) -> float:
    cu = make_cu_seqlens(case["mix"], case["b"], case["s"], world, case["layout_seed"])
    plan = plan_context_parallel(cu, world, case["algo"], case["degree"])
    if case["algo"] == "hybrid":
        create_hybrid_groups(dist.group.WORLD, case["degree"])
    gen = torch.Generator().manual_seed(case["layout_seed"])
    n, heads = case["b"] * case["s"], max(HEADS, world)  # Ulysses needs degree <= heads
    q, dout = (torch.randn(n, heads, DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(n, case["kv_heads"], DIM, generator=gen, dtype=torch.float64)
            for _ in range(2))
    rows = plan.token_index(rank)
    ql, kl, vl = (t[rows].clone().requires_grad_() for t in (q, k, v))
    batched.LAUNCH_BYTES = case["launch_bytes"]
    out = context_parallel_attention(ql, kl, vl, plan, group=dist.group.WORLD,
                                     softmax_scale=case["scale"],
                                     ring_exchange=case["exchange"])
    (out * dout[rows]).sum().backward()
    want = _oracle_rows(q, k, v, dout, cu, rows.numpy(), case["scale"])
    return max((mine - ref).abs().max().item() for mine, ref in
               zip((out, ql.grad, kl.grad, vl.grad), want))


def _soak(rank: int, world: int, count: int, seed: int):
    """Run cases 0..count-1 in order; return (the p2p log, the largest error per case)."""
    log, errors = [], []
    default = batched.LAUNCH_BYTES
    with recording(log):
        for index in range(count):
            case = _case(world, index, seed)
            try:
                error = _run_case(rank, world, case)
            except Exception as failure:
                raise AssertionError(f"rank {rank}, case {case}: {failure!r}") from failure
            finally:
                batched.LAUNCH_BYTES = default
            if not error < TOL:
                raise AssertionError(f"rank {rank}, case {case}: error {error:.3g} > {TOL}")
            errors.append(error)
    return log, errors


WORLDS = [(2, 60), (4, 60), (8, 30), (16, 10)]  # (CP size, cases under the CI profile)


@pytest.mark.slow
@pytest.mark.parametrize("world,ci_cases", WORLDS)
def test_many_random_batches_on_one_process_group(world, ci_cases):
    count = examples(ci_cases)
    seed = SEED if settings.default.derandomize else int(np.random.SeedSequence().entropy % 2**32)
    results = run_ranks(_soak, world, count, seed, timeout=120.0 + 2.0 * count * world)
    logs = [log for log, _ in results]
    assert violations(logs) == []
    assert all(len(errors) == count for _, errors in results)
    sends = sum(entry[0] == "send" for log in logs for entry in log)
    assert sends > count, "keys and values moved in too few cases to prove anything"


def test_the_ci_sequences_draw_every_choice():
    """What the CI cases above claim to cover, they draw: every algorithm, ring executor,
    landing choice and document mix, and hybrid with a Ulysses degree strictly between 1 and
    CP."""
    cases = [_case(world, i) for world, ci_cases in WORLDS for i in range(ci_cases)]
    assert {c["algo"] for c in cases} == {"ring", "hybrid", "ulysses"}
    for algo in ("ring", "hybrid"):
        assert {c["exchange"] for c in cases if c["algo"] == algo} == {
            "batched", "batched-keep", "steps"}
    assert {c["launch_bytes"] for c in cases} == {batched.LAUNCH_BYTES, -1, 1 << 40}
    assert {c["mix"] for c in cases} == set(MIXES)
    assert {c["kv_heads"] for c in cases} == {1, 2, 4, 8}
    assert {c["world"] for c in cases if c["algo"] == "hybrid" and
            1 < c["degree"] < c["world"]} == {4, 8, 16}
