"""Providers for Megatron-LM's own trainer (`megatron.training.pretrain`), for users who keep
Megatron-LM's loop and only want EoD-reset context parallelism from us.

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron_eod.training.megatron_lm import EodProviders, add_eod_args

    providers = EodProviders()
    pretrain(providers.datasets_provider, providers.model_provider,
             ModelType.encoder_or_decoder, providers.forward_step,
             extra_args_provider=add_eod_args)

Launch with Megatron-LM's flags plus `--context-parallel-algo {ring,ulysses,hybrid}`,
`--ulysses-degree-in-cp U` and, for hybrid, `--hierarchical-context-parallel-sizes U CP/U`
(Megatron-LM builds the hierarchical CP groups from it). `--calculate-per-token-loss` makes
Megatron divide by the tokens of the whole global batch, as our own trainer does.

One job: adapt Megatron-LM's provider signatures to the pieces our trainer uses (the EoD
layer spec, our GPTDataset builder, `EodGPTSteps`). `megatron.training` is imported only
when a provider is called: it does not exist in megatron-core 0.16.1, so these providers are
tested against a stand-in that supplies `get_args`, `get_tokenizer` and the config helper.

What it does not do: no virtual pipeline stages, no multi-token prediction, no dense masks.
"""

from __future__ import annotations

import importlib

import torch

from megatron_eod.attention.backends import has_transformer_engine
from megatron_eod.attention.groups import register_hybrid_groups
from megatron_eod.megatron.args import CP_ALGO_ALIASES, FlagError, check_context_parallel
from megatron_eod.megatron.batch_context import EodContextRegistry
from megatron_eod.megatron.dataset import build_gpt_datasets
from megatron_eod.megatron.imports import import_megatron
from megatron_eod.megatron.layer_spec import get_gpt_eod_block_spec
from megatron_eod.megatron.steps import EodGPTSteps, is_dataset_built_on_rank

__all__ = ["EodProviders", "add_eod_args", "check_megatron_lm_args"]


def add_eod_args(parser):
    """Megatron-LM `extra_args_provider`: the flags Megatron-LM does not have."""
    g = parser.add_argument_group("megatron-eod")
    g.add_argument("--context-parallel-algo", default="ring",
                   help=f"one of {', '.join(CP_ALGO_ALIASES)}")
    g.add_argument("--ulysses-degree-in-cp", type=int, default=None,
                   help="Ulysses group size for --context-parallel-algo hybrid")
    g.add_argument("--no-plan-ahead", action="store_false", dest="plan_ahead",
                   help="plan each micro-batch when the step needs it, not one ahead")
    return parser


def check_megatron_lm_args(args) -> None:
    """Our rules on Megatron-LM's parsed args; FlagError names the flags."""
    if getattr(args, "ulysses_degree", None) is not None:
        return  # already checked (the providers call this more than once)
    check_context_parallel(args)
    cp, u = args.context_parallel_size, args.ulysses_degree
    if args.context_parallel_algo == "hybrid":
        sizes = list(getattr(args, "hierarchical_context_parallel_sizes", None) or [])
        if sizes != [u, cp // u]:
            raise FlagError(f"--context-parallel-algo hybrid with --ulysses-degree-in-cp {u} "
                            f"needs --hierarchical-context-parallel-sizes {u} {cp // u} (got "
                            f"{' '.join(map(str, sizes)) or 'none'})")
    if args.attention_dropout:
        raise FlagError(f"--attention-dropout {args.attention_dropout}: our varlen attention "
                        f"kernels apply no dropout; pass --attention-dropout 0")
    if args.position_embedding_type not in ("rope", "none"):
        raise FlagError(f"--position-embedding-type {args.position_embedding_type}: EoD "
                        f"attention applies RoPE at reset positions (rope) or nothing (none)")
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        raise FlagError("--num-layers-per-virtual-pipeline-stage is not supported with "
                        "EoD attention")
    if getattr(args, "rotary_interleaved", False):
        raise FlagError("--rotary-interleaved is not supported: EoD attention applies RoPE "
                        "in the non-interleaved layout")
    if (args.pipeline_model_parallel_size > 1 and args.micro_batch_size > 1
            and not getattr(args, "variable_seq_lengths", False)):
        raise FlagError(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} "
                        f"with --micro-batch-size {args.micro_batch_size}: Megatron-LM's "
                        f"schedule shapes stage-to-stage buffers [s/cp, mbs, h] but EoD "
                        f"micro-batches travel packed as [mbs*s/cp, 1, h]; use "
                        f"--micro-batch-size 1 or --variable-seq-lengths")
    if not getattr(args, "mock_data", False) and not getattr(args, "data_path", None):
        raise FlagError("EoD providers read --data-path (blended prefixes allowed) or "
                        "--mock-data; --train-data-path/--valid-data-path/--test-data-path "
                        "and --per-split-data-args-path are not supported")


def plans_ahead(args) -> bool:
    """Whether the steps read and plan one micro-batch ahead. Not under Megatron-LM's rerun
    state machine (`--rerun-mode validate_results`, its default, or `report_stats`): it saves
    every micro-batch an iteration reads to replay the iteration, and a batch read ahead
    belongs to the next iteration. Said once, since the flag default makes it silent."""
    if not getattr(args, "plan_ahead", True):
        return False
    mode = getattr(args, "rerun_mode", "disabled")
    if mode != "disabled":
        if getattr(args, "rank", 0) == 0:
            print(f" megatron-eod: CP plans are made in each step, not one micro-batch ahead, "
                  f"because --rerun-mode {mode} replays an iteration's micro-batches; pass "
                  f"--rerun-mode disabled to plan ahead", flush=True)
        return False
    return True


class EodProviders:
    """The three callables `megatron.training.pretrain` takes; one instance per process (the
    model and the step functions share its context registry)."""

    def __init__(self):
        self.registry = EodContextRegistry()
        self._steps = None
        self._groups_registered = False

    @staticmethod
    def _training():
        return importlib.import_module("megatron.training")

    def _args(self):
        args = self._training().get_args()
        check_megatron_lm_args(args)
        if (args.context_parallel_algo == "hybrid" and args.context_parallel_size > 1
                and not self._groups_registered):
            ps = import_megatron("megatron.core.parallel_state")
            inner, outer = ps.get_hierarchical_context_parallel_groups()
            register_hybrid_groups(ps.get_context_parallel_group(), args.ulysses_degree,
                                   inner, outer)
            self._groups_registered = True
        return args

    def model_provider(self, pre_process=True, post_process=True, vp_stage=None, config=None,
                       pg_collection=None, **_unused):
        args = self._args()
        if config is None:
            config = importlib.import_module(
                "megatron.training.arguments").core_transformer_config_from_args(args)
        rope = args.position_embedding_type == "rope"
        te = (getattr(args, "transformer_impl", "local") == "transformer_engine"
              and torch.cuda.is_available() and has_transformer_engine())
        spec = get_gpt_eod_block_spec(
            self.registry, config, use_transformer_engine=te, rotary_base=args.rotary_base,
            rotary_percent=args.rotary_percent if rope else 0.0,
            normalization=args.normalization,
            kernel="flash_attn" if getattr(args, "use_flash_attn", False) else "auto")
        gpt = import_megatron("megatron.core.models.gpt")
        return gpt.GPTModel(
            config, spec, vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
            post_process=post_process,
            fp16_lm_cross_entropy=getattr(args, "fp16_lm_cross_entropy", False),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type="none", pg_collection=pg_collection)

    def datasets_provider(self, train_val_test_num_samples):
        args = self._args()
        return build_gpt_datasets(
            None if getattr(args, "mock_data", False) else args.data_path, args.seq_length,
            self._training().get_tokenizer(), list(train_val_test_num_samples),
            split=args.split, seed=args.seed, reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
            path_to_cache=args.data_cache_path, is_built_on_rank=is_dataset_built_on_rank)

    def forward_step(self, data_iterator, model, return_schedule_plan=False):
        if return_schedule_plan:
            raise ValueError("EoD attention does not support combined 1F1B schedule plans")
        return self.steps().forward_step(data_iterator, model)

    def steps(self) -> EodGPTSteps:
        if self._steps is None:
            args = self._args()
            tokenizer = self._training().get_tokenizer()
            self._steps = EodGPTSteps(
                tokenizer.eod, self.registry, args.seq_length, args.micro_batch_size,
                algo=args.context_parallel_algo, ulysses_degree=args.ulysses_degree,
                reset_position_ids=args.reset_position_ids,
                reset_attention_mask=args.reset_attention_mask,
                eod_mask_loss=args.eod_mask_loss,
                pad_token_id=None,  # GPTDataset already turned pads into loss-masked zeros
                plan_ahead=plans_ahead(args))
        return self._steps


# Megatron-LM marks dataset providers that build on several ranks themselves.
EodProviders.datasets_provider.is_distributed = True
