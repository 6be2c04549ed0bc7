"""megatron/batch.py: a micro-batch's local rows reach the GPU without a host wait."""

import pytest
import torch

from megatron_eod.megatron.batch import local_batch, plan_batch
from megatron_eod.megatron.batch_context import EodContextRegistry

EOD = 0


@pytest.mark.gpu
@pytest.mark.parametrize("cp_rank", [0, 3])
def test_local_batch_moves_to_the_gpu_without_a_host_sync(cp_rank):
    """The plan, the token index, positions and loss mask go host -> device without a
    blocking copy (each would drain the stream once per micro-batch), and the rows equal the
    CPU path's."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 50, (2, 256), generator=g)
    tokens[tokens % 7 == 0] = EOD
    labels = torch.roll(tokens, -1, 1)
    planned = plan_batch(tokens, EOD, cp_size=4, cp_rank=cp_rank, algo="hybrid",
                         ulysses_degree=2)
    cpu = local_batch(planned, tokens, labels, EodContextRegistry())
    on_gpu = tokens.cuda(), labels.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = local_batch(planned, *on_gpu, EodContextRegistry())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in ("tokens", "labels", "loss_mask", "position_ids"):
        assert getattr(gpu, name).is_cuda, name
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    assert gpu.plan.schedule(cp_rank).local.q_index.is_cuda
    # The context id stays on the host: every layer reads it (tests/megatron/test_host_reads.py
    # exempts that read for this reason).
    assert gpu.attention_mask.device.type == "cpu"
