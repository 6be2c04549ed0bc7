"""The tiny megatron-core GPT with our EoD attention spec that the model-level tests build.

`tiny_gpt(world, registry, seed)` must run inside a rank with `cpu_compat` applied and
parallel_state initialised (CP size `world`): `with cp_setup(world, algo, degree) as group:`
does both (and builds the hybrid sub-groups) and undoes them. Weights depend only on the seed
(CPU initialisation), so every CP size builds the same model.
"""

from contextlib import contextmanager

import torch

from megatron_eod import create_hybrid_groups
from megatron_eod.megatron import cpu_compat
from megatron_eod.megatron.layer_spec import get_gpt_layer_eod_spec

VOCAB, EOD = 64, 63


def tiny_gpt(world, registry, seed, num_query_groups=2, max_sequence_length=48,
             ring_exchange="batched"):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=num_query_groups,
        ffn_hidden_size=64, context_parallel_size=world, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False)
    return GPTModel(config, get_gpt_layer_eod_spec(registry, ring_exchange=ring_exchange),
                    vocab_size=VOCAB,
                    max_sequence_length=max_sequence_length, position_embedding_type="none")


@contextmanager
def cp_setup(world, algo="ring", degree=None):
    """CPU compat + parallel_state with CP size `world` for this rank; yields the CP group
    (None at CP=1)."""
    from megatron.core import parallel_state

    cpu_compat.apply()
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        cp_group = parallel_state.get_context_parallel_group() if world > 1 else None
        if algo == "hybrid":
            create_hybrid_groups(cp_group, degree)
        yield cp_group
    finally:
        parallel_state.destroy_model_parallel()
        cpu_compat.remove()


def mla_buildable() -> bool:
    """Whether this megatron-core can build multi-latent attention: not 0.16 without
    TransformerEngine (training/model_flags.check_mla refuses it there)."""
    import importlib.util

    import megatron.core
    from packaging.version import Version

    return Version(megatron.core.__version__) >= Version("0.17") or \
        importlib.util.find_spec("transformer_engine") is not None


NEEDS_MLA = "megatron-core 0.16 builds MLA only with TransformerEngine"
