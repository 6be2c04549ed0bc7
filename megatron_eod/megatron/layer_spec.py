"""The GPT layer and block specs with EoD context-parallel attention.

One job: megatron-core's own GPT layer spec (local modules on CPU, TransformerEngine's where
installed and asked for) with the `core_attention` slot replaced by `EodCoreAttention`, bound
to the model's context registry. Build the GPTModel with position_embedding_type="none":
RoPE is applied inside the attention at the reset position ids. Without TransformerEngine the
norms (q/k norms included) are `norm.TorchNorm` (megatron-core's torch wrapper refuses
sequence parallelism and zero-centred gamma);
`get_gpt_eod_block_spec` also sets the block's final norm, for this pipeline stage's layers
(one model chunk's, given `vp_stage`).
The rotary arguments are GPTModel's (`rotary_base`, `rotary_percent`, `rope_scaling`, ...):
give them here, since the GPTModel itself is built without position embeddings or with
learned absolute ones. `qk_layernorm` is megatron-core's (norms on q and k per head).
`kernel` picks the GPU attention kernel: "auto" (flash-attn when installed, else PyTorch's
varlen kernel), "flash_attn" (required; what --use-flash-attn asks for) or "torch";
`ring_exchange` the ring executor ("batched", "batched-keep" or "steps", --cp-ring-exchange);
`concurrent_calls` runs its local call beside the received keys' call on a GPU
(--cp-concurrent-calls); `fused_forward` the batched forward as one fused Triton kernel
(--cp-fused-forward, attention/triton_forward.py; its plans need their tiles:
`EodGPTSteps(..., fused_tiles=True)`, else the first layer refuses them by name),
`fused_backward` its backward too (--cp-fused-backward, attention/triton_backward.py).
"""

from __future__ import annotations

from megatron_eod.megatron.core_attention import EodCoreAttention
from megatron_eod.megatron import moe_compat
from megatron_eod.megatron.imports import import_megatron
from megatron_eod.megatron.mla import eod_mla_self_attention
from megatron_eod.megatron.norm import TorchNorm

__all__ = ["get_gpt_layer_eod_spec", "get_gpt_eod_block_spec", "with_eod_attention"]


def _eod_attention_spec(registry, **params):
    spec_module = import_megatron("megatron.core.transformer.spec_utils")
    return spec_module.ModuleSpec(module=EodCoreAttention, params={"registry": registry,
                                                                   **params})


def with_eod_attention(spec, registry, use_transformer_engine: bool, qk_layernorm: bool,
                       **params):
    """megatron-core's layer `spec` (dense or MoE) with EoD core attention in its
    `core_attention` slot (`params`: EodCoreAttention's) and, without TransformerEngine, our
    torch norms. Changes `spec` in place (megatron-core's block spec may list one object for
    several layers) and returns it."""
    submodules = spec.submodules
    attention = submodules.self_attention
    mla = import_megatron("megatron.core.transformer.multi_latent_attention")
    latent = isinstance(attention.module, type) and issubclass(attention.module,
                                                               mla.MLASelfAttention)
    if not use_transformer_engine:
        submodules.input_layernorm = TorchNorm
        submodules.pre_mlp_layernorm = TorchNorm
        if qk_layernorm and not latent:  # megatron-core's torch norm refuses
            # --sequence-parallel here too (MLA's q/kv norms are its own)
            attention.submodules.q_layernorm = attention.submodules.k_layernorm = TorchNorm
    if latent:  # multi-latent attention applies RoPE itself (mla.py: at the reset positions)
        attention.module = eod_mla_self_attention()
        attention.params = dict(attention.params or {}, registry=registry)
        params = dict(params, rotary_percent=0.0)
    attention.submodules.core_attention = _eod_attention_spec(registry, **params)
    return spec


def get_gpt_layer_eod_spec(registry, use_transformer_engine: bool = False,
                           rotary_base: float = 10000.0, rotary_percent: float = 1.0,
                           normalization: str = "LayerNorm", qk_layernorm: bool = False,
                           kernel: str = "auto", rope_scaling: bool = False,
                           rope_scaling_factor: float = 8.0,
                           seq_len_interpolation_factor=None, ring_exchange: str = "batched",
                           concurrent_calls: bool = False, fused_forward: bool = False,
                           fused_backward: bool = False):
    specs = import_megatron("megatron.core.models.gpt.gpt_layer_specs")
    if use_transformer_engine:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        spec = specs.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm,
                                              normalization=normalization)
    return with_eod_attention(
        spec, registry, use_transformer_engine, qk_layernorm, rotary_base=rotary_base,
        rotary_percent=rotary_percent, rope_scaling=rope_scaling,
        rope_scaling_factor=rope_scaling_factor,
        seq_len_interpolation_factor=seq_len_interpolation_factor, kernel=kernel,
        ring_exchange=ring_exchange, concurrent_calls=concurrent_calls,
        fused_forward=fused_forward, fused_backward=fused_backward)


def get_gpt_eod_block_spec(registry, config, use_transformer_engine: bool = False,
                           vp_stage=None, **kwargs):
    """TransformerBlockSubmodules for this pipeline stage (model chunk `vp_stage` of it under
    virtual pipeline stages): its layers and the final norm. With experts
    (`config.num_moe_experts`) or multi-latent attention, megatron-core's own decoder block
    spec (its MoE layers where --moe-layer-freq puts them, dense layers elsewhere; MLA
    self-attention) with EoD attention in each layer (MLA's: mla.py)."""
    block = import_megatron("megatron.core.transformer.transformer_block")
    norm = block.LayerNormImpl if use_transformer_engine else TorchNorm
    if getattr(config, "num_moe_experts", None) or getattr(config, "multi_latent_attention",
                                                           False):
        if getattr(config, "num_moe_experts", None):
            moe_compat.apply()  # what megatron-core's MoE gets wrong in 0.16-0.18
        specs = import_megatron("megatron.core.models.gpt.gpt_layer_specs")
        kwargs = dict(kwargs)
        normalization = kwargs.pop("normalization", "LayerNorm")
        qk_layernorm = kwargs.pop("qk_layernorm", False)
        spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine,
                                                normalization=normalization,
                                                vp_stage=vp_stage)
        for layer in {id(layer): layer for layer in spec.layer_specs}.values():
            with_eod_attention(layer, registry, use_transformer_engine, qk_layernorm,
                               **kwargs)
        spec.layer_norm = norm
        return spec
    layer = get_gpt_layer_eod_spec(registry, use_transformer_engine, **kwargs)
    return block.TransformerBlockSubmodules(
        layer_specs=[layer] * block.get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=norm)
