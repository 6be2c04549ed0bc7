"""No host reads in a model step's EoD attention path, checked on CPU gloo ranks.

The per-layer path the trainer runs after `get_batch` (our core-attention module reading the
micro-batch's plan from the batch context, the Ulysses all-to-all, the ring executor, the
communication layer) must not read tensor values on the host: on a GPU each read would stall
every layer's launches. A tiny megatron-core GPT with our layer spec runs forward and backward
at CP 2 (ring, ulysses) and CP 4 (hybrid 2x2) under `tests.host_reads.HostReads`; the batch
is sliced and planned before, as `get_batch` does (tests/megatron/test_batch.py checks, on a
GPU, that moving it makes no sync either). Reads by megatron-core itself are not ours and not
counted; the CPU kernel adapter is CPU-only and exempt, and so is the read of the context id,
which is a host tensor on GPUs too.
"""

import pytest

from megatron_eod.megatron.batch import slice_batch_for_cp
from megatron_eod.megatron.batch_context import EodContextRegistry
from tests.harness import run_ranks
from tests.host_reads import HostReads
from tests.megatron.tiny_model import EOD, cp_setup, tiny_gpt
from tests.reference import random_layout_tokens

B, S = 2, 48
# CPU-only code, and the context id: a host tensor on GPUs too, by design (batch_context.py;
# tests/megatron/test_batch.py checks it stays there), read once per layer without a sync.
EXEMPT = ("CPUExactBackend.", "EodContextRegistry.lookup")


def _reads(rank, world, algo, degree, exchange):
    with cp_setup(world, algo, degree) as cp_group:
        registry = EodContextRegistry()
        model = tiny_gpt(world, registry, seed=1234, ring_exchange=exchange)
        stream = random_layout_tokens("mixed", B, S + 1, EOD, seed=5)
        tokens, labels = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
        found = []
        for step in range(2):  # the first also warms the groups up: both must read nothing
            batch = slice_batch_for_cp(tokens, labels, EOD, registry, cp_size=world,
                                       cp_rank=rank, cp_group=cp_group, algo=algo,
                                       ulysses_degree=degree, eod_mask_loss=True)
            with HostReads(exempt=EXEMPT) as reads:
                losses = model(batch.tokens, batch.position_ids, batch.attention_mask,
                               labels=batch.labels)
                (losses.float() * batch.loss_mask).sum().backward()
            found.extend(reads.found)
        return found


@pytest.mark.parametrize("algo,world,degree,exchange", [
    ("ring", 2, None, "batched"), ("ring", 2, None, "steps"), ("ulysses", 2, None, "batched"),
    ("hybrid", 4, 2, "batched-keep")])
def test_a_model_step_reads_no_value_on_the_host(algo, world, degree, exchange):
    found = run_ranks(_reads, world, algo, degree, exchange)
    assert found == [[]] * world, found
