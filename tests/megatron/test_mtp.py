"""megatron/mtp.py: megatron-core's MTP shift made document-aware under CP, on gloo ranks,
against the shift done on the whole stream (every rank's tokens put back in order)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_eod.megatron import mtp
from megatron_eod.megatron.batch_context import EodBatchContext
from megatron_eod.plan import plan_context_parallel
from tests.harness import run_ranks

# (documents' lengths, CP size, algorithm, Ulysses degree): 1-token documents, a document over
# every rank, one document filling the stream.
LAYOUTS = [([1, 7, 1, 1, 30, 2, 3, 19], 4, "ring", None),
           ([64], 4, "ring", None),
           ([5, 1, 40, 1, 1, 16], 4, "hybrid", 2),
           ([9, 23, 32], 2, "ulysses", None)]


def _roll(tensor):
    """megatron-core's MTP module's roll_tensor, as it calls it (ours after mtp.install())."""
    from megatron.core.transformer import multi_token_prediction

    return multi_token_prediction.roll_tensor(tensor, shifts=-1, dims=-1)


def reference_shift(stream, lengths, depth):
    """stream [n] shifted `depth` tokens left within each document, 0 past its end."""
    out = torch.zeros_like(stream)
    start = 0
    for length in lengths:
        doc = stream[start:start + length]
        if depth < length:
            out[start:start + length - depth] = doc[depth:]
        start += length
    return out


def _roll_on_ranks(rank, world, lengths, algo, degree):
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    plan = plan_context_parallel(cu, world, algo, degree)
    index = plan.token_index(rank)
    stream = torch.arange(1, int(cu[-1]) + 1)
    mask = (torch.arange(int(cu[-1])) % 3 != 0).float()  # some tokens masked
    context = EodBatchContext(plan=plan, position_ids=index, cp_group=dist.group.WORLD)
    mtp.install()
    local, local_mask = stream[index].unsqueeze(0), mtp.loss_mask_for_mtp(
        mask[index].unsqueeze(0), context)
    results = []
    with mtp.current(context, local_mask):
        for _ in range(3):  # three heads: each shifts the last one's result again
            local, _ = _roll(local)
            local_mask, count = _roll(local_mask)
            results.append((index, local[0], local_mask[0], float(count)))
    return results


@pytest.mark.parametrize("lengths,cp,algo,degree", LAYOUTS)
def test_each_head_shifts_within_documents_wherever_cp_puts_the_tokens(lengths, cp, algo,
                                                                      degree):
    per_rank = run_ranks(_roll_on_ranks, cp, lengths, algo, degree)
    n = sum(lengths)
    stream = torch.arange(1, n + 1)
    mask = (torch.arange(n) % 3 != 0).float()
    ends = torch.zeros(n)
    ends[torch.tensor(np.cumsum(lengths)) - 1] = 1  # each document's last token
    mtp_mask = mask * (1 - ends)
    for depth in (1, 2, 3):
        got, got_mask = torch.zeros(n, dtype=torch.int64), torch.zeros(n)
        counts = 0.0
        for results in per_rank:
            index, values, masks, count = results[depth - 1]
            got[index], got_mask[index] = values, masks
            counts += count
        assert torch.equal(got, reference_shift(stream, lengths, depth)), depth
        expected_mask = reference_shift(mtp_mask, lengths, depth)
        assert torch.equal(got_mask, expected_mask), depth
        # A head's target (the token `depth` + 1 ahead) is never past its document's end.
        targets = torch.arange(n) + depth + 1
        doc_end = torch.tensor(np.repeat(np.cumsum(lengths), lengths))
        assert not (got_mask.bool() & (targets >= doc_end)).any()
        # The counts, summed over the CP group, are the rolled mask's: the micro-batch's.
        assert counts == pytest.approx(float(expected_mask.sum()))


def test_without_an_eod_forward_the_original_shift_runs():
    mtp.install()
    rolled, total = _roll(torch.tensor([[1, 2, 3, 4]]))
    assert rolled.tolist() == [[2, 3, 4, 0]] and int(total) == 9
