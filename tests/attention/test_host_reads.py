"""No host reads inside attention forward and backward, checked on CPU gloo ranks.

Issue 11's rule "no host syncs inside attention" is checked on a GPU by
`torch.cuda.set_sync_debug_mode("error")` (tests/attention/test_simulate.py), which CI never
runs. Here every op dispatched while the real `context_parallel_attention` runs its forward
and backward on gloo ranks (ring, hybrid and ulysses; the batched, batched-keep and steps
executors; the communication layer included) is watched by `tests.host_reads.HostReads`:
a value read on the host from our code (`.item()`, `.tolist()`, `nonzero`, a boolean mask,
`torch.tensor` from Python data, ...) fails the test and is named by file and line. As on
the GPU, the plan's schedule is built (moved, there) before the call; two calls run, the first
warming the process groups up (a collective, no read). Exempt: the CPU kernel
adapter (`CPUExactBackend`, CPU-only), which reads document lengths on the host to build
its masks; the GPU backends call varlen kernels with lengths on the device, and the GPU test
covers them.
A deliberate read in the ring executor's merge must be caught (the checker can fail).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_eod import (build_doc_layout, context_parallel_attention, create_hybrid_groups,
                          plan_context_parallel)
from tests.harness import run_ranks
from tests.host_reads import HostReads
from tests.reference import random_layout_tokens

EOD = 50


def _reads(rank, world, algo, degree, exchange, kind, break_merge=False):
    tokens = random_layout_tokens(kind, 2, 96, EOD, seed=world)
    plan = plan_context_parallel(build_doc_layout(tokens, EOD).cu_seqlens, world, algo, degree)
    if algo == "hybrid":
        create_hybrid_groups(dist.group.WORLD, degree)
    plan.schedule(rank)  # built before, as the trainer's plan-ahead does (and moves it)
    gen = torch.Generator().manual_seed(rank)
    n = plan.num_tokens // world
    q, k, v = (torch.randn(n, 4, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA, and k/v not contiguous as Megatron hands them over

    def step():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*leaves, plan, group=dist.group.WORLD,
                                         ring_exchange=exchange)
        out.square().sum().backward()

    if break_merge:
        from megatron_eod.attention import ring
        real = ring.merge_into

        def merge_reading_a_value(*args, **kwargs):
            if args[0].abs().max().item() > 1e9:  # a host read, as a careless guard would be
                raise AssertionError
            return real(*args, **kwargs)

        ring.merge_into = merge_reading_a_value  # in this forked rank only
    with HostReads(exempt=("CPUExactBackend.",)) as reads:
        step()  # the first call also warms the groups up (a collective): both read nothing
        step()
    return reads.found


@pytest.mark.parametrize("algo,world,degree,exchange", [
    ("ring", 4, None, "batched"), ("ring", 4, None, "batched-keep"), ("ring", 4, None, "steps"),
    ("hybrid", 4, 2, "batched"), ("hybrid", 4, 2, "steps"), ("ulysses", 2, None, "batched")])
@pytest.mark.parametrize("kind", ["mixed", "spanning"])
def test_attention_reads_no_value_on_the_host(algo, world, degree, exchange, kind):
    found = run_ranks(_reads, world, algo, degree, exchange, kind)
    assert found == [[]] * world, found


def test_a_host_read_in_the_executor_is_caught():
    found = run_ranks(_reads, 4, "ring", None, "steps", "mixed", break_merge=True)
    assert any(f.startswith("aten._local_scalar_dense") and "attention/ring.py:" in f
               for rank in found for f in rank), found
