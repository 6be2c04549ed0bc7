"""Megatron-LM's flags, read the EoD way: our extra flags, its CP spellings, our refusals.

One job: turn Megatron-LM's parsed and validated args into args our providers can run, or a
FlagError naming the flag and what to pass instead. `add_eod_args` is the
`extra_args_provider`; `eod_args_from_megatron(args)` runs right after Megatron-LM's own
`validate_args` (run.py hooks it in; `check_before_megatron`, the CP spellings alone, right
before it) and again, as a no-op, from the providers.

Context parallelism, one fact asked once: Megatron-LM's `--cp-comm-type` and ours map onto
each other (cp_flags.resolve_cp_spellings).

Honoured: RoPE (base, percent, interleaved, Llama-3 scaling, interpolation) at reset
positions, learned absolute positions at reset positions, `--position-embedding-type none`,
`--qk-layernorm`, GQA, `--transformer-impl local|transformer_engine`, TP/PP/CP/DP, virtual
pipeline stages, the distributed optimizer, torch_dist checkpoints. Per-token loss is the
default here (`--calculate-per-token-loss` on): otherwise each CP rank divides by its own
token count.
Everything else EoD attention cannot run is in REFUSED, with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys

import torch

from megatron_eod.megatron.dataset import NO_DATA, data_sources_given
from megatron_eod.training import data
from megatron_eod.training.cp_flags import (CONCURRENT_CALLS_HELP, CP_ALGO_ALIASES,
                                            FUSED_BACKWARD_HELP, FUSED_FORWARD_HELP,
                                            RING_EXCHANGE_HELP, RING_EXCHANGES, FlagError,
                                            NotGiven, check_context_parallel,
                                            check_gloo_on_cuda, check_gpu_attention,
                                            check_query_groups, check_sequence_parallel_rows,
                                            resolve_cp_spellings)
from megatron_eod.training.flag_rules import (check_backend_device,
                                              check_decoupled_lr_checkpoints,
                                              check_device_precision, check_global_batch,
                                              check_persistent_ckpt_worker, check_positive,
                                              check_profiler_device, check_rank_order,
                                              check_world_size, check_blend_weights,
                                              check_split,
                                              keep_the_flags_attention_dropout,
                                              ramp_as_step_schedule)
from megatron_eod.training.gpu_defaults import choose_attention_path
from megatron_eod.training.model_flags import check_hybrid_pattern, check_mla, check_moe
from megatron_eod.training.tokenizer_flags import check_tokenizer, tokenizer_from_data

__all__ = ["REFUSED", "SAVE_AT_THE_END", "add_eod_args", "check_before_megatron",
           "eod_args_from_megatron"]

# --save without --save-interval: Megatron-LM asserts an interval; we save at the end only,
# which an interval no run reaches gives in Megatron-LM's loop.
SAVE_AT_THE_END = 2 ** 31 - 1


class _DefaultGroups(int):
    """Megatron-LM's default --num-query-groups (1), told apart from an explicit
    `--num-query-groups 1` (MQA meant, multi-head attention built without
    --group-query-attention). Made a plain int once read: args go into checkpoints."""


# dest -> (is it set?, why it is refused). Checked in order; the first hit raises.
REFUSED = {
    "spec": (bool, "a custom layer spec replaces the one EoD attention is slotted into"),
    "heterogeneous_layers_config_path": (bool, "heterogeneous layers use their own specs"),
    "use_legacy_models": (bool, "the legacy model has no pluggable core attention"),
    "experimental_attention_variant": (bool, "it replaces softmax attention (gated delta "
                                             "net, DSA)"),
    "qk_l2_norm": (bool, "the EoD layer spec has q/k layer norms (--qk-layernorm), not L2 "
                         "norms"),
    "use_kitchen_attention": (bool, "Kitchen attention replaces the core attention"),
    "kitchen_config_file": (bool, "Kitchen quantized layers are not in the EoD layer spec"),
    "kitchen_recipe_number": (lambda v: v is not None, "Kitchen quantized layers are not in "
                                                       "the EoD layer spec"),
    "yaml_cfg": (bool, "the EoD providers read the model from command-line flags"),
    "window_size": (lambda v: v is not None, "EoD attention is full causal per document"),
    "softmax_type": (lambda v: v not in (None, "vanilla"), "the kernels compute vanilla softmax"),
    "hybrid_context_parallel": (bool, "Megatron-LM's dynamic hybrid CP re-packs sequences; "
                                      "use --cp-comm-type a2a+p2p (our hybrid)"),
    "sft": (bool, "the EoD providers build pretraining GPTDatasets"),
    "fim_data": (bool, "the EoD providers build pretraining GPTDatasets"),
    # From Megatron-LM 0.19:
    "logits_load_dir": (lambda v: v is not None, "distillation from cached logits replaces "
                                                 "the loss function the EoD providers use"),
    "logits_save_dir": (lambda v: v is not None, "a CP rank holds its tokens in its plan's "
                                                 "order, not the sequence's"),
    "qk_clip": (bool, "QK-clip reads the core attention's largest logits, which the EoD "
                      "attention's varlen kernels do not report"),
    "log_max_attention_logit": (bool, "the EoD attention's varlen kernels do not report the "
                                      "largest attention logits"),
    "dataloader_type": (lambda v: v == "external", "an external data loader bypasses the "
                                                   "datasets and batches the EoD providers "
                                                   "build (it failed at the first step)"),
}


def add_eod_args(parser, model: str = "gpt"):
    """Megatron-LM `extra_args_provider`: our flags, per-token loss by default, and a default
    --eval-interval. `model`: what the providers build, "gpt" (pretrain_gpt.py) or "hybrid"
    (pretrain_hybrid.py: HybridModel), kept as args.eod_model."""
    g = parser.add_argument_group("megatron-eod")
    g.add_argument("--context-parallel-algo", default=None,
                   help=f"one of {', '.join(CP_ALGO_ALIASES)} (default: from --cp-comm-type, "
                        f"p2p = ring, a2a = ulysses, a2a+p2p = hybrid)")
    g.add_argument("--ulysses-degree-in-cp", type=int, default=None,
                   help="Ulysses group size for hybrid (default: the first of "
                        "--hierarchical-context-parallel-sizes)")
    g.add_argument("--cp-ring-exchange", choices=RING_EXCHANGES, default="batched",
                   help=RING_EXCHANGE_HELP)
    g.add_argument("--cp-concurrent-calls", action=argparse.BooleanOptionalAction,
                   default=None, help=CONCURRENT_CALLS_HELP)
    g.add_argument("--cp-fused-forward", action=argparse.BooleanOptionalAction, default=None,
                   help=FUSED_FORWARD_HELP)
    g.add_argument("--cp-fused-backward", action="store_true", help=FUSED_BACKWARD_HELP)
    g.add_argument("--metrics-file", default=None,
                   help="append one JSON line per iteration and per evaluation")
    g.add_argument("--no-plan-ahead", action="store_false", dest="plan_ahead",
                   help="plan each micro-batch when the step needs it, not one ahead")
    # --eval-interval: core_v0.16.1 and later have no default (None) and divide by it when
    # they size the validation data (a TypeError after the model is built, whatever
    # --eval-iters says); Megatron-LM <= 0.15's, 1000. apply_rope_fusion (--no-rope-fusion):
    # EoD attention applies RoPE itself at the reset positions, never megatron-core's fused
    # kernel, whose default needs TransformerEngine (without it every rank stopped with
    # "apply_rope_fusion is not available").
    parser.set_defaults(eod_model=model, calculate_per_token_loss=True,
                        cp_comm_type=NotGiven(["p2p"]),
                        eval_interval=1000, num_query_groups=_DefaultGroups(1),
                        apply_rope_fusion=False)
    return parser


def check_before_megatron(args) -> None:
    """Our CP spellings resolved and checked BEFORE Megatron-LM's validate_args (hooked in by
    run.py), whose bare assertions on them (the hierarchical sizes'
    product) would otherwise stop the run first with no message; it also fills in
    --hierarchical-context-parallel-sizes from --ulysses-degree-in-cp, which
    --cp-comm-type a2a+p2p needs there. eod_args_from_megatron repeats it, a no-op then.
    Likewise --split and the intervals (its bare assertion, or a ZeroDivisionError after the
    first iteration), and --save without --save-interval saves at the end (Megatron-LM asserts
    an interval)."""
    if getattr(args, "ulysses_degree", None) is None:
        resolve_cp_spellings(args)
    check_world_size(args)
    check_blend_weights(args)
    tokenizer_from_data(args)
    keep_the_flags_attention_dropout(args)
    check_split(args)
    check_positive(args, "log_interval")
    if not (getattr(args, "skip_train", False) or getattr(args, "full_validation", False)):
        check_positive(args, "eval_interval")  # it sizes the validation data by it
    if getattr(args, "save", None):
        check_positive(args, "save_interval")
        if getattr(args, "save_interval", 0) is None and \
                getattr(args, "save_retain_interval", None) is None:  # else: its assertion
            args.save_interval = SAVE_AT_THE_END


def eod_args_from_megatron(args) -> None:
    """Normalise and check Megatron-LM's args in place; FlagError names the flags."""
    if getattr(args, "ulysses_degree", None) is not None:
        return  # already done (the hook and the providers both call this)
    resolve_cp_spellings(args)
    check_context_parallel(args)
    _refuse(args)
    _check_xavier(args)
    check_sequence_parallel_rows(args)
    _check_rampup(args)
    _check_cuda_graphs(args)
    check_persistent_ckpt_worker(args, torch.cuda.is_available())
    check_decoupled_lr_checkpoints(args)
    check_gloo_on_cuda(args, torch.cuda.is_available())
    choose_attention_path(args, torch.cuda.is_available())
    check_gpu_attention(args, torch.cuda.is_available())
    check_moe(args, torch.cuda.is_available())
    check_mla(args)
    check_hybrid_pattern(args)
    check_device_precision(args, torch.cuda.is_available())
    if not torch.distributed.is_initialized():  # else Megatron-LM keeps the group it finds
        given = any(word.split("=", 1)[0] == "--distributed-backend" for word in sys.argv)
        check_backend_device(args, torch.cuda.is_available(),
                             "" if given else " (Megatron-LM's default where none is given)")
    check_profiler_device(args, torch.cuda.is_available())
    check_rank_order(args)
    _check_validation_data(args)
    _check_full_validation(args)
    if getattr(args, "data_parallel_size", None) and args.global_batch_size:  # validated
        check_global_batch(args)
    check_tokenizer(args)
    _check_gradient_accumulation_fusion(args)
    _check_warmup(args)


def _check_warmup(args) -> None:
    """The LR warm-up must end before the decay does: megatron-core's scheduler asserted it
    bare on every rank, after the model was built."""
    unit = "iters" if getattr(args, "train_iters", None) else "samples"
    decay = getattr(args, f"lr_decay_{unit}", None) or getattr(args, f"train_{unit}", None)
    fraction = getattr(args, "lr_warmup_fraction", None)
    if not decay:
        return
    if fraction is not None and not 0.0 <= fraction < 1.0:
        raise FlagError(f"--lr-warmup-fraction must be in [0, 1), got {fraction} (the warmup "
                        f"must end before the decay does)")
    warmup = getattr(args, f"lr_warmup_{unit}", 0) or 0
    if fraction is None and not 0 <= warmup < decay:
        raise FlagError(f"--lr-warmup-{unit} {warmup} must be in [0, --lr-decay-{unit} {decay}) "
                        f"(the warmup must end before the decay does)")


def _check_gradient_accumulation_fusion(args) -> None:
    """Megatron-LM's default --gradient-accumulation-fusion needs apex's CUDA extension
    fused_weight_gradient_mlp_cuda (absent on CPUs, and on GPUs without apex): megatron-core
    raised in the output layer's constructor, after the flags had passed, a traceback per rank
    naming no flag."""
    if getattr(args, "gradient_accumulation_fusion", False) and \
            importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        raise FlagError("--gradient-accumulation-fusion (Megatron-LM's default) needs apex's "
                        "CUDA extension fused_weight_gradient_mlp_cuda, which is not installed: "
                        "pass --no-gradient-accumulation-fusion")


def _check_xavier(args) -> None:
    """Megatron-LM 0.16's config mapping passes --init-method-xavier-uniform on as a
    `scaled_init_method` its megatron-core's TransformerConfig lacks: a TypeError when it
    builds the model. Named here, where that is so."""
    if not getattr(args, "init_method_xavier_uniform", False):
        return
    core = importlib.import_module("megatron.core.transformer.transformer_config")
    fields = {f.name for f in dataclasses.fields(core.TransformerConfig)}
    if "scaled_init_method" not in fields:
        raise FlagError("--init-method-xavier-uniform: this Megatron-LM passes megatron-core a "
                        "`scaled_init_method` its TransformerConfig lacks (a TypeError when the "
                        "model is built); drop the flag (later Megatron-LMs have it)")


def _check_cuda_graphs(args) -> None:
    """A CUDA graph replays the kernels it captured, with the index tensors of the CP plan
    it saw; EoD attention plans every micro-batch anew. Graphs of MLP/MoE parts only are
    fine; a scope that holds attention (empty = the whole layer, "attn", a full iteration)
    would silently reuse one batch's plan for the next."""
    impl = getattr(args, "cuda_graph_impl", "none") or "none"
    legacy = [f for f in ("enable_cuda_graph", "external_cuda_graph") if getattr(args, f, False)]
    if impl == "none" and not legacy:
        return
    scope = list(getattr(args, "cuda_graph_modules", None) or
                 getattr(args, "cuda_graph_scope", None) or [])
    names = [str(getattr(s, "name", s)).lower() for s in scope]
    if legacy or impl == "full_iteration" or not names or any(
            "attn" in n or "full" in n for n in names):
        shown = (f"--{legacy[0].replace('_', '-')}" if legacy else f"--cuda-graph-impl {impl}") \
            + (f" with scope {' '.join(names)}" if names else "")
        raise FlagError(f"{shown}: a CUDA graph would replay one micro-batch's CP plan for "
                        f"the next (EoD attention plans each anew); capture mlp/moe parts "
                        f"only (--cuda-graph-scope or, from Megatron-LM 0.19, "
                        f"--cuda-graph-modules), or no graphs")


def _check_full_validation(args) -> None:
    """Megatron-LM >= 0.19 validates --full-validation one sequence a micro-batch while its
    pipeline schedule still shapes stage transfers for the micro-batch size; sequence
    parallelism must split one sequence's tokens over TP."""
    if not data.validates_one_row_at_a_time(args):
        return
    if args.pipeline_model_parallel_size > 1:
        raise FlagError(f"--full-validation with --pipeline-model-parallel-size "
                        f"{args.pipeline_model_parallel_size}: this Megatron-LM validates one "
                        f"sequence a micro-batch but shapes its pipeline transfers for "
                        f"--micro-batch-size; drop --full-validation (validate with "
                        f"--eval-iters)")
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    if args.sequence_parallel and tp > 1 and (args.seq_length // cp) % tp:
        raise FlagError(f"--full-validation with --sequence-parallel needs --seq-length / "
                        f"--context-parallel-size = {args.seq_length // cp} tokens (one "
                        f"sequence a micro-batch) divisible by --tensor-model-parallel-size "
                        f"{tp}")


def _check_validation_data(args) -> None:
    """Megatron-LM evaluates whenever --eval-iters > 0 (or --full-validation), with or without
    validation data: without, its evaluation reads from no iterator and the run stops at its
    first evaluation, or at the end, after the whole training (every version to 0.19)."""
    evaluates = getattr(args, "eval_iters", 0) > 0 or getattr(args, "full_validation", False)
    if evaluates and data.validation_source(args) is None:
        given = (f"--split {args.split} gives none" if args.split is not None else
                 "no --valid-data-path, or no \"valid\" in --per-split-data-args-path")
        raise FlagError(f"no validation data ({given}) but "
                        f"--eval-iters {args.eval_iters}: Megatron-LM would stop at its first "
                        f"evaluation; pass --eval-iters 0, or validation data")


def _check_rampup(args) -> None:
    """Megatron-LM >= 0.18 accepts --rampup-batch-size and then trains at the full batch (its
    megatron-core ignores the ramp): hand it the same ramp as its --step-batch-size-schedule
    (thresholds in tokens, as it reads them, with its --seq-length), and say so."""
    schedule = ramp_as_step_schedule(args, tokens_per_sample=args.seq_length)
    if schedule is None:
        return
    given = "--rampup-batch-size " + " ".join(map(str, args.rampup_batch_size))
    args.step_batch_size_schedule, args.rampup_batch_size = schedule, None
    if getattr(args, "rank", 0) == 0:
        print(f" megatron-eod: {given} runs as --step-batch-size-schedule \"{schedule}\" "
              f"(tokens; this Megatron-LM's megatron-core ignores the ramp)", flush=True)


def _refuse(args) -> None:
    for dest, (is_set, why) in REFUSED.items():
        value = getattr(args, dest, None)
        if value is not None and is_set(value):
            shown = "" if value is True else f" {value}"
            raise FlagError(f"--{dest.replace('_', '-')}{shown}: {why}")
    if args.attention_dropout:
        source = (" taken from the checkpoint's args (--use-checkpoint-args), where the flags "
                  "give none" if getattr(args, "use_checkpoint_args", False) else "")
        raise FlagError(f"--attention-dropout {args.attention_dropout}{source} (Megatron-LM's "
                        f"default is 0.1): the varlen attention kernels apply no dropout; pass "
                        f"--attention-dropout 0")
    if isinstance(args.num_query_groups, _DefaultGroups):  # not passed: nothing to check
        args.num_query_groups = int(args.num_query_groups)
    else:
        check_query_groups(args)
    if args.position_embedding_type not in ("rope", "learned_absolute", "none"):
        raise FlagError(f"--position-embedding-type {args.position_embedding_type}: EoD reset "
                        f"supports rope, learned_absolute and none (at reset positions)")
    impl = getattr(args, "transformer_impl", "local")
    if impl not in ("local", "transformer_engine"):
        raise FlagError(f"--transformer-impl {impl}: EoD attention slots into the local or the "
                        f"transformer_engine GPT layer spec")
    if impl == "transformer_engine":
        from megatron_eod.attention.backends import has_transformer_engine

        if not has_transformer_engine():
            raise FlagError("--transformer-impl transformer_engine (Megatron-LM's default) "
                            "needs TransformerEngine, which is not installed; pass "
                            "--transformer-impl local")
    if not args.calculate_per_token_loss:
        raise FlagError("--calculate-per-token-loss is off: each CP rank would divide its loss "
                        "by its own token count; EoD providers need per-token loss")
    if not data_sources_given(args):
        raise FlagError(NO_DATA)
