"""Ring, Ulysses and Hybrid attention on gloo ranks against the float64 dense oracle.

Each rank computes its rows with `context_parallel_attention`; the output and the gradients
of q, k and v must equal the single-process dense document-masked reference to 1e-10
(float64: the only differences are summation order and the log-sum-exp merge). Ring and
Hybrid run with both ring executors (`ring_exchange` "batched" and "steps"; some cases with
"batched-keep", whose backward reuses the forward's received rows).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_eod import (build_doc_layout, context_parallel_attention, create_hybrid_groups,
                          plan_context_parallel)
from tests.harness import run_ranks
from tests.reference import dense_document_attention, random_layout_tokens

EOD, HEADS, DIM = 50, 8, 16
TOL = 1e-10


def _check_rank(rank, world, algo, degree, kind, b, s, kv_heads, scale, seed,
                exchange="batched", concurrent_calls=False, strided_heads=False):
    tokens = random_layout_tokens(kind, b, s, EOD, seed)
    layout = build_doc_layout(tokens, EOD)
    plan = plan_context_parallel(layout.cu_seqlens, world, algo, degree)
    if algo == "hybrid":
        create_hybrid_groups(dist.group.WORLD, degree)
    gen = torch.Generator().manual_seed(seed + 1)
    n = b * s
    q = torch.randn(n, HEADS, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(n, kv_heads, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(n, kv_heads, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(n, HEADS, DIM, generator=gen, dtype=torch.float64)

    idx = plan.token_index(rank)
    ql, kl, vl = (t.detach()[idx].clone().requires_grad_() for t in (q, k, v))
    inputs = (ql, kl, vl)
    if strided_heads:  # head_dim not dense (stride = heads), as an einsum's result can be
        inputs = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in inputs)
        assert all(t.stride(-1) > 1 for t in inputs)
    out = context_parallel_attention(*inputs, plan, group=dist.group.WORLD,
                                     softmax_scale=scale, ring_exchange=exchange,
                                     concurrent_calls=concurrent_calls)
    (out * dout[idx]).sum().backward()

    ref = dense_document_attention(q, k, v, layout.cu_seqlens, scale or DIM ** -0.5)
    (ref * dout).sum().backward()
    errors = {name: (mine - full[idx]).abs().max().item() for name, mine, full in (
        ("out", out, ref), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad),
        ("dv", vl.grad, v.grad))}
    assert max(errors.values()) < TOL, f"rank {rank}: {errors}"
    return errors


CASES = [
    # (algo, world, ulysses_degree, ring_exchange)
    *[(algo, world, degree, exchange) for exchange in ("batched", "steps")
      for algo, world, degree in (("ring", 2, None), ("ring", 4, None), ("ring", 8, None),
                                  ("hybrid", 4, 2), ("hybrid", 8, 2), ("hybrid", 8, 4))],
    ("ulysses", 2, None, "batched"), ("ulysses", 4, None, "batched"),
    ("ulysses", 8, None, "batched"),
    ("ring", 4, None, "batched-keep"), ("ring", 8, None, "batched-keep"),
    ("hybrid", 8, 2, "batched-keep"),
]


@pytest.mark.parametrize("algo,world,degree,exchange", CASES)
@pytest.mark.parametrize("kind,b,s", [("mixed", 2, 96), ("spanning", 1, 128), ("short", 3, 32)])
def test_matches_dense_reference(algo, world, degree, exchange, kind, b, s):
    run_ranks(_check_rank, world, algo, degree, kind, b, s, 2, None, world * 7 + b, exchange)


@pytest.mark.parametrize("algo,world,degree,exchange", [
    ("ring", 4, None, "batched"), ("ring", 4, None, "steps"), ("hybrid", 8, 4, "batched"),
    ("hybrid", 8, 4, "steps"), ("ulysses", 8, None, "batched"),
    ("hybrid", 8, 4, "batched-keep")])
@pytest.mark.parametrize("kv_heads", [1, 8])
def test_gqa_and_softmax_scale(algo, world, degree, exchange, kv_heads):
    run_ranks(_check_rank, world, algo, degree, "mixed", 2, 64, kv_heads, 0.37, 11, exchange)


@pytest.mark.parametrize("exchange", ["batched", "batched-keep"])
@pytest.mark.parametrize("algo,world,degree", [("ring", 4, None), ("hybrid", 8, 2)])
def test_concurrent_calls_option(algo, world, degree, exchange):
    """concurrent_calls reaches the batched executors, forward and backward (on a CPU the
    two calls run in sequence, in the order the streams would start them: the backward of
    batched-keep then runs the local call first); GPU tests check the two streams."""
    run_ranks(_check_rank, world, algo, degree, "mixed", 2, 96, 2, None, 3, exchange, True)


@pytest.mark.parametrize("algo,world,degree", [("ring", 4, None), ("hybrid", 8, 2)])
def test_returned_gradients_summed_over_the_rows_sent(algo, world, degree, monkeypatch):
    """A group that sent some row several times sums the gradients returned for it in float32
    over all its rows, or over the run covering the rows sent where that saves more bytes
    than a launch costs (large rows; the rows here are tiny, so the tests above sum over all
    rows); forced here, in the forked ranks."""
    from megatron_eod.attention import batched

    monkeypatch.setattr(batched, "LAUNCH_BYTES", -1)
    run_ranks(_check_rank, world, algo, degree, "mixed", 2, 96, 2, None, 5, "batched")


@pytest.mark.parametrize("algo,world,degree,exchange", [
    ("ring", 1, None, "batched"), ("ring", 4, None, "batched"), ("ring", 4, None, "steps"),
    ("ring", 4, None, "batched-keep"), ("hybrid", 4, 2, "batched"), ("ulysses", 4, None,
                                                                      "batched")])
def test_inputs_whose_head_dim_is_not_dense(algo, world, degree, exchange):
    """q, k, v with a strided last dim (an einsum's output): PyTorch's CPU flash kernel reads
    them as if dense, so ring and CP=1 were silently wrong (errors up to inf; Ulysses' all-to-all
    copied them)."""
    run_ranks(_check_rank, world, algo, degree, "mixed", 2, 64, 2, None, 13, exchange, False,
              True)
