"""Flag rules outside context parallelism, run on Megatron-LM's args around its validate_args.

One job: each `check_*(args)` reads Megatron-LM's args and raises `FlagError` naming the flag
and the rule:
`check_split` (the --split string), `check_blend_weights` (a blend's weights),
`check_positive` (intervals that are divided by, sizes),
`check_global_batch` (--global-batch-size against the micro-batch and DP sizes; needs
`data_parallel_size`), `check_tokenizer_files` (what each --tokenizer-type reads),
`check_device_precision` (--bf16 / --fp16 need CUDA), `check_backend_device` (nccl needs
CUDA), `check_profiler_device` (--profile's CUDA profiler), `check_rank_order`
(--use-tp-pp-dp-mapping's groups). Under Megatron-LM's trainer each of these was a bare
`AssertionError`, a ZeroDivisionError or a traceback, some only after the model was built
(args.py runs them around its validate_args). For checkpoints: `--attention-dropout` given on
the command line kept over the one `--use-checkpoint-args` takes from a checkpoint (EoD
attention has no dropout), the persistent checkpoint worker refused without CUDA (it dies at
the first save and the run waits), and `--decoupled-lr` refused where this megatron-core
cannot load the checkpoints it would write. `ramp_as_step_schedule`: --rampup-batch-size as
the step schedule megatron-core >= 0.18 reads instead (it ignores the ramp).

What it does not do: no defaults (args.py sets them), no CP rules (cp_flags.py).
"""

from __future__ import annotations

import importlib
import inspect
import sys

from megatron_eod.data.split_sizes import split_shares
from megatron_eod.data.tokenizers import SENTENCEPIECE_TYPES
from megatron_eod.training.cp_flags import FlagError

__all__ = ["check_backend_device", "check_blend_weights", "check_decoupled_lr_checkpoints",
           "check_device_precision",
           "check_global_batch", "check_persistent_ckpt_worker", "check_positive",
           "check_profiler_device", "check_rank_order", "check_split", "check_tokenizer_files",
           "check_world_size", "keep_the_flags_attention_dropout", "ramp_as_step_schedule",
           "rampup_as_step_schedule"]

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


BLEND_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def _number(word: str):
    try:
        return float(word)
    except ValueError:
        return None


def check_blend_weights(args) -> None:
    """A blend flag is prefixes alone, or "WEIGHT PREFIX" pairs with every weight above 0 (as
    megatron-core reads it: a list with numbers in it is pairs). Megatron-LM gave a bare
    AssertionError per rank for a weight <= 0, and read an odd list with numbers in it as
    prefixes, the numbers included."""
    for dest in BLEND_FLAGS:
        words = getattr(args, dest, None)
        if not words or all(_number(w) is None for w in words):
            continue
        given = f"{_flag(dest)} \"{' '.join(words)}\""
        if len(words) % 2:
            raise FlagError(f"{given}: {len(words)} words; give prefixes alone, or "
                            f"\"WEIGHT PREFIX\" pairs (an even count)")
        for weight, prefix in zip(words[::2], words[1::2]):
            value = _number(weight)
            if value is None or _number(prefix) is not None:
                raise FlagError(f"{given}: \"WEIGHT PREFIX\" pairs expected, got "
                                f"\"{weight} {prefix}\"")
            if not 0 < value < float("inf"):
                raise FlagError(f"{given}: the weight of {prefix} is {weight}; weights must be "
                                f"above 0 (leave a dataset out to not read it)")


def check_world_size(args) -> None:
    """The ranks must split into whole model replicas: Megatron-LM asserted "world size (4) is
    not divisible by total_model_size (3)", naming neither flag nor launcher."""
    world = getattr(args, "world_size", None)
    sizes = [(flag, getattr(args, dest, 1) or 1) for flag, dest in (
        ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
        ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
        ("--context-parallel-size", "context_parallel_size"))]
    model = 1
    for _, size in sizes:
        model *= size
    if isinstance(world, int) and world % model:
        given = " x ".join(f"{flag} {size}" for flag, size in sizes if size > 1) or \
            sizes[-1][0] + " 1"
        raise FlagError(f"{given} = {model} ranks a model replica, but the job has {world} "
                        f"ranks (WORLD_SIZE: torchrun's --nproc-per-node x --nnodes), not a "
                        f"multiple of {model}")


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


def check_tokenizer_files(args) -> None:
    """The flags --tokenizer-type needs."""
    kind = getattr(args, "tokenizer_type", None)
    for dest in TOKENIZER_NEEDS.get(kind, ()):
        if getattr(args, dest, None) is None:
            raise FlagError(f"--tokenizer-type {kind} needs {_flag(dest)}")


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


def ramp_as_step_schedule(args, tokens_per_sample: int = 1):
    """The --rampup-batch-size ramp as a step schedule (`rampup_as_step_schedule`) where the
    installed megatron-core ignores rampup_batch_size (>= 0.18, a deprecation warning and
    then the full batch), None where it ramps itself or no ramp is asked for. There a ramp
    beside --step-batch-size-schedule, or with --decrease-batch-size-if-needed (a step
    schedule cannot decrease the batch), is a FlagError."""
    if getattr(args, "rampup_batch_size", None) is None or not ramps_by_step_schedule():
        return None
    start, increment, samples = map(int, args.rampup_batch_size)
    given = f"--rampup-batch-size {start} {increment} {samples}"
    if getattr(args, "step_batch_size_schedule", None):
        raise FlagError(
f"{given}: this megatron-core ignores it beside --step-batch-size-schedule; "
                        f"drop one of them")
    if args.decrease_batch_size_if_needed:
        raise FlagError(f"{given} with --decrease-batch-size-if-needed: this megatron-core "
                        f"ramps only by a step schedule, which cannot decrease the batch; drop "
                        f"one of them")
    return rampup_as_step_schedule(start, increment, samples, args.global_batch_size,
                                   tokens_per_sample)


def ramps_by_step_schedule() -> bool:
    """Whether the installed megatron-core ramps the batch only by a step schedule and ignores
    rampup_batch_size (>= 0.18)."""
    calculator = importlib.import_module("megatron.core.num_microbatches_calculator")
    return "step_batch_size_schedule" in inspect.signature(
        calculator.init_num_microbatches_calculator).parameters


def rampup_as_step_schedule(start: int, increment: int, samples: int,
                            global_batch_size: int, tokens_per_sample: int = 1) -> str:
    """--rampup-batch-size START INCREMENT SAMPLES as megatron-core's step schedule
    ("THRESHOLD:BATCH ...", thresholds in samples x `tokens_per_sample`: Megatron-LM hands
    the calculator its --seq-length, which makes them tokens), the same batch at every
    consumed-sample count: megatron-core >= 0.18 ignores rampup_batch_size (deprecated for
    step_batch_size_schedule). The ramp: START + INCREMENT x int(consumed / (SAMPLES /
    increments)) up to SAMPLES, then the global batch; each threshold is the first sample
    count its step reaches."""
    increments = (global_batch_size - start) // increment
    per_increment = samples / increments  # a float, as megatron-core's ramp computes it

    def step(consumed: int) -> int:
        return increments if consumed > samples else int(consumed / per_increment)

    schedule = {0: start}  # threshold -> batch; several steps may share a threshold
    for k in range(1, increments + 1):
        threshold = max(0, int(k * per_increment) - 1)
        while step(threshold) < k:
            threshold += 1
        schedule[threshold] = start + k * increment
    schedule = sorted(schedule.items())
    return " ".join(f"{threshold * tokens_per_sample}:{batch}" for threshold, batch in schedule)


def _flag_value(argv, flag: str):
    """The last value `argv` gives `flag` (`--flag V` or `--flag=V`), or None."""
    value = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(flag + "="):
            value = word[len(flag) + 1:]
    return value



def keep_the_flags_attention_dropout(args) -> None:
    """--use-checkpoint-args: Megatron-LM sets --attention-dropout from the checkpoint's args
    whatever the flags say, and a checkpoint trained without EoD attention has its default,
    0.1, which EoD attention cannot run: the flags' value is kept over it (said on rank 0)."""
    if not getattr(args, "use_checkpoint_args", False):
        return
    given = _flag_value(sys.argv[1:], "--attention-dropout")
    if given is None or float(given) == args.attention_dropout:
        return
    if getattr(args, "rank", 0) == 0:
        print(f" megatron-eod: --attention-dropout {given} kept over the checkpoint's "
              f"{args.attention_dropout} (--use-checkpoint-args): EoD attention has no dropout",
              flush=True)
    args.attention_dropout = float(given)



def check_persistent_ckpt_worker(args, cuda_available: bool) -> None:
    """Megatron-LM's persistent checkpoint worker (--async-save --use-persistent-ckpt-worker)
    sets a CUDA device unconditionally: without CUDA the worker dies at the first save
    (ZeroDivisionError in its process) and the run waits for that save forever."""
    if cuda_available or not (getattr(args, "async_save", False)
                              and getattr(args, "use_persistent_ckpt_worker", False)):
        return
    raise FlagError("--use-persistent-ckpt-worker needs CUDA: Megatron-LM's worker sets a CUDA "
                    "device and, without one, dies at the first save while the run waits for "
                    "it; drop --use-persistent-ckpt-worker (Megatron-LM then saves "
                    "synchronously) or run on GPUs")



def check_decoupled_lr_checkpoints(args) -> None:
    """megatron-core 0.16's regular optimizer matches saved parameter groups to its own by
    (wd_mult, lr_mult, expert, decoupled) only: --decoupled-lr's group (the embedding and
    output layer) differs from the default group in its learning rate alone, one overwrites
    the other, and every --load of the run's own checkpoints stops with "loaded state dict
    contains a parameter group that doesn't match" (measured on CPU, both formats). Later
    megatron-cores (0.19.2) match by the learning rates too; the distributed optimizer loads
    by another path and resumes (one group's max/min LR in both, put right after the load:
    checkpoint_schedule.apply_schedule_choice)."""
    loads_optimizer = getattr(args, "load", None) and not (
        getattr(args, "no_load_optim", False) or getattr(args, "finetune", False))
    if getattr(args, "decoupled_lr", None) is None or args.use_distributed_optimizer or not (
            getattr(args, "save", None) or loads_optimizer):
        return
    keys = getattr(importlib.import_module("megatron.core.optimizer.optimizer"),
                   "param_group_identifier_keys", ())
    if "max_lr" in keys:
        return
    raise FlagError(f"--decoupled-lr {args.decoupled_lr} without --use-distributed-optimizer: "
                    f"this megatron-core's optimizer cannot load the checkpoints this run would "
                    f"write (its decoupled and default parameter groups differ only in their "
                    f"learning rate, which it does not compare: a ValueError at every --load); "
                    f"add --use-distributed-optimizer, or use megatron-core >= 0.19")

