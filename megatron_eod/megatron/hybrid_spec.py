"""The hybrid stack spec (megatron-core's HybridModel, pretrain_hybrid.py) with EoD attention.

One job: `get_hybrid_eod_stack_spec(registry, config, use_transformer_engine, **attention)`,
the `hybrid_stack_spec` a HybridModel takes, for the layer symbols EoD reset supports:

* `*` attention: our GPT layer spec (layer_spec.py: EoD core attention, RoPE at the reset
  positions) without its MLP;
* `-` dense MLP: the same GPT layer spec's MLP half (megatron-core's MLPLayer);
* `E` MoE: megatron-core's GPT MoE layer spec's MLP half (its MoETransformerLayer).

Each layer keeps the GPT spec's `sharded_state_dict_keys_map` for its half, so megatron-core's
load-time GPT -> hybrid translation (>= 0.19, torch_dist) finds a GPT checkpoint's keys. Local
modules on CPU and without TransformerEngine, TransformerEngine's where asked for and
installed. megatron-core's own hybrid stack spec is TransformerEngine-only, and HybridStack's
final norm is TransformerEngine's whatever the spec: without it, `hybrid_block.TENorm` is
made our torch norm (norm.py) before the stack is built.

What it does not do: no Mamba-2 (`M`), Gated DeltaNet (`G`), DeepSeek sparse attention (`D`),
MLA layers (`+`) or MTP (`/`): refused at start-up (training/model_flags.py).
"""

from __future__ import annotations

from megatron_eod.megatron.imports import import_megatron
from megatron_eod.megatron.layer_spec import get_gpt_layer_eod_spec
from megatron_eod.megatron.norm import TorchNorm

__all__ = ["get_hybrid_eod_stack_spec"]


def _keys_map(spec, prefix):
    """The GPT spec's sharded_state_dict_keys_map entries for the half starting `prefix`."""
    found = spec.submodules.sharded_state_dict_keys_map or {}
    return {k: v for k, v in found.items() if k.startswith(prefix)}


def _mlp_half(module, gpt_spec):
    """A layer of `module` (MLPLayer, MoETransformerLayer) holding `gpt_spec`'s MLP half."""
    spec_utils = import_megatron("megatron.core.transformer.spec_utils")
    layers = import_megatron("megatron.core.transformer.transformer_layer")
    sub = gpt_spec.submodules
    return spec_utils.ModuleSpec(module=module, submodules=layers.TransformerLayerSubmodules(
        pre_mlp_layernorm=sub.pre_mlp_layernorm, mlp=sub.mlp, mlp_bda=sub.mlp_bda,
        sharded_state_dict_keys_map=_keys_map(gpt_spec, "pre_mlp_layernorm.")))


def get_hybrid_eod_stack_spec(registry, config, use_transformer_engine: bool = False,
                              normalization: str = "LayerNorm", qk_layernorm: bool = False,
                              **attention):
    """The HybridStack spec (the module's list); `attention`: get_gpt_layer_eod_spec's
    RoPE and kernel arguments."""
    spec_utils = import_megatron("megatron.core.transformer.spec_utils")
    layers = import_megatron("megatron.core.transformer.transformer_layer")
    block = import_megatron("megatron.core.models.hybrid.hybrid_block")
    mlp_layer = import_megatron("megatron.core.ssm.mlp_layer").MLPLayer
    specs = import_megatron("megatron.core.models.gpt.gpt_layer_specs")
    if not use_transformer_engine:
        block.TENorm = TorchNorm  # its final norm, whatever the spec says
    dense = get_gpt_layer_eod_spec(registry, use_transformer_engine, normalization=normalization,
                                   qk_layernorm=qk_layernorm, **attention)
    sub = dense.submodules
    attention_layer = spec_utils.ModuleSpec(
        module=layers.TransformerLayer, submodules=layers.TransformerLayerSubmodules(
            input_layernorm=sub.input_layernorm, self_attention=sub.self_attention,
            self_attn_bda=sub.self_attn_bda,
            sharded_state_dict_keys_map=_keys_map(dense, "input_layernorm.")))
    found = dict(attention_layer=attention_layer, mlp_layer=_mlp_half(mlp_layer, dense))
    if getattr(config, "num_moe_experts", None):
        from megatron_eod.megatron import moe_compat

        moe_compat.apply()
        if use_transformer_engine:
            moe = specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm)
        else:
            moe = specs.get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                                 moe_grouped_gemm=config.moe_grouped_gemm,
                                                 normalization=normalization)
            moe.submodules.pre_mlp_layernorm = TorchNorm
        found["moe_layer"] = _mlp_half(layers.MoETransformerLayer, moe)
    return spec_utils.ModuleSpec(module=block.HybridStack,
                                 submodules=block.HybridStackSubmodules(**found))
