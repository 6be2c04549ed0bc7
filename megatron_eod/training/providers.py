"""Providers for Megatron-LM's own trainer (`megatron.training.pretrain`): the model, the
datasets and the forward step that make its loop train with EoD reset under CP.

`pretrain_gpt.py` calls `pretrain()` with them (training/run.py, both the <= 0.17
and the >= 0.18 signatures); a user with their own script passes them the same way:

    providers = EodProviders()
    pretrain(providers.datasets_provider, providers.model_provider,
             ModelType.encoder_or_decoder, providers.forward_step,
             extra_args_provider=add_eod_args)

One job: adapt Megatron-LM's provider signatures to the EoD pieces (the EoD layer spec with
the args' RoPE and CP settings, our GPTDataset builder in data.py, `EodGPTSteps`); flags are
read and checked by args.py. `megatron.training` is imported only when a provider is called.

Pipeline stages hand each other a micro-batch packed as one row, [mbs*s/cp, 1, h]; the model
provider makes Megatron-LM's schedules shape their buffers so (`pack_stage_shapes`).
Virtual pipeline stages (the interleaved schedule): Megatron-LM builds one data iterator per
model chunk, so every chunk of a stage reads and plans the micro-batches itself (each
iterator is its own stream in plan_ahead.py) and finds its own context in the registry, which
is sized for every micro-batch the schedule holds between forward and backward.

What it does not do: no dense masks, no multi-latent attention (see args.REFUSED).
"""

from __future__ import annotations

import functools
import importlib
import inspect

import numpy as np
import torch

from megatron_eod.attention.backends import has_transformer_engine
from megatron_eod.attention.groups import register_hybrid_groups
from megatron_eod.megatron.batch_context import EodContextRegistry
from megatron_eod.megatron import mtp
from megatron_eod.megatron.imports import import_megatron
from megatron_eod.megatron.hybrid_spec import get_hybrid_eod_stack_spec
from megatron_eod.megatron.layer_spec import get_gpt_eod_block_spec
from megatron_eod.megatron.steps import EodGPTSteps
from megatron_eod.training import data
from megatron_eod.training.args import add_eod_args, eod_args_from_megatron

__all__ = ["EodProviders", "add_eod_args", "block_spec", "checked_loss", "contexts_in_flight",
           "pack_stage_shapes", "plans_ahead"]


def pack_stage_shapes(training) -> None:
    """Make Megatron-LM's schedules shape the tensors between pipeline stages as an EoD
    micro-batch travels: packed, [mbs*s/cp, 1, h] (one row; the plan, not the row, separates
    documents), not [s/cp, mbs, h]. The same elements, so `training.get_forward_backward_func`
    is wrapped to ask for `seq_length` x mbs at micro-batch 1, so every micro-batch is one row.
    Not `variable_seq_lengths`: its shape exchange costs a round trip per transfer, crosses
    the shapes at PP=2 with virtual stages and deadlocks batched p2p at PP >= 4 in
    megatron-core 0.16-0.19 (Megatron-LM issues #1450, #5100). Idempotent."""
    original = training.get_forward_backward_func
    if getattr(original, "_eod_packed", False):
        return

    def get_forward_backward_func(*args, **kwargs):
        schedule = original(*args, **kwargs)
        signature = inspect.signature(schedule)

        def forward_backward(*call_args, **call_kwargs):
            bound = signature.bind(*call_args, **call_kwargs)
            mbs = bound.arguments.get("micro_batch_size", 1)
            if mbs > 1:
                for name in ("seq_length", "decoder_seq_length"):
                    if bound.arguments.get(name) is not None:
                        bound.arguments[name] *= mbs
                bound.arguments["micro_batch_size"] = 1
            return schedule(*bound.args, **bound.kwargs)

        return functools.wraps(schedule)(forward_backward)

    get_forward_backward_func._eod_packed = True
    training.get_forward_backward_func = get_forward_backward_func


def plans_ahead(args) -> bool:
    """Whether the steps read and plan one micro-batch ahead (--no-plan-ahead: in the step).
    Megatron-LM's rerun machine may replay an iteration's micro-batches: plan_ahead.py reads
    ahead beneath its wrapper and gives a replay the plan it had."""
    return getattr(args, "plan_ahead", True)


def block_spec(registry, config, args, use_transformer_engine: bool, vp_stage=None):
    """This pipeline stage's (model chunk's) block spec with EoD attention and the args' RoPE
    settings."""
    return get_gpt_eod_block_spec(
        registry, config, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage,
        **block_spec_arguments(args))


def block_spec_arguments(args) -> dict:
    """The layer specs' RoPE, norm and kernel arguments from the args (GPT and hybrid)."""
    rope = args.position_embedding_type == "rope"
    return dict(
        rotary_base=args.rotary_base, rotary_percent=args.rotary_percent if rope else 0.0,
        rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
        normalization=args.normalization, qk_layernorm=getattr(args, "qk_layernorm", False),
        kernel="flash_attn" if getattr(args, "use_flash_attn", False) else "auto",
        ring_exchange=getattr(args, "cp_ring_exchange", "batched"),
        concurrent_calls=getattr(args, "cp_concurrent_calls", False),
        fused_forward=getattr(args, "cp_fused_forward", False),
        fused_backward=getattr(args, "cp_fused_backward", False))



def mtp_block_spec(config, block, use_transformer_engine: bool, vp_stage=None):
    """megatron-core's MTP block spec around this stage's last EoD layer spec (Megatron-LM's
    choice: the decoder's last layer), with roll_tensor made document-aware (megatron/mtp.py);
    None on stages without the MTP block."""
    mtp.install()
    specs = import_megatron("megatron.core.models.gpt.gpt_layer_specs")
    layers = block.layer_specs
    if not layers:  # a stage without decoder layers: the layer spec of the whole model's last
        raise ValueError("--mtp-num-layers on a pipeline stage without decoder layers is not "
                         "supported by the EoD providers")
    return specs.get_gpt_mtp_block_spec(config, layers[-1], use_transformer_engine,
                                        vp_stage=vp_stage)


def contexts_in_flight(args) -> int:
    """The most batch contexts a rank needs at once under megatron-core's schedules (both
    ): one per (model chunk, micro-batch) forward not yet run backward (on pipeline rank 0 the
    interleaved schedule warms up 2 (pp - 1) + (chunks - 1) x group of them, the group being
    megatron-core's `microbatch_group_size_per_vp_stage`, pp unless set; 1F1B pp - 1), the
    one running, and one for an evaluation in between."""
    pp = args.pipeline_model_parallel_size
    chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    group = getattr(args, "microbatch_group_size_per_vp_stage", None) or pp
    return 2 * (pp - 1) + (chunks - 1) * group + 2



def gpt_position_embedding_type(args) -> str:
    """GPTModel's own position embedding: RoPE is applied inside EoD attention ("none");
    learned absolute positions are looked up at the reset position ids get_batch passes."""
    return "learned_absolute" if args.position_embedding_type == "learned_absolute" else "none"



def steps(args, registry, eod_token_id: int, pad_token_id, plan_ahead: bool) -> EodGPTSteps:
    return EodGPTSteps(
        eod_token_id, registry, args.seq_length, args.micro_batch_size,
        algo=args.context_parallel_algo, ulysses_degree=args.ulysses_degree,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        pad_token_id=pad_token_id, plan_ahead=plan_ahead,
        eval_micro_batch_size=getattr(args, "eval_micro_batch_size", None),
        one_row_evaluation=data.validates_one_row_at_a_time(args),
        fused_tiles=getattr(args, "cp_fused_forward", False),
        documents_from_index=getattr(args, "dataloader_inter_document_masking", False),
        mtp=bool(getattr(args, "mtp_num_layers", None)))



def hybrid_groups(args) -> bool:
    """For hybrid CP, hand parallel_state's hierarchical CP groups ([u, cp/u]: Ulysses over
    consecutive ranks, Ring strided) to the attention. True when registered."""
    if args.context_parallel_algo != "hybrid" or args.context_parallel_size == 1:
        return False
    ps = import_megatron("megatron.core.parallel_state")
    inner, outer = ps.get_hierarchical_context_parallel_groups()
    register_hybrid_groups(ps.get_context_parallel_group(), args.ulysses_degree, inner, outer)
    return True



SPIKY_LOSS_FACTOR = 10  # Megatron-LM's: a local loss 10x the usual is "spiky"


def checked_loss(loss_func, args):
    """`loss_func` with the checks Megatron-LM's own pretrain_gpt.py makes of each micro-batch's
    local loss, before any reduction, through its rerun state machine (so --rerun-mode decides
    what follows): NaN or Inf stop the run (--check-for-nan-in-loss-and-grad, on by default;
    otherwise a NaN evaluation loss went unnoticed), and --check-for-spiky-loss flags a loss
    over SPIKY_LOSS_FACTOR x its usual size (it was accepted and did nothing)."""
    rerun = import_megatron("megatron.core.rerun_state_machine")

    def checked(output_tensor):
        loss, num_tokens, report = loss_func(output_tensor)
        machine = rerun.get_rerun_state_machine()
        if getattr(args, "check_for_nan_in_loss_and_grad", False):
            for rejected, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
                machine.validate_result(result=loss, rejection_func=rejected, tolerance=0.0,
                                        message=f"found {what} in local forward loss "
                                                f"calculation", fatal=True)
        if getattr(args, "check_for_spiky_loss", False):
            machine.validate_result(
                result=loss, message="Spiky loss", tolerance=0.0, fatal=False,
                rejection_func=functools.partial(machine.is_unexpectedly_large,
                                                 threshold=SPIKY_LOSS_FACTOR, context="loss"))
        return loss, num_tokens, report

    return checked


def _core(model):
    """The GPTModel inside Megatron-LM's wrappers (DDP, Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model


class EodProviders:
    """The three callables `megatron.training.pretrain` takes; one instance per process (the
    model and the step functions share its context registry)."""

    def __init__(self):
        self.registry = EodContextRegistry()
        self._steps = None
        self._groups_registered = False
        # The attention work of this rank's training micro-batches since `work` was reset
        # (metrics.py resets it at each training forward-backward pass): the sum over their
        # documents of length^2 (Megatron-LM's measure of causal attention), and their tokens.
        self.work = [0, 0]

    @staticmethod
    def _training():
        return importlib.import_module("megatron.training")

    def _args(self):
        args = self._training().get_args()
        eod_args_from_megatron(args)
        if not self._groups_registered:
            hybrid_groups(args)  # parallel_state exists once a provider runs
            self._groups_registered = True
        return args

    def model_provider(self, pre_process=True, post_process=True, vp_stage=None, config=None,
                       pg_collection=None, **_unused):
        args = self._args()
        self.registry.capacity = max(self.registry.capacity, contexts_in_flight(args))
        if config is None:
            config = importlib.import_module(
                "megatron.training.arguments").core_transformer_config_from_args(args)
        if args.pipeline_model_parallel_size > 1:
            pack_stage_shapes(importlib.import_module("megatron.training.training"))
        te = getattr(args, "transformer_impl", "local") == "transformer_engine" and \
            has_transformer_engine()
        # RoPE is applied inside the attention; learned positions by the embedding, both at
        # the reset position ids get_batch hands the model.
        common = dict(
            vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process, post_process=post_process,
            fp16_lm_cross_entropy=getattr(args, "fp16_lm_cross_entropy", False),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=gpt_position_embedding_type(args),
            pg_collection=pg_collection, **({} if vp_stage is None else {"vp_stage": vp_stage}))
        if getattr(args, "eod_model", "gpt") == "hybrid":  # pretrain_hybrid.py
            spec = get_hybrid_eod_stack_spec(self.registry, config, te,
                                             **block_spec_arguments(args))
            hybrid = import_megatron("megatron.core.models.hybrid.hybrid_model")
            return hybrid.HybridModel(config, spec,
                                      hybrid_layer_pattern=args.hybrid_layer_pattern, **common)
        spec = block_spec(self.registry, config, args, te, vp_stage)
        if getattr(args, "mtp_num_layers", None):
            common["mtp_block_spec"] = mtp_block_spec(config, spec, te, vp_stage)
        return import_megatron("megatron.core.models.gpt").GPTModel(config, spec, **common)

    def datasets_provider(self, train_val_test_num_samples, vp_stage=None):
        """The same datasets for every model chunk (`vp_stage`): each chunk reads every
        micro-batch, since each chunk's attention needs its plan."""
        args = self._args()
        return data.megatron_lm_datasets(args, self._training().get_tokenizer(),
                                           train_val_test_num_samples)

    def forward_step(self, data_iterator, model, return_schedule_plan=False):
        if return_schedule_plan:
            raise ValueError("EoD attention does not support combined 1F1B schedule plans")
        output, loss_func = self.steps().forward_step(data_iterator, model)
        if model.training and getattr(_core(model), "vp_stage", None) in (None, 0):
            # Each micro-batch once, whatever the model chunks (each reads every one); the
            # plan's offsets are on the host.
            lengths = np.diff(self.steps().last_plan.cu_seqlens.numpy()).astype(np.int64)
            self.work[0] += int((lengths * lengths).sum())
            self.work[1] += int(lengths.sum())
        return output, checked_loss(loss_func, self._training().get_args())

    def steps(self) -> EodGPTSteps:
        if self._steps is None:
            args = self._args()
            tokenizer = self._training().get_tokenizer()
            # GPTDataset already turned pads into loss-masked zeros: no pad id here.
            self._steps = steps(args, self.registry, tokenizer.eod, None,
                                       plans_ahead(args))
        return self._steps


# Megatron-LM marks dataset providers that build on several ranks themselves.
EodProviders.datasets_provider.is_distributed = True
