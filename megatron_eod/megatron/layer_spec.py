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
from megatron_eod.megatron.imports import import_megatron
from megatron_eod.megatron.norm import TorchNorm

__all__ = ["get_gpt_layer_eod_spec", "get_gpt_eod_block_spec"]


def get_gpt_layer_eod_spec(registry, use_transformer_engine: bool = False,
                           rotary_base: float = 10000.0, rotary_percent: float = 1.0,
                           normalization: str = "LayerNorm", qk_layernorm: bool = False,
                           kernel: str = "auto", rope_scaling: bool = False,
                           rope_scaling_factor: float = 8.0,
                           seq_len_interpolation_factor=None, ring_exchange: str = "batched",
                           concurrent_calls: bool = False, fused_forward: bool = False,
                           fused_backward: bool = False):
    specs = import_megatron("megatron.core.models.gpt.gpt_layer_specs")
    spec_module = import_megatron("megatron.core.transformer.spec_utils")
    if use_transformer_engine:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        spec = specs.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm,
                                              normalization=normalization)
        spec.submodules.input_layernorm = TorchNorm
        spec.submodules.pre_mlp_layernorm = TorchNorm
        if qk_layernorm:  # megatron-core's torch norm refuses --sequence-parallel here too
            attention = spec.submodules.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = TorchNorm
    spec.submodules.self_attention.submodules.core_attention = spec_module.ModuleSpec(
        module=EodCoreAttention,
        params={"registry": registry, "rotary_base": rotary_base,
                "rotary_percent": rotary_percent, "rope_scaling": rope_scaling,
                "rope_scaling_factor": rope_scaling_factor,
                "seq_len_interpolation_factor": seq_len_interpolation_factor,
                "kernel": kernel, "ring_exchange": ring_exchange,
                "concurrent_calls": concurrent_calls, "fused_forward": fused_forward,
                "fused_backward": fused_backward})
    return spec


def get_gpt_eod_block_spec(registry, config, use_transformer_engine: bool = False,
                           vp_stage=None, **kwargs):
    """TransformerBlockSubmodules for this pipeline stage (model chunk `vp_stage` of it under
    virtual pipeline stages): its layers and the final norm."""
    block = import_megatron("megatron.core.transformer.transformer_block")
    layer = get_gpt_layer_eod_spec(registry, use_transformer_engine, **kwargs)
    norm = block.LayerNormImpl if use_transformer_engine else TorchNorm
    return block.TransformerBlockSubmodules(
        layer_specs=[layer] * block.get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=norm)
