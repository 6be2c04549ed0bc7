"""With `--reset-attention-mask`, a token's model output depends only on its own document.

The same target document is placed in two rows whose other documents differ in content and
length (so it also lands at another offset and, under CP, on other ranks). Its logits from
the tiny GPT must agree to 1e-5 (float32; only the summation order changes). The control
runs without the reset mask, where the target sees the documents before it: its logits must
then differ by far more than the tolerance, so the test can fail.
"""

import pytest
import torch

from megatron_eod.megatron.batch import slice_batch_for_cp
from megatron_eod.megatron.batch_context import EodContextRegistry
from tests.harness import run_ranks
from tests.megatron.tiny_model import EOD, cp_setup, tiny_gpt

S, TARGET_LEN = 48, 13


def _rows():
    """Two [1, S] rows holding the same target document after different documents."""
    g = torch.Generator().manual_seed(11)
    words = lambda n: torch.randint(0, EOD, (n,), generator=g)  # noqa: E731 - no EoD inside
    target = torch.cat([words(TARGET_LEN - 1), torch.tensor([EOD])])
    rows, starts = [], []
    for before in (17, 6):  # a different prefix length moves the target to another offset
        head = torch.cat([words(before - 1), torch.tensor([EOD])])
        tail = words(S - before - TARGET_LEN)
        rows.append(torch.cat([head, target, tail]).unsqueeze(0))
        starts.append(before)
    return rows, starts


def _logits(rank, world, algo, degree, reset_attention_mask):
    with cp_setup(world, algo, degree) as cp_group:
        registry = EodContextRegistry()
        model = tiny_gpt(world, registry, seed=3, max_sequence_length=S).eval()
        rows, _ = _rows()
        out = []
        with torch.no_grad():
            for tokens in rows:
                batch = slice_batch_for_cp(tokens, tokens, EOD, registry, cp_size=world,
                                           cp_rank=rank, cp_group=cp_group, algo=algo,
                                           ulysses_degree=degree,
                                           reset_attention_mask=reset_attention_mask)
                logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
                out.append((batch.plan.token_index(rank), logits[0]))
        return out


def _target_logits(world, algo, degree, reset_attention_mask):
    """The target document's logits in each of the two rows, assembled from all ranks."""
    per_rank = run_ranks(_logits, world, algo, degree, reset_attention_mask)
    _, starts = _rows()
    result = []
    for row, start in enumerate(starts):
        full = torch.zeros(S, per_rank[0][row][1].shape[-1])
        for rank_out in per_rank:
            index, logits = rank_out[row]
            full[index] = logits
        result.append(full[start:start + TARGET_LEN])
    return result


@pytest.mark.parametrize("world,algo,degree", [(1, "ring", None), (2, "ring", None),
                                               (2, "ulysses", None), (4, "hybrid", 2)])
def test_target_document_output_ignores_other_documents(world, algo, degree):
    first, second = _target_logits(world, algo, degree, reset_attention_mask=True)
    assert (first - second).abs().max().item() < 1e-5


def test_control_without_reset_mask_sees_other_documents():
    first, second = _target_logits(2, "ring", None, reset_attention_mask=False)
    assert (first - second).abs().max().item() > 1e-2
