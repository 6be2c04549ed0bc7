"""megatron/mla.py: megatron-core's multi-latent attention takes its RoPE angles at each CP
rank's RESET positions. RoPE is relative, so outputs barely reveal absolute positions (the
tiny MLA GPT trained within 1e-5 of CP=1 even with megatron-core's own zigzag angles): the
angles MLA applies are recorded and compared with the reset position ids' instead."""

import pytest
import torch

from megatron_eod.megatron.batch import slice_batch_for_cp
from megatron_eod.megatron.batch_context import EodContextRegistry
from megatron_eod.megatron.layer_spec import get_gpt_eod_block_spec
from tests.harness import run_ranks
from tests.megatron.tiny_model import EOD, NEEDS_MLA, VOCAB, cp_setup, mla_buildable
from tests.reference import random_layout_tokens

B, S = 2, 48
pytestmark = pytest.mark.skipif(not mla_buildable(), reason=NEEDS_MLA)


def _record_angles(rank, world, rope_type):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer import multi_latent_attention

    from megatron_eod import build_doc_layout

    with cp_setup(world):
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        config = MLATransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
            multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
            qk_pos_emb_head_dim=8, v_head_dim=12, rope_type=rope_type, rotary_base=500,
            rotary_scaling_factor=4.0, original_max_position_embeddings=16,
            context_parallel_size=world, use_cpu_initialization=True, hidden_dropout=0.0,
            attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            gradient_accumulation_fusion=False)
        registry = EodContextRegistry()
        model = GPTModel(config, get_gpt_eod_block_spec(registry, config), vocab_size=VOCAB,
                         max_sequence_length=S, position_embedding_type="none")
        original, recorded = multi_latent_attention.apply_rotary_pos_emb, []

        def recording(t, freqs, *args, **kwargs):
            recorded.append(freqs[:, 0, 0, :].clone())
            return original(t, freqs, *args, **kwargs)

        multi_latent_attention.apply_rotary_pos_emb = recording
        try:
            tokens = random_layout_tokens("mixed", B, S, EOD, seed=9)
            batch = slice_batch_for_cp(tokens, tokens, EOD, registry, cp_size=world,
                                       cp_rank=rank,
                                       cp_group=parallel_state.get_context_parallel_group())
            model(batch.tokens, batch.position_ids, batch.attention_mask)
        finally:
            multi_latent_attention.apply_rotary_pos_emb = original
        positions = build_doc_layout(tokens, EOD).position_ids.reshape(-1)
        local = positions[batch.plan.token_index(rank)]
        assert (positions == 0).sum() > B and not torch.equal(local, torch.arange(local.numel()))
        rope = model.decoder.layers[0].self_attention.rotary_pos_emb
        found = rope.get_emb(S)
        table = found[0] if isinstance(found, tuple) else found
        return recorded, table[local][:, 0, 0, :]


@pytest.mark.parametrize("rope_type", ["rope", "yarn"])
def test_mla_rope_uses_the_reset_positions_of_each_rank(rope_type):
    for recorded, expected in run_ranks(_record_angles, 2, rope_type):
        assert len(recorded) == 4  # 2 layers x (q, k)
        for freqs in recorded:
            assert torch.equal(freqs, expected)
