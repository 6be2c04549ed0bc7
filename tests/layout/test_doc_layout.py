"""`build_doc_layout`: semantics against a per-token reference loop, pads, errors, scale.

The megatron-core parity test lives in tests/megatron/test_dataset.py; this file checks the
pieces Megatron's dataset never produces (pad runs, b*s edge cases, bad arguments).
"""

import itertools

import pytest
import torch

from megatron_eod import DocLayout, build_doc_layout, dense_attention_mask

EOD, PAD = 9, 7


def reference_layout(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss,
                     pad=None):
    """A deliberately naive per-token loop with the same rules, written independently."""
    b, s = tokens.shape
    starts, positions, loss = [], torch.zeros(b, s, dtype=torch.long), torch.ones(b, s)
    for r in range(b):
        pos = 0
        for i in range(s):
            t = int(tokens[r, i])
            prev = int(tokens[r, i - 1]) if i else None
            pad_flip = pad is not None and i > 0 and (t == pad) != (prev == pad)
            if i == 0 or pad_flip or (reset_attention_mask and prev == eod):
                starts.append(r * s + i)
            if i == 0 or pad_flip or (reset_position_ids and prev == eod):
                pos = 0
            positions[r, i] = pos if reset_position_ids else i
            pos += 1
            if (eod_mask_loss and t == eod) or t == pad:
                loss[r, i] = 0
            if pad is not None and i + 1 < s and int(tokens[r, i + 1]) == pad:
                loss[r, i] = 0
    return starts + [b * s], positions, loss


def random_tokens(gen, b, s, p_eod, p_pad=0.0):
    tokens = torch.randint(0, 6, (b, s), generator=gen)
    u = torch.rand(b, s, generator=gen)
    tokens[u < p_eod] = EOD
    tokens[(u >= p_eod) & (u < p_eod + p_pad)] = PAD
    return tokens


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
@pytest.mark.parametrize("with_pad", [False, True])
def test_matches_reference_on_random_batches(flags, with_pad):
    reset_pos, reset_attn, eod_loss = flags
    gen = torch.Generator().manual_seed(hash((flags, with_pad)) % 2**31)
    for trial in range(40):
        b, s = int(torch.randint(1, 5, (1,), generator=gen)), int(
            torch.randint(1, 40, (1,), generator=gen))
        tokens = random_tokens(gen, b, s, p_eod=[0.0, 0.1, 0.5, 1.0][trial % 4],
                               p_pad=0.2 if with_pad else 0.0)
        pad = PAD if with_pad else None
        layout = build_doc_layout(tokens, EOD, reset_pos, reset_attn, eod_loss, pad_token_id=pad)
        starts, positions, loss = reference_layout(tokens, EOD, reset_pos, reset_attn,
                                                   eod_loss, pad)
        assert layout.cu_seqlens.dtype == torch.int32
        assert layout.cu_seqlens.tolist() == starts, tokens
        assert torch.equal(layout.position_ids, positions), tokens
        assert torch.equal(layout.loss_mask, loss), tokens
        assert layout.max_seqlen == max(b - a for a, b in zip(starts, starts[1:]))


def test_worked_example():
    tokens = torch.tensor([[5, EOD, 1, EOD, EOD, 3, 4, 2],
                           [EOD, 1, 2, 3, 4, 5, 6, EOD]])
    layout = build_doc_layout(tokens, EOD, eod_mask_loss=True)
    # EoD closes its document; row 0 -> [5 E][1 E][E][3 4 2]; row 1 -> [E][1 .. 6 E].
    assert layout.cu_seqlens.tolist() == [0, 2, 4, 5, 8, 9, 16]
    assert layout.position_ids.tolist() == [[0, 1, 0, 1, 0, 0, 1, 2], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert layout.loss_mask.tolist() == [[1, 0, 1, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 0]]
    assert (layout.max_seqlen, layout.num_docs, layout.batch_size, layout.seq_length) == (
        7, 6, 2, 8)
    assert layout.seqlens().tolist() == [2, 2, 1, 3, 1, 7]
    assert layout.document_ids().tolist() == [[0, 0, 1, 1, 2, 3, 3, 3], [4, 5, 5, 5, 5, 5, 5, 5]]


def test_padded_rows_attend_only_within_their_pad_run():
    # Fine-tuning style: one document per row, then pads (and one pad run in the middle).
    tokens = torch.tensor([[1, 2, EOD, PAD, PAD, PAD],
                           [3, PAD, PAD, 4, 5, EOD]])
    layout = build_doc_layout(tokens, EOD, pad_token_id=PAD)
    assert layout.cu_seqlens.tolist() == [0, 3, 6, 7, 9, 12]
    allowed = ~dense_attention_mask(layout)[:, 0]
    pads = tokens == PAD
    for r in range(2):
        for i in range(6):
            for j in range(6):
                if pads[r, i] != pads[r, j]:
                    assert not allowed[r, i, j], (r, i, j)  # nobody crosses a pad boundary
    assert layout.loss_mask.tolist() == [[1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 1, 2], [0, 0, 1, 0, 1, 2]]


def test_flags_are_independent():
    tokens = torch.tensor([[1, EOD, 2, 3]])
    only_pos = build_doc_layout(tokens, EOD, reset_position_ids=True, reset_attention_mask=False)
    assert only_pos.cu_seqlens.tolist() == [0, 4]
    assert only_pos.position_ids.tolist() == [[0, 1, 0, 1]]
    only_mask = build_doc_layout(tokens, EOD, reset_position_ids=False, reset_attention_mask=True)
    assert only_mask.cu_seqlens.tolist() == [0, 2, 4]
    assert only_mask.position_ids.tolist() == [[0, 1, 2, 3]]


def test_layout_is_frozen():
    layout = build_doc_layout(torch.tensor([[1, EOD]]), EOD)
    assert isinstance(layout, DocLayout)
    with pytest.raises(Exception):
        layout.max_seqlen = 5


def test_million_token_row_needs_no_dense_mask():
    # A dense mask of this row would be 2**40 bytes; the layout is a few MB.
    s = 2**20
    tokens = torch.randint(0, 6, (1, s), generator=torch.Generator().manual_seed(0))
    tokens[0, ::1000] = EOD
    layout = build_doc_layout(tokens, EOD)
    assert layout.num_docs == len(range(0, s, 1000)) + 1
    assert layout.position_ids[0, 1000].item() == 999 and layout.position_ids[0, 1001] == 0


@pytest.mark.parametrize("call,message", [
    (lambda: build_doc_layout(torch.tensor([1, EOD]), EOD), r"shape \[b, s\]"),
    (lambda: build_doc_layout(torch.ones(2, 3), EOD), "integer token ids"),
    (lambda: build_doc_layout(torch.zeros(0, 4, dtype=torch.long), EOD), "must not be empty"),
    (lambda: build_doc_layout([[1, 2]], EOD), "torch.Tensor"),
    (lambda: build_doc_layout(torch.ones(1, 3, dtype=torch.long), None), "eod_token_id is"),
    (lambda: build_doc_layout(torch.ones(1, 3, dtype=torch.long), -1), "eod_token_id must be"),
    (lambda: build_doc_layout(torch.ones(1, 3, dtype=torch.long), 2.0), "eod_token_id must be"),
    (lambda: build_doc_layout(torch.ones(1, 3, dtype=torch.long), 300, vocab_size=258),
     "outside the vocabulary"),
    (lambda: build_doc_layout(torch.ones(1, 3, dtype=torch.long), 5, pad_token_id=5),
     "pad_token_id must differ"),
    (lambda: build_doc_layout(torch.ones(1, 3, dtype=torch.long), 5, pad_token_id=999,
                              vocab_size=258), "pad_token_id=999 is outside"),
    (lambda: build_doc_layout(torch.tensor([[1, 0, 2]], dtype=torch.uint8), 256),
     "eod_token_id 256 does not fit tokens' dtype torch.uint8"),  # it read byte 0 as EoD
    (lambda: build_doc_layout(torch.tensor([[1, 0, 2]], dtype=torch.int16), 5,
                              pad_token_id=40000), "pad_token_id 40000 does not fit"),
    # A helper's sweep of the public API: these failed inside torch or Python's operators.
    (lambda: build_doc_layout(torch.tensor([[1, 9]]), 9, vocab_size="100"),
     "vocab_size must be None or a positive int, got '100'"),
    (lambda: build_doc_layout(torch.tensor([[1, 9]]), 9, vocab_size=100.5), "positive int"),
    (lambda: build_doc_layout(torch.tensor([[1, 9]]), 9, vocab_size=0), "positive int"),
    (lambda: build_doc_layout(torch.tensor([[1, 9]], device="meta"), 9),
     "tokens must be a dense tensor with values, got a meta one"),
    (lambda: build_doc_layout(torch.nested.nested_tensor(
        [torch.tensor([1, 9]), torch.tensor([3])], layout=torch.jagged), 9),
     "got a nested one"),
    (lambda: dense_attention_mask(torch.tensor([[1, 9]])),
     "layout must be the DocLayout build_doc_layout returns, got Tensor"),
])
def test_bad_inputs_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_whole_float_vocab_size_is_accepted():
    assert build_doc_layout(torch.tensor([[1, 9]]), 9, vocab_size=100.0).num_docs == 1
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build_doc_layout(torch.tensor([[1, 9]]), 9, vocab_size=9.0)


def test_token_ids_of_every_integer_kind_are_accepted():
    """A tokenizer's id may come as a numpy integer or a 0-d tensor (it was refused as 'must
    be an int token id')."""
    import numpy as np

    tokens = torch.tensor([[1, EOD, 2, 3, EOD, 4]])
    want = build_doc_layout(tokens, EOD, pad_token_id=3).cu_seqlens
    for eod, pad in ((np.int64(EOD), np.int32(3)), (torch.tensor(EOD), torch.tensor(3))):
        assert torch.equal(build_doc_layout(tokens, eod, pad_token_id=pad).cu_seqlens, want)
    for flag in (True, np.bool_(True), torch.tensor(True)):  # a flag, not token id 1
        with pytest.raises(ValueError, match="eod_token_id must be an int token id"):
            build_doc_layout(tokens, flag)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(3)
    tokens = random_tokens(gen, 4, 4096, p_eod=0.01, p_pad=0.01)
    cpu = build_doc_layout(tokens, EOD, pad_token_id=PAD, eod_mask_loss=True)
    gpu = build_doc_layout(tokens.cuda(), EOD, pad_token_id=PAD, eod_mask_loss=True)
    assert gpu.cu_seqlens.is_cuda and gpu.max_seqlen == cpu.max_seqlen
    for name in ("cu_seqlens", "position_ids", "loss_mask"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name


@pytest.mark.parametrize("seed", range(20))
def test_a_layout_from_document_starts_is_the_eod_layout_of_the_same_documents(seed):
    """doc_layout_from_starts (--dataloader-inter-document-masking: documents from the
    dataset's index) on the starts an EoD layout has (after each EoD, and every row start)
    gives its cu_seqlens, positions and max_seqlen, with no loss mask of its own."""
    from megatron_eod.layout import doc_layout_from_starts

    g = torch.Generator().manual_seed(seed)
    b, s, eod = int(torch.randint(1, 4, (1,), generator=g)), 32, 9
    tokens = torch.randint(0, 12, (b, s), generator=g)  # 9, 10, 11: EoD about 1 in 12
    eod_layout = build_doc_layout(tokens, eod)
    starts = torch.zeros(b, s, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eod
    layout = doc_layout_from_starts(starts)
    assert torch.equal(layout.cu_seqlens, eod_layout.cu_seqlens)
    assert torch.equal(layout.position_ids, eod_layout.position_ids)
    assert layout.max_seqlen == eod_layout.max_seqlen
    assert torch.equal(layout.loss_mask, torch.ones(b, s))


def test_document_starts_from_gpt_datasets_cu_seqlens():
    """What GPTDataset (inter_document_masking) hands each row: its documents' offsets padded
    with the sequence length to length s+1; a document may start at the row's last token."""
    from megatron_eod.megatron.steps import _doc_starts

    cu = torch.tensor([[0, 3, 7, 8, 8, 8, 8, 8, 8], [0, 8, 8, 8, 8, 8, 8, 8, 8]])
    assert _doc_starts(cu, 8).tolist() == [[1, 0, 0, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0, 0, 0]]
