"""The GPT model the trainer runs: megatron-core's GPTModel with the EoD attention spec.

One job: turn validated flags into a `TransformerConfig`, build this pipeline stage's
`GPTModel` (one per virtual pipeline stage, a "model chunk", with
--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank) with
`get_gpt_layer_eod_spec` (--transformer-impl: local modules, or
TransformerEngine's; default TransformerEngine where it is installed and a GPU is present) and
wrap it in megatron-core's DistributedDataParallel as Megatron-LM configures it (gradients
accumulate in float32 buffers, bf16 ones with --grad-reduce-in-bf16, and are summed over
DP x CP by `finalize_model_grads`, per-token loss mode; --overlap-grad-reduce buckets of
max(40M, 1M x DP x CP) elements, or --ddp-bucket-size / --ddp-num-buckets;
--use-distributed-optimizer / --overlap-param-gather shard and gather the parameters).

Megatron-LM's model flags map onto the config as its `core_transformer_config_from_args` maps
them (--norm-epsilon, --apply-layernorm-1p, --add-qkv-bias, --squared-relu,
--init-method-xavier-uniform, --embedding-init-method-std, --cross-entropy-loss-fusion).

What it does not do: no optimizer, no data. Megatron's bias/activation and bias/dropout
fusions are on with CUDA (as Megatron-LM's defaults, each --no-*-fusion turns its one off)
and off on CPU (see cpu_compat).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from megatron_eod.attention.backends import has_transformer_engine
from megatron_eod.megatron.imports import import_megatron
from megatron_eod.training import eod_wiring as wiring

__all__ = ["transformer_config", "build_model", "ddp_config", "uses_transformer_engine"]


def transformer_config(args):
    core = import_megatron("megatron.core.transformer")
    gpu = torch.cuda.is_available()
    recompute = args.recompute_granularity
    return core.TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout, attention_dropout=0.0,
        init_method_std=args.init_method_std, normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon,
        layernorm_zero_centered_gamma=args.layernorm_zero_centered_gamma,
        gated_linear_unit=args.swiglu, qk_layernorm=args.qk_layernorm,
        rotary_interleaved=args.rotary_interleaved, activation_func=_activation(args),
        add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias,
        embedding_init_method_std=args.embedding_init_method_std,
        **_xavier_init(args),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=args.params_dtype, bf16=args.bf16, fp16=args.fp16,
        pipeline_dtype=args.params_dtype,
        use_cpu_initialization=args.use_cpu_initialization or not gpu,
        recompute_granularity=recompute,
        recompute_method=args.recompute_method if recompute == "full" else None,
        recompute_num_layers=args.recompute_num_layers if recompute == "full" else None,
        calculate_per_token_loss=True, deterministic_mode=args.deterministic_mode,
        # Megatron-LM's defaults on GPUs (each --no-*-fusion turns its one off); its gelu
        # fusion needs the bias it fuses.
        bias_activation_fusion=gpu and (
            args.bias_swiglu_fusion if args.swiglu else
            args.bias_gelu_fusion and args.add_bias_linear and not args.squared_relu),
        bias_dropout_fusion=gpu and args.bias_dropout_fusion, masked_softmax_fusion=False,
        # Weight gradients straight into DDP's main_grad, as Megatron-LM's default, where it
        # can run: the output layer is always megatron-core's own ColumnParallelLinear, which
        # needs Apex's fused_weight_gradient_mlp_cuda for it (TE layers alone are not enough).
        apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=gpu and args.gradient_accumulation_fusion and _has_module(
            "fused_weight_gradient_mlp_cuda"),
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        overlap_p2p_comm=args.overlap_p2p_comm, batch_p2p_comm=not args.overlap_p2p_comm,
        overlap_p2p_comm_warmup_flush=args.overlap_p2p_comm_warmup_flush,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        batch_p2p_sync=gpu,  # the sync after batched p2p is torch.cuda.synchronize()
        **_no_graph_scope(core.TransformerConfig))


def _no_graph_scope(config_class) -> dict:
    """No CUDA graphs here; megatron-core 0.16's default scope "full" warned on every rank at
    every start that it is deprecated (its equivalent is the empty list)."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    return {"cuda_graph_scope": []} if "cuda_graph_scope" in fields else {}


def _activation(args):
    if args.squared_relu:
        return import_megatron("megatron.core.activations").squared_relu
    return torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu


def _xavier_init(args) -> dict:
    """--init-method-xavier-uniform: every weight matrix, the output projections and (through
    megatron-core's fallback to init_method) the word embeddings included. Megatron-LM 0.16
    means the same but names a `scaled_init_method` its megatron-core lacks (a TypeError);
    its trainer is refused the flag there (megatron_lm_args)."""
    if not args.init_method_xavier_uniform:
        return {}
    return {"init_method": torch.nn.init.xavier_uniform_,
            "output_layer_init_method": torch.nn.init.xavier_uniform_}


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def build_model(args, registry, vocab_size: int):
    """-> (this pipeline stage's model chunks: DDP-wrapped GPTModels, one per virtual stage
    (one without them), their TransformerConfig)."""
    ps = import_megatron("megatron.core.parallel_state")
    gpt = import_megatron("megatron.core.models.gpt")
    ddp = import_megatron("megatron.core.distributed")
    config = transformer_config(args)
    chunks = args.virtual_pipeline_model_parallel_size
    stages = [None] if chunks is None else list(range(chunks))
    modules = []
    for vp_stage in stages:
        spec = wiring.block_spec(registry, config, args, uses_transformer_engine(args), vp_stage)
        model = gpt.GPTModel(
            config, spec, vocab_size=vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=wiring.gpt_position_embedding_type(args),
            **({} if vp_stage is None else {"vp_stage": vp_stage}))
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if args.fp16 or args.bf16:
            model = import_megatron("megatron.core.transformer.module").Float16Module(config,
                                                                                     model)
        modules.append(model)
    parameters = sum(p.numel() for module in modules for p in module.parameters())
    # As Megatron-LM: one bucket for the chunks after the first (their reductions overlap
    # the first chunk's backward anyway).
    return [ddp.DistributedDataParallel(config, ddp_config(args, parameters), module,
                                        disable_bucketing=index > 0)
            for index, module in enumerate(modules)], config


def uses_transformer_engine(args) -> bool:
    if args.transformer_impl is None:  # Megatron-LM's default where it can run, else local
        return torch.cuda.is_available() and has_transformer_engine()
    return args.transformer_impl == "transformer_engine"


def ddp_config(args, parameters: int):
    """Megatron-LM's DDP configuration for these flags (`parameters`: this stage's count)."""
    ddp = import_megatron("megatron.core.distributed")
    ps = import_megatron("megatron.core.parallel_state")
    bucket = None  # one bucket: nothing to overlap with
    if args.overlap_grad_reduce:
        if args.ddp_num_buckets is not None:
            bucket = max(1, parameters // args.ddp_num_buckets)
        else:
            bucket = args.ddp_bucket_size or max(
                40_000_000, 1_000_000 * ps.get_data_parallel_world_size(
                    with_context_parallel=True))
    return ddp.DistributedDataParallelConfig(
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # the trainer stops on NaN itself, saying where
        bucket_size=bucket)
