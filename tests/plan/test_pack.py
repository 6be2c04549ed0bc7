"""The whole-document packer on its own: exact tokens when it answers, medium documents
never cut, and None where its long-document placement cannot fit."""

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from megatron_eod.plan.cost import doc_pairs
from megatron_eod.plan.pack import LONG_WORK, pack_documents
from tests.plan.mixes import examples, make_cu_seqlens, packing_inputs


@pytest.mark.parametrize("mix", ["web", "heavy", "mixed"])
@pytest.mark.parametrize("groups", [2, 4, 8])
def test_exact_tokens_and_whole_medium_documents(mix, groups):
    answered = 0
    for seed in range(4):
        cu = make_cu_seqlens(mix, 2, 8192, groups, seed)
        pieces = pack_documents(cu, groups)
        if pieces is None:
            continue
        answered += 1
        n = int(cu[-1])
        assert (pieces.tokens_per_group() == n // groups).all()
        held = np.zeros(n, np.int64)
        for g in range(groups):
            held[pieces.token_index(g)] += 1
        assert (held == 1).all()
        # Only long documents and pool documents are cut, and the pool sweep cuts at most
        # one document at each end per group: at most 2 x groups cut documents not long.
        lengths, work = np.diff(cu), doc_pairs(np.diff(cu))
        share, share_tokens = work.sum() / groups, n // groups
        cut = np.unique(pieces.doc[np.bincount(pieces.doc, minlength=lengths.size)[
            pieces.doc] > 1])
        long_docs = (lengths > share_tokens) | (work > LONG_WORK * share)
        assert (~long_docs[cut]).sum() <= 2 * groups, (cut.size, long_docs[cut].sum())
    assert answered >= 3  # these mixes have filler and room: the packer answers


def test_no_filler_or_a_long_document_too_big_for_its_groups_gives_none():
    assert pack_documents(np.array([0, 4096]), 4) is None  # one document: nothing to fill
    # Two long documents needing more groups than there are (their chunks exceed a share).
    assert pack_documents(np.array([0, 5, 10, 20000, 32768]), 4, spread=0.5) is None


@settings(max_examples=examples(150))
@given(packing_inputs(), st.sampled_from([(0.9, 0.05), (0.9, 0.2), (0.6, 0.2), (0.5, 0.5)]))
def test_every_answer_is_an_exact_partition(case, setting):
    cu, groups = case
    pieces = pack_documents(cu, groups, *setting)
    event("answered" if pieces is not None else "None")
    if pieces is None:
        return
    n = int(cu[-1])
    assert (pieces.tokens_per_group() == n // groups).all()
    index = np.concatenate([pieces.token_index(g) for g in range(groups)])
    assert np.array_equal(np.sort(index), np.arange(n))
    doc_end = cu[pieces.doc + 1]
    assert ((pieces.start >= pieces.doc_start) & (pieces.end <= doc_end)).all()
