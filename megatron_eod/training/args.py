"""Megatron-style command-line flags for `pretrain_gpt.py`.

One job: parse Megatron's flag spellings (dest names as in Megatron-LM: `--num-layers` ->
`args.num_layers`, `--disable-bias-linear` -> `args.add_bias_linear = False`, mirrored as
`args.disable_bias_linear`), fill the derived fields (`world_size`, `data_parallel_size`,
`ulysses_degree`, `params_dtype`, batch and LR defaults, ...) and reject every invalid
combination with a `FlagError` that names the flags. The model flags are args_model.py's,
the optimizer/schedule/checkpoint ones args_optim.py's, the device rules args_device.py's.
The CP rules (and FlagError) live in cp_flags.py, shared with Megatron-LM's args;
`--context-parallel-algo` also takes the Ascend spellings (`megatron_cp_algo` -> ring, ...)
and stores the short name.

What it does not do: no file checks (dataset.py and build_tokenizer check that paths exist),
no process groups, no global args object, no import of optional tokenizer packages.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Optional, Sequence

import torch

from megatron_eod.data.tokenizers import TOKENIZER_TYPES
from megatron_eod.megatron.dataset import NO_DATA, PER_SPLIT_SOURCES, data_sources_given
from megatron_eod.training import args_optim as optim
from megatron_eod.training import checkpoint_args
from megatron_eod.training.args_megatron_lm_only import (add_no_effect_args,
                                                         check_no_effect_values,
                                                         explain_unrecognized)
from megatron_eod.training.args_model import add_model_args, check_model, switches, typed
from megatron_eod.training.args_pipeline import (add_virtual_pipeline_args,
                                                 check_interleaved_micro_batches,
                                                 check_pipeline_stages, check_virtual_pipeline,
                                                 chunk_layers)
from megatron_eod.training.args_device import check_device_flags
from megatron_eod.training.cp_flags import (CONCURRENT_CALLS_HELP, CP_ALGO_ALIASES,
                                            FUSED_BACKWARD_HELP, FUSED_FORWARD_HELP,
                                            RING_EXCHANGE_HELP, RING_EXCHANGES, FlagError,
                                            check_context_parallel, check_sequence_parallel_rows)
from megatron_eod.training.cp_spellings import NotGiven, resolve_cp_spellings
from megatron_eod.training.flag_rules import check_positive as _positive
from megatron_eod.training.flag_rules import check_split, check_tokenizer_files

__all__ = ["CP_ALGO_ALIASES", "FlagError", "build_parser", "check_context_parallel", "parse_args",
           "validate_args"]

class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors raise FlagError (one clean line) instead of exiting."""

    def error(self, message):
        raise FlagError(message)


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    typed(g, int, ("--micro-batch-size", 1),
           ("--global-batch-size", None, "default: --micro-batch-size x data-parallel size"),
           ("--seed", 1234), ("--recompute-num-layers", None, "default with full: 1"))
    switches(g, "--bf16", "--fp16", "--use-cpu-initialization")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="keep training when the loss or the grad norm is NaN/Inf (default: "
                        "stop, as Megatron-LM)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="default with full: uniform")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM's other name of --recompute-granularity selective")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector off, a full collection every "
                        "--manual-gc-interval iterations (0: none) and around evaluations")
    g.add_argument("--manual-gc-interval", type=int, default=0)
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false",
                   dest="manual_gc_eval",
                   help="with --manual-gc: no collection around evaluations")
    g.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                   help="give cached CUDA memory back: 1 after each forward-backward, 2 also "
                        "after each optimizer step (as Megatron-LM)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal (any rank), save (with --save) after the current "
                        "iteration and stop")
    g.add_argument("--exit-signal", default="SIGTERM", help="a signal name (default SIGTERM)")
    for flag, dest in (("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
                       ("--no-bias-gelu-fusion", "bias_gelu_fusion"),
                       ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
                       ("--no-bias-dropout-fusion", "bias_dropout_fusion")):
        g.add_argument(flag, action="store_false", dest=dest,
                       help="turn off this fusion of megatron-core's (on with CUDA where it runs)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="megatron-core's fused vocab-parallel cross entropy")
    g.add_argument("--cross-entropy-fusion-impl", choices=("native", "te"), default="native")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bitwise reproducible runs, as Megatron-LM's: torch's deterministic "
                        "algorithms (deterministic flash-attention backward too) and "
                        "megatron-core's deterministic embedding; on CUDA needs "
                        "CUBLAS_WORKSPACE_CONFIG and, with NCCL, NCCL_ALGO (slower)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: reduce gradients in bf16 (default float32)")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with CUDA, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a collective that waits longer (a rank stopped answering) ends the "
                        "job; every process group (Megatron-LM's default: 10)")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="PREFIX ... or WEIGHT PREFIX ... (required unless --mock-data)")
    switches(g, "--mock-data")
    g.add_argument("--data-args-path", default=None,
                   help="a file holding --data-path's words (for long blends)")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"the {split} split's own blend (PREFIX ... or WEIGHT PREFIX ...)")
    g.add_argument("--per-split-data-args-path", default=None,
                   help='a JSON file {"train": ..., "valid": ..., "test": ...} of blends')
    g.add_argument("--split", default=None,
                   help="train,valid,test shares of one blend (default 969,30,1)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="ByteTokenizer")
    typed(g, str, ("--tokenizer-model", None), ("--vocab-file", None), ("--merge-file", None),
           ("--data-cache-path", None))
    typed(g, int, ("--vocab-size", None), ("--num-workers", 0),
           ("--tiktoken-num-special-tokens", 1000))
    g.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None,
                   help="TikTokenizer's split pattern (required with it)")
    g.add_argument("--tiktoken-special-tokens", nargs="+", default=None)
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="read the .bin files instead of memory-mapping them (megatron-core's)")
    g.add_argument("--dataloader-type", choices=("single", "cyclic", "external"), default=None,
                   help="single (the default, and the only one here): the samples in order, "
                        "each once, as Megatron-LM's single sampler")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="accepted for Megatron-LM scripts: no dense mask is ever made here")
    typed(g, int, ("--num-dataset-builder-threads", 1))
    typed(g, float, ("--mid-level-dataset-surplus", 0.005))
    switches(g, "--dataloader-fast-cache-load", "--dataloader-defer-npy-index-mmap")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging and checkpoints")
    typed(g, str, ("--save", None), ("--load", None), ("--tensorboard-dir", None),
           ("--metrics-file", None))
    switches(g, "--skip-train", "--log-params-norm", "--log-num-zeros-in-grad",
              "--log-throughput", "--log-validation-ppl-to-tensorboard")
    typed(g, int, ("--save-interval", None), ("--eval-interval", 1000), ("--eval-iters", 100),
           ("--log-interval", 100), ("--exit-interval", None),
           ("--exit-duration-in-mins", None, "save (with --save) and exit after this many "
                                             "minutes since start-up, checked every iteration "
                                             "(Megatron-LM's; 0: off)"),
           ("--save-keep-last", None, "keep only the newest N checkpoints under --save "
                                      "(default: keep all, as Megatron-LM)"))


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism and EoD")
    typed(g, int, ("--tensor-model-parallel-size", 1), ("--pipeline-model-parallel-size", 1),
           ("--context-parallel-size", 1),
           ("--ulysses-degree-in-cp", None, "Ulysses group size for --context-parallel-algo "
                                            "hybrid"))
    g.add_argument("--context-parallel-algo", default=None,
                   help=f"one of {', '.join(CP_ALGO_ALIASES)} (default: from --cp-comm-type: "
                        f"ring)")
    g.add_argument("--cp-comm-type", nargs="+", default=NotGiven(["p2p"]),
                   help="Megatron-LM's spelling: p2p = ring, a2a = ulysses, a2a+p2p = hybrid "
                        "(with --hierarchical-context-parallel-sizes)")
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
                   help="Megatron-LM's spelling of hybrid's sizes: U CP/U (Ulysses inside, Ring "
                        "across)")
    g.add_argument("--cp-ring-exchange", choices=RING_EXCHANGES, default="batched",
                   help=RING_EXCHANGE_HELP)
    g.add_argument("--cp-concurrent-calls", action="store_true", help=CONCURRENT_CALLS_HELP)
    g.add_argument("--cp-fused-forward", action="store_true", help=FUSED_FORWARD_HELP)
    g.add_argument("--cp-fused-backward", action="store_true", help=FUSED_BACKWARD_HELP)
    switches(g, "--sequence-parallel", "--use-flash-attn", "--reset-attention-mask",
              "--reset-position-ids", "--eod-mask-loss")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="Megatron-LM's rank order tp-cp-ep-pp-dp (pipeline stages on nearer "
                        "ranks than data-parallel replicas) instead of tp-cp-ep-dp-pp")
    g.add_argument("--attention-mask-type", choices=("causal", "general"), default=None,
                   help="general = EoD document mask (default with --reset-attention-mask)")
    g.add_argument("--trainer", choices=("auto", "megatron-lm", "lean"), default="auto",
                   help="which trainer pretrain_gpt.py runs (read before these flags)")
    g.add_argument("--no-plan-ahead", action="store_false", dest="plan_ahead",
                   help="plan each micro-batch when the step needs it instead of one "
                        "micro-batch ahead on a worker thread (for debugging)")


def build_parser() -> argparse.ArgumentParser:
    """The flags of `pretrain_gpt.py`; usage errors raise FlagError."""
    parser = _Parser(description="GPT pretraining with EoD reset under context parallelism",
                     allow_abbrev=False)
    for add in (add_model_args, add_virtual_pipeline_args, _add_training_args,
                optim.add_optimizer_args, optim.add_schedule_args, _add_data_args,
                _add_logging_args, optim.add_checkpoint_args, _add_parallel_args,
                add_no_effect_args):
        add(parser)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None,
               cuda_available: Optional[bool] = None) -> argparse.Namespace:
    """Parse `argv` (default sys.argv[1:]) and `validate_args`; unknown flags are a FlagError."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--use-checkpoint-args" in argv:  # the checkpoint may give them
        for action in parser._actions:
            if action.dest in checkpoint_args.REQUIRED:
                action.required = False
    try:
        args, unknown = parser.parse_known_args(argv)
    except FlagError:  # a required flag missing: a misspelling of it says more
        for action in parser._actions:
            action.required = False
        try:
            unknown = parser.parse_known_args(argv)[1]
        except FlagError:
            unknown = []
        if unknown:
            raise FlagError(explain_unrecognized(unknown, parser._option_string_actions)) \
                from None
        raise
    if unknown:
        raise FlagError(explain_unrecognized(unknown, parser._option_string_actions))
    spelled = parser._option_string_actions
    given = {spelled[word.split("=", 1)[0]].dest: None for word in argv
             if word.split("=", 1)[0] in spelled}  # the dests the flags set
    given = {dest: getattr(args, dest) for dest in given}
    checkpoint_args.apply_checkpoint_args(args, given, parser)
    if world_size is None:
        try:
            world_size = int(os.environ.get("WORLD_SIZE", 1))
        except ValueError:
            raise FlagError(f"WORLD_SIZE must be an integer, got "
                            f"{os.environ['WORLD_SIZE']!r}") from None
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return validate_args(args, world_size, cuda_available)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise FlagError(message)


def validate_args(args: argparse.Namespace, world_size: int,
                  cuda_available: bool) -> argparse.Namespace:
    """Fill the derived fields of `args` in place and check every rule; returns `args`."""
    _require(isinstance(world_size, int) and world_size > 0,
             f"WORLD_SIZE must be a positive integer, got {world_size!r}")
    args.world_size = world_size
    _check_parallel_sizes(args)
    check_model(args)
    check_pipeline_stages(args)
    resolve_cp_spellings(args)
    check_context_parallel(args)
    _check_training(args, bool(cuda_available))
    check_interleaved_micro_batches(args)
    _check_sequence_parallel(args)
    _check_data(args)
    _check_eod(args)
    _check_logging(args)
    optim.check_checkpoint(args)
    check_no_effect_values(args)
    return args


def _check_parallel_sizes(args) -> None:
    _positive(args, "tensor_model_parallel_size", "pipeline_model_parallel_size",
              "context_parallel_size")
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    _require(args.world_size % (tp * pp * cp) == 0,
             f"WORLD_SIZE {args.world_size} is not divisible by --tensor-model-parallel-size x "
             f"--pipeline-model-parallel-size x --context-parallel-size = {tp} x {pp} x {cp} = "
             f"{tp * pp * cp}")
    args.data_parallel_size = args.world_size // (tp * pp * cp)
    check_virtual_pipeline(args)


def _check_sequence_parallel(args) -> None:
    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # as Megatron: nothing to shard at TP 1
    check_sequence_parallel_rows(args)


def _check_training(args, cuda_available: bool) -> None:
    optim.check_batch_sizes(args)
    optim.check_schedule(args)
    optim.check_optimizer(args)
    _check_recompute(args)
    check_device_flags(args, cuda_available)
    _positive(args, "distributed_timeout_minutes")
    _require(args.manual_gc_interval >= 0,
             f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    _require(not args.grad_reduce_in_bf16 or args.bf16,
             "--grad-reduce-in-bf16 reduces bf16 gradients: it needs --bf16")
    _require(args.exit_signal in signal.Signals.__members__
             and args.exit_signal not in ("SIGKILL", "SIGSTOP"),
             f"--exit-signal {args.exit_signal}: not a signal name (e.g. SIGTERM, SIGUSR1)")


def _check_recompute(args) -> None:
    if args.recompute_granularity != "full":
        for dest in ("recompute_method", "recompute_num_layers"):
            _require(getattr(args, dest) is None,
                     f"{_flag(dest)} needs --recompute-granularity full")
        return
    args.recompute_method = args.recompute_method or "uniform"
    if args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    chunks = args.virtual_pipeline_model_parallel_size or 1
    built = [n for n in chunk_layers(args) if n > 0]
    even = len(set(built)) == 1
    _require(1 <= args.recompute_num_layers <= max(built),
             f"--recompute-num-layers {args.recompute_num_layers} must be in [1, "
             + ("--num-layers / --pipeline-model-parallel-size" if even else
                "the layers of the largest pipeline stage")
             + (" / virtual stages" if chunks > 1 else "") + f" = {max(built)}]")
    # megatron-core's uniform method checkpoints runs of N layers and reads past a chunk
    # whose layers N does not divide (an IndexError in the first forward)
    uneven = sorted({n for n in built if n % args.recompute_num_layers})
    _require(args.recompute_method != "uniform" or not uneven,
             f"--recompute-method uniform --recompute-num-layers {args.recompute_num_layers} "
             f"must divide the layers of every pipeline stage"
             + (" chunk" if chunks > 1 else "") + f" (some have {uneven[0] if uneven else 0}): "
             f"pass a divisor, or --recompute-method block")


def _check_data(args) -> None:
    given = data_sources_given(args)
    _require(len(given) <= 1, f"{' and '.join(given)} are exclusive: pass one data source")
    _require(bool(given), NO_DATA)
    per_split = given[0] in PER_SPLIT_SOURCES
    _require(not (per_split and args.split is not None),
             f"--split {args.split} shares one blend between the splits; {given[0]} gives "
             f"each split its own: drop --split")
    if per_split:
        _require(args.per_split_data_args_path or args.train_data_path,
                 "a blend per split needs --train-data-path")
    elif args.split is None:
        args.split = "969,30,1"
    check_split(args)
    check_tokenizer_files(args)
    _positive(args, "vocab_size")
    _require(args.num_workers >= 0, f"--num-workers must be >= 0, got {args.num_workers}")
    _require(args.dataloader_type in (None, "single"),
             f"--dataloader-type {args.dataloader_type}: the lean trainer reads the samples in "
             f"order, each once (single); drop the flag, or train with Megatron-LM's trainer "
             f"(--trainer megatron-lm)")


def _check_eod(args) -> None:
    if args.attention_mask_type is None:
        args.attention_mask_type = "general" if args.reset_attention_mask else "causal"
    elif args.attention_mask_type == "general":
        args.reset_attention_mask = True
    _require(args.attention_mask_type == "general" or not args.reset_attention_mask,
             "--attention-mask-type causal contradicts --reset-attention-mask (causal attends "
             "across EoD); drop one of them")


def _check_logging(args) -> None:
    _positive(args, "save_interval", "log_interval", "exit_interval", "save_keep_last")
    if not args.skip_train:  # read by the training loop only
        _positive(args, "eval_interval")
    _require(args.save_keep_last is None or args.save is not None,
             "--save-keep-last needs --save DIR")
    _require(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")
