"""Our EoD GPT against stock megatron-core, document by document.

Stock megatron-core's GPTModel (its local layer spec, its own RoPE or learned position
embedding, causal attention) run on ONE document alone is what EoD reset promises for that
document inside a packed row. Ours (the EoD layer spec, RoPE inside the attention at reset
positions) gets the same weights and the whole packed micro-batch; its logits at each
document's tokens must equal stock's logits for that document alone, float64. Rotary
variants cover every setting stock's RoPE reads: interleaved pairs, rotary_percent, base,
Llama-3 scaling, position interpolation, layers without RoPE (--no-rope-freq); plus q/k layer
norms, GQA and learned absolute positions. A RoPE that ignored any of them, or attended across
an EoD, fails here.
"""

import pytest
import torch

from megatron_eod.megatron.batch import slice_batch_for_cp
from megatron_eod.megatron.batch_context import EodContextRegistry
from megatron_eod.megatron.layer_spec import get_gpt_eod_block_spec, get_gpt_layer_eod_spec
from tests.harness import run_ranks
from tests.megatron.tiny_model import NEEDS_MLA, cp_setup, mla_buildable

VOCAB, EOD, SEQ = 64, 63, 40

MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
           qk_pos_emb_head_dim=8, v_head_dim=12, rope_type="rope", rotary_base=500,
           num_query_groups=4)

VARIANTS = {
    "rope": dict(),
    "interleaved": dict(config=dict(rotary_interleaved=True)),
    "partial-base": dict(model=dict(rotary_percent=0.5, rotary_base=500)),
    "llama3-scaling": dict(model=dict(rope_scaling=True, rope_scaling_factor=8.0,
                                      rotary_base=500000)),
    "interpolation": dict(model=dict(seq_len_interpolation_factor=4.0)),
    "qk-layernorm-mha": dict(qk_layernorm=True, config=dict(num_query_groups=4,
                                                             qk_layernorm=True)),
    "learned-absolute": dict(position="learned_absolute"),
    "no-rope-layers": dict(config=dict(no_rope_freq=[0, 1])),
    # megatron-core's own MoE layer (router, dispatcher, experts) in its decoder block spec,
    # a dense layer then an MoE one, as --moe-layer-freq [0,1]: ours is that block spec with
    # EoD attention slotted in (layer_spec.get_gpt_eod_block_spec)
    # multi-latent attention (q/kv LoRA ranks, a decoupled RoPE head dim, v head dim != q/k
    # head dim): megatron-core's MLA applies RoPE itself, here at the reset positions (mla.py)
    "mla": dict(block=True, config=dict(**MLA)),
    "mla-yarn": dict(block=True, config=dict(MLA, rope_type="yarn", rotary_scaling_factor=4.0,
                                             original_max_position_embeddings=16)),
    "moe": dict(block=True, config=dict(num_moe_experts=4, moe_router_topk=2,
                                        moe_ffn_hidden_size=48, moe_layer_freq=[0, 1],
                                        add_bias_linear=False,
                                        moe_token_dispatcher_type="alltoall")),
}


def _config(**overrides):
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=64, use_cpu_initialization=True, hidden_dropout=0.0,
                  attention_dropout=0.0, bias_activation_fusion=False,
                  bias_dropout_fusion=False, apply_rope_fusion=False,
                  masked_softmax_fusion=False, persist_layer_norm=False,
                  gradient_accumulation_fusion=False, params_dtype=torch.float64)
    fields.update(overrides)
    kind = MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig
    return kind(**fields)


class ReferenceCoreAttention(torch.nn.Module):
    """Stock's core attention for MLA, whose own (megatron-core's local DotProductAttention)
    takes no separate q/k and v head dims: plain causal softmax attention, float64, over the
    one document stock is given."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        s, b, h, _ = query.shape
        scores = torch.einsum("qbhd,kbhd->bhqk", query, key) * self.scale
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        return torch.einsum("bhqk,kbhd->qbhd", probs, value).reshape(s, b, -1)


def _models(variant):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec)

    # Separate but equal configs: a test may break ours without touching stock's.
    config, our_config = (_config(**variant.get("config", {})) for _ in range(2))
    rotary = variant.get("model", {})
    position = variant.get("position", "rope")
    qk = variant.get("qk_layernorm", False)
    registry = EodContextRegistry()
    rope = dict(qk_layernorm=qk, rotary_percent=0.0 if position != "rope" else
                rotary.get("rotary_percent", 1.0),
                **{k: v for k, v in rotary.items() if k != "rotary_percent"})
    if variant.get("block"):  # the decoder block specs (MoE, MLA)
        stock_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        if config.multi_latent_attention:
            for layer in stock_spec.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = \
                    ReferenceCoreAttention
        spec = get_gpt_eod_block_spec(registry, our_config, **rope)
    else:
        stock_spec = get_gpt_layer_local_spec(qk_layernorm=qk)
        spec = get_gpt_layer_eod_spec(registry, **rope)
    stock = GPTModel(config, stock_spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type=position, **rotary)
    ours = GPTModel(our_config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="none" if position == "rope" else position)
    ours.load_state_dict(stock.state_dict(), strict=True)
    return stock.double().eval(), ours.double().eval(), registry


def _packed_row(generator):
    """Two rows: documents of 1, 2, 7, 13 and the rest (the last without EoD), and one
    document filling a row with no EoD at all."""
    row = torch.randint(0, EOD, (2, SEQ), generator=generator)
    for end in (0, 2, 9, 22):
        row[0, end] = EOD
    return row


def _compare(rank, world, name):
    variant = VARIANTS[name]
    with cp_setup(1):
        torch.manual_seed(7)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(7)
        stock, ours, registry = _models(variant)
        tokens = _packed_row(torch.Generator().manual_seed(3))
        batch = slice_batch_for_cp(tokens, tokens, EOD, registry)
        with torch.no_grad():
            packed = ours(batch.tokens, batch.position_ids, batch.attention_mask)[0]
        stream = batch.plan.token_index(0)
        logits = torch.empty(tokens.numel(), VOCAB, dtype=torch.float64)
        logits[stream] = packed
        worst = 0.0
        flat = tokens.reshape(-1)
        bounds = _document_bounds(tokens)
        for start, end in zip(bounds[:-1], bounds[1:]):
            doc = flat[start:end].unsqueeze(0)
            positions = torch.arange(end - start).unsqueeze(0)
            with torch.no_grad():
                alone = stock(doc, positions, None)[0]
            worst = max(worst, (alone - logits[start:end]).abs().max().item())
        return worst, len(bounds) - 1


def _document_bounds(tokens):
    bounds, offset = [0], 0
    for row in tokens:
        ends = (row == EOD).nonzero().flatten().tolist()
        bounds += [offset + e + 1 for e in ends if e + 1 < row.numel()]
        offset += row.numel()
        bounds.append(offset)
    return bounds


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.skipif(not mla_buildable(), reason=NEEDS_MLA))
    if name.startswith("mla") else name for name in VARIANTS])
def test_packed_logits_equal_stock_on_each_document_alone(name):
    (worst, documents), = run_ranks(_compare, 1, name)
    assert documents == 6
    assert worst < 1e-9, f"{name}: max |logit difference| {worst:.3g}"


def test_a_broken_rope_is_caught():
    """The check has teeth: stock with interleaved RoPE against ours without it differs."""
    VARIANTS["_mismatch"] = dict(config=dict(rotary_interleaved=True))
    try:
        original = _models

        def mismatched(variant):
            stock, ours, registry = original(variant)
            ours.config.rotary_interleaved = False  # ours only: its own config object
            return stock, ours, registry

        globals()["_models"] = mismatched
        (worst, _), = run_ranks(_compare, 1, "_mismatch")
    finally:
        globals()["_models"] = original
        del VARIANTS["_mismatch"]
    assert worst > 1e-3
