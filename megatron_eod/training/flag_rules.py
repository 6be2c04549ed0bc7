"""Flag rules outside context parallelism that both trainers share, so that one launch script
is refused by both with the same line, or by neither.

One job: each `check_*(args)` reads a namespace with Megatron's attribute names (the lean
trainer's args, or Megatron-LM's) and raises `FlagError` naming the flag and the rule:
`check_split` (the --split string), `check_positive` (intervals that are divided by, sizes),
`check_global_batch` (--global-batch-size against the micro-batch and DP sizes; needs
`data_parallel_size`), `check_tokenizer_files` (what each --tokenizer-type reads),
`check_device_precision` (--bf16 / --fp16 need CUDA), `check_backend_device` (nccl needs
CUDA), `check_profiler_device` (--profile's CUDA profiler), `check_rank_order`
(--use-tp-pp-dp-mapping's groups). Under Megatron-LM's trainer each of these was a bare
`AssertionError`, a ZeroDivisionError or a traceback, some only after the model was built
(megatron_lm_args.py runs them around its validate_args).

What it does not do: no defaults (args.py, megatron_lm_args.py set them), no CP rules
(cp_flags.py).
"""

from __future__ import annotations

from megatron_eod.data.split_sizes import split_shares
from megatron_eod.data.tokenizers import SENTENCEPIECE_TYPES
from megatron_eod.training.cp_flags import FlagError

__all__ = ["check_backend_device", "check_device_precision", "check_global_batch",
           "check_positive", "check_profiler_device", "check_rank_order", "check_split",
           "check_tokenizer_files"]

# What each --tokenizer-type reads (Megatron-LM's build_tokenizer asserts these bare).
TOKENIZER_NEEDS = {"HuggingFaceTokenizer": ("tokenizer_model",),
                   "GPT2BPETokenizer": ("vocab_file", "merge_file"),
                   "BertWordPieceLowerCase": ("vocab_file",),
                   "BertWordPieceCase": ("vocab_file",),
                   "NullTokenizer": ("vocab_size",),
                   "TikTokenizer": ("tokenizer_model", "tiktoken_pattern"),
                   **{name: ("tokenizer_model",) for name in SENTENCEPIECE_TYPES}}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_split(args) -> None:
    """--split: up to three shares, not all 0, and a training share where the run trains
    (None: not given, or a blend per split)."""
    if getattr(args, "split", None) is None or getattr(args, "mock_data", False):
        return  # mock data: megatron-core splits it 1,1,1 whatever --split says
    try:
        shares = split_shares(args.split)
    except ValueError as error:
        raise FlagError(str(error)) from None
    trains = (getattr(args, "train_iters", None) or getattr(args, "train_samples", None)) and \
        not getattr(args, "skip_train", False)
    if trains and shares[0] == 0:
        raise FlagError(f"--split {args.split} gives training no share of the data, and the "
                        f"run trains: give the first (train) share a value above 0, or pass "
                        f"--skip-train to evaluate only")


def check_positive(args, *dests: str) -> None:
    """Each of `dests` unset (None) or positive (intervals: the trainers take the iteration
    modulo them)."""
    for dest in dests:
        value = getattr(args, dest, None)
        if value is not None and not value > 0:
            raise FlagError(f"{_flag(dest)} must be positive, got {value}")


def check_global_batch(args, decrease_helps: bool = True) -> None:
    """--global-batch-size a multiple of --micro-batch-size x the data-parallel size, unless
    --decrease-batch-size-if-needed (then at least one such unit). `decrease_helps` False:
    where that flag does not help (Megatron-LM >= 0.18 asserts the multiple for the
    evaluation batch, which it derives from --global-batch-size, whatever the flag)."""
    mbs, dp, gbs = args.micro_batch_size, args.data_parallel_size, args.global_batch_size
    unit = mbs * dp
    if decrease_helps and getattr(args, "decrease_batch_size_if_needed", False):
        if gbs < unit:
            raise FlagError(f"--global-batch-size {gbs} is smaller than --micro-batch-size "
                            f"{mbs} x data-parallel size {dp}")
    elif gbs % unit:
        raise FlagError(f"--global-batch-size {gbs} must be a multiple of --micro-batch-size "
                        f"{mbs} x data-parallel size {dp}" + (
                            " (or pass --decrease-batch-size-if-needed)" if decrease_helps
                            else ""))


def check_tokenizer_files(args, default: str = "") -> None:
    """The flags --tokenizer-type needs; `default`: said where the type is the trainer's
    default rather than the user's (Megatron-LM's GPT2BPETokenizer)."""
    kind = getattr(args, "tokenizer_type", None)
    for dest in TOKENIZER_NEEDS.get(kind, ()):
        if getattr(args, dest, None) is None:
            raise FlagError(f"--tokenizer-type {kind}{default} needs {_flag(dest)}")


def check_device_precision(args, cuda_available: bool) -> None:
    """--bf16 / --fp16 without CUDA: the CPU attention kernel takes float32/float64 (under
    Megatron-LM's trainer the model was built first, then the first forward stopped with a
    ValueError, or --fp16's grad scaler asserted CUDA)."""
    for dest in ("bf16", "fp16"):
        if getattr(args, dest, False) and not cuda_available:
            raise FlagError(f"{_flag(dest)} needs CUDA: the CPU attention kernel takes "
                            f"float32/float64; drop {_flag(dest)} on CPU")


def check_backend_device(args, cuda_available: bool, default: str = "") -> None:
    """--distributed-backend nccl without CUDA (Megatron-LM's default backend: its trainer
    stopped in init_process_group with a traceback on every rank)."""
    if getattr(args, "distributed_backend", None) == "nccl" and not cuda_available:
        raise FlagError(f"--distributed-backend nccl{default} needs CUDA; pass "
                        f"--distributed-backend gloo on CPU")


def check_rank_order(args) -> None:
    """--use-tp-pp-dp-mapping (rank order tp-cp-ep-pp-dp) with pipeline stages: megatron-core
    asserts that the expert layers' data-parallel groups, which leave CP out, equal the
    attention's, i.e. expert tensor x expert model parallel = tensor x context parallel
    (an AssertionError on every rank when it builds the groups)."""
    if not getattr(args, "use_tp_pp_dp_mapping", False) or \
            args.pipeline_model_parallel_size == 1:
        return
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    ep = getattr(args, "expert_model_parallel_size", None) or 1
    if etp * ep != tp * cp:
        raise FlagError(f"--use-tp-pp-dp-mapping with --pipeline-model-parallel-size "
                        f"{args.pipeline_model_parallel_size}: megatron-core needs expert "
                        f"tensor x expert model parallel ({etp} x {ep}) = "
                        f"--tensor-model-parallel-size x --context-parallel-size ({tp} x {cp}) "
                        f"under this rank order; drop the flag (or use "
                        f"--context-parallel-size 1)")


def check_profiler_device(args, cuda_available: bool) -> None:
    """Megatron-LM's --profile starts CUDA's profiler at --profile-step-start unless
    --use-pytorch-profiler: without CUDA a traceback on every rank that many iterations in."""
    if getattr(args, "profile", False) and not getattr(args, "use_pytorch_profiler", False) \
            and not cuda_available:
        raise FlagError("--profile needs CUDA (Megatron-LM starts CUDA's profiler at "
                        "--profile-step-start); add --use-pytorch-profiler, or drop --profile "
                        "on CPU")
