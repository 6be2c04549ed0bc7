"""Multi-token prediction against stock megatron-core, document by document (the method of
test_stock_equivalence.py): stock's GPTModel with its MTP block run on ONE document alone, and
ours on the packed micro-batch with the same weights, float64 (the cross entropy in float32, as
megatron-core computes it). Each MTP head's per-token loss (megatron-core's
compute_language_model_loss, recorded as each head calls it) must be equal wherever both count
it; and ours must count none whose target lies past its document."""

import torch

from megatron_eod.megatron import mtp
from megatron_eod.megatron.batch import slice_batch_for_cp
from megatron_eod.megatron.batch_context import EodContextRegistry
from megatron_eod.megatron.layer_spec import get_gpt_layer_eod_spec
from tests.harness import run_ranks
from tests.megatron.test_stock_equivalence import (EOD, SEQ, VOCAB, _config, _document_bounds,
                                                   _packed_row)
from tests.megatron.tiny_model import cp_setup

HEADS = 2


def _recording(model):
    """model.compute_language_model_loss recording each call's (labels, per-token losses):
    the main head's and each MTP head's, in the order megatron-core computes them."""
    calls, original = [], model.compute_language_model_loss

    def compute_language_model_loss(labels, logits):
        loss = original(labels, logits)
        calls.append((labels.detach().clone(), loss.detach().double()))
        return loss

    model.compute_language_model_loss = compute_language_model_loss
    return calls


def _heads(calls, labels):
    """The MTP heads' per-token losses, in order: every call but the main head's (the one
    given the model's own labels; megatron-core 0.19 computes it last, 0.16 first)."""
    main = [i for i, (given, _) in enumerate(calls) if torch.equal(given, labels)]
    assert len(main) == 1 and len(calls) == 1 + HEADS, [c[0] for c in calls]
    return [loss for i, (_, loss) in enumerate(calls) if i != main[0]]


def _models():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)

    config, our_config = (_config(mtp_num_layers=HEADS) for _ in range(2))
    layer = get_gpt_layer_local_spec()
    stock = GPTModel(config, layer, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(config, layer, False))
    registry = EodContextRegistry()
    ours_layer = get_gpt_layer_eod_spec(registry)
    mtp.install()
    ours = GPTModel(our_config, ours_layer, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="none",
                    mtp_block_spec=get_gpt_mtp_block_spec(our_config, ours_layer, False))
    ours.load_state_dict(stock.state_dict(), strict=True)
    return stock.double().eval(), ours.double().eval(), registry


def _compare(rank, world):
    from megatron.core.transformer import multi_token_prediction as core_mtp

    with cp_setup(1):
        torch.manual_seed(7)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(7)
        stock, ours, registry = _models()
        tokens = _packed_row(torch.Generator().manual_seed(3))
        labels = torch.roll(tokens.reshape(-1), -1).reshape(tokens.shape)
        batch = slice_batch_for_cp(tokens, labels, EOD, registry, eod_mask_loss=True)
        context = registry.lookup(batch.attention_mask)
        mask = mtp.loss_mask_for_mtp(batch.loss_mask, context)
        calls = _recording(ours)
        with torch.no_grad(), mtp.current(context, mask):
            ours(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels,
                 loss_mask=mask)
        heads = _heads(calls, batch.labels)
        stream = batch.plan.token_index(0)
        n = tokens.numel()
        packed = torch.zeros(HEADS, n, dtype=torch.float64)
        counted = torch.zeros(HEADS, n, dtype=torch.bool)
        # Which tokens each head counts: the mask shifted within documents, head + 1 times.
        with mtp.current(context, mask):
            rolled = mask
            for head in range(HEADS):
                rolled, _ = core_mtp.roll_tensor(rolled, shifts=-1, dims=-1)
                packed[head, stream] = heads[head][0]
                counted[head, stream] = rolled[0].bool()
        flat = tokens.reshape(-1)
        worst, compared, past_end = 0.0, 0, 0
        bounds = _document_bounds(tokens)
        for start, end in zip(bounds[:-1], bounds[1:]):
            doc = flat[start:end].unsqueeze(0)
            calls_alone, doc_labels = _recording(stock), torch.roll(doc, -1, dims=-1)
            with torch.no_grad():
                stock(doc, torch.arange(end - start).unsqueeze(0), None, labels=doc_labels)
            alone = _heads(calls_alone, doc_labels)
            for head in range(HEADS):
                # stock's head `head` at position i predicts token i + head + 2 of the document
                valid = torch.arange(end - start) + head + 2 < end - start
                ours_here = counted[head, start:end]
                past_end += int((ours_here & ~valid).sum())
                both = ours_here & valid
                diff = (alone[head][0][both] - packed[head, start:end][both]).abs()
                worst = max(worst, diff.max().item() if diff.numel() else 0.0)
                compared += int(both.sum())
        return worst, compared, past_end


def test_mtp_head_losses_equal_stock_on_each_document_alone():
    (worst, compared, past_end), = run_ranks(_compare, 1)
    assert past_end == 0, f"{past_end} counted targets lie past their document"
    assert compared > 20
    # megatron-core's cross entropy runs in float32 whatever the logits: a few ulps of ~4
    assert worst < 1e-5, f"max |MTP loss difference| {worst:.3g} over {compared} tokens"
