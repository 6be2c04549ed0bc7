"""Megatron's optimizer, LR-schedule, batch ramp-up and checkpoint flags for the lean trainer.

One job: declare these flags with Megatron-LM's spellings, dests and defaults, fill what
Megatron derives from them (start/end weight decay, decay lengths, train iterations of a
sample-based run, the batch ramp-up's micro-batch counts) and refuse every combination
Megatron-LM refuses, with a FlagError naming the flags. args.py calls the `add_*` functions
when it builds its parser and `check_*` when it validates.

What it does not do: no Muon, no CPU offload, no decoupled LR, no async or local checkpoints.
"""

from __future__ import annotations

import argparse
import importlib
import inspect

from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.flag_rules import check_global_batch

__all__ = ["add_optimizer_args", "add_schedule_args", "add_checkpoint_args",
           "check_optimizer", "check_schedule", "check_checkpoint", "check_batch_sizes",
           "train_iters_for_samples", "ramp_as_step_schedule", "rampup_as_step_schedule",
           "ramps_by_step_schedule"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise FlagError(message)


def add_optimizer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer (megatron-core's get_megatron_optimizer)")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    for flag, default in (("--min-lr", 0.0), ("--weight-decay", 0.01), ("--clip-grad", 1.0),
                          ("--adam-beta1", 0.9), ("--adam-beta2", 0.999), ("--adam-eps", 1e-8),
                          ("--sgd-momentum", 0.9), ("--start-weight-decay", None),
                          ("--end-weight-decay", None), ("--loss-scale", None),
                          ("--initial-loss-scale", 2.0 ** 32), ("--min-loss-scale", 1.0),
                          ("--loss-scale-window", 1000.0)):
        g.add_argument(flag, type=float, default=default)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--weight-decay-incr-style", choices=("constant", "linear", "cosine"),
                   default="constant")
    for flag in ("--use-distributed-optimizer", "--overlap-grad-reduce",
                 "--overlap-param-gather"):
        g.add_argument(flag, action="store_true")
    g.add_argument("--no-align-grad-reduce", action="store_false", dest="align_grad_reduce",
                   help="with PP: each stage starts its gradient reduce when ready instead of "
                        "all together")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="gradient bucket elements with --overlap-grad-reduce (default: "
                        "max(40M, 1M x DP x CP))")
    g.add_argument("--ddp-num-buckets", type=int, default=None)


def add_schedule_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run length, LR schedule and batch ramp-up (in samples or iters)")
    for flag in ("--train-iters", "--train-samples", "--lr-decay-iters", "--lr-decay-samples",
                 "--lr-wsd-decay-iters", "--lr-wsd-decay-samples"):
        g.add_argument(flag, type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=("exponential", "linear", "cosine", "minus_sqrt"))
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   action="store_true", dest="override_opt_param_scheduler")
    g.add_argument("--use-checkpoint-opt_param-scheduler",
                   "--use-checkpoint-opt-param-scheduler", action="store_true",
                   dest="use_checkpoint_opt_param_scheduler")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"))
    g.add_argument("--decrease-batch-size-if-needed", action="store_true")


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoint format (megatron-core dist_checkpointing)")
    g.add_argument("--ckpt-format", choices=("torch_dist", "torch"), default="torch_dist",
                   help="torch_dist: sharded, reshards on --load, Megatron-LM's format; torch: "
                        "one file per TP/PP rank, no resharding (both load either way)")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="accepted for Megatron-LM scripts: --load always detects the format")
    g.add_argument("--use-dist-ckpt", action="store_true", dest="use_dist_ckpt_deprecated",
                   help="accepted for Megatron-LM scripts: deprecated there, no effect "
                        "(--ckpt-format says the format)")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="with --use-distributed-optimizer: save its state so that a --load at "
                        "another TP/PP size can read it (default: DP/CP changes only)")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected",
                   choices=("assume_ok_unexpected", "log_unexpected", "log_all",
                            "raise_unexpected", "raise_all", "return_unexpected", "return_all",
                            "ignore_all"),
                   help="what a torch_dist --load does with keys missing from the checkpoint "
                        "or unexpected in it (megatron-core's StrictHandling, as Megatron-LM; "
                        "with log_all, return_all and ignore_all missing weights keep their "
                        "initial values)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="stop (exit 2) when --load holds no checkpoint, instead of training "
                        "from scratch (Megatron-LM's exits with status 0)")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="weights to start from when --load has no checkpoint (as --finetune)")
    for flag in ("--finetune", "--no-save-optim", "--no-save-rng", "--no-load-optim",
                 "--no-load-rng"):
        g.add_argument(flag, action="store_true")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="the model's flags from the checkpoint's saved args (--load's, else "
                        "--pretrained-checkpoint's): sizes the flags leave out, architecture "
                        "switches always, as Megatron-LM")
    g.add_argument("--use-mp-args-from-checkpoint-args", action="store_true",
                   help="with --use-checkpoint-args: the TP/PP sizes too")
    g.add_argument("--no-use-tokenizer-model-from-checkpoint-args",
                   "--disable-use-tokenizer-model-from-checkpoint-args", action="store_false",
                   dest="use_tokenizer_model_from_checkpoint_args",
                   help="with --use-checkpoint-args: keep the flags' --tokenizer-type/-model")


def check_optimizer(args) -> None:
    for dest in ("start_weight_decay", "end_weight_decay"):
        if getattr(args, dest) is None:
            setattr(args, dest, args.weight_decay)
    for dest in ("weight_decay", "start_weight_decay", "end_weight_decay", "clip_grad"):
        _require(getattr(args, dest) >= 0,
                 f"--{dest.replace('_', '-')} must be >= 0, got {getattr(args, dest)}")
    _require(args.weight_decay_incr_style != "constant"
             or args.start_weight_decay == args.end_weight_decay,
             f"--start-weight-decay {args.start_weight_decay} and --end-weight-decay "
             f"{args.end_weight_decay} differ: pass --weight-decay-incr-style linear or cosine")
    _require(args.end_weight_decay >= args.start_weight_decay,
             f"--end-weight-decay {args.end_weight_decay} must be >= --start-weight-decay "
             f"{args.start_weight_decay} (megatron-core's schedule only increases it)")
    for dest in ("adam_beta1", "adam_beta2"):
        _require(0.0 <= getattr(args, dest) < 1.0,
                 f"--{dest.replace('_', '-')} must be in [0, 1), got {getattr(args, dest)}")
    _require(args.adam_eps > 0, f"--adam-eps must be positive, got {args.adam_eps}")
    _require(0.0 <= args.sgd_momentum < 1.0,
             f"--sgd-momentum must be in [0, 1), got {args.sgd_momentum}")
    _require(args.loss_scale is None or args.loss_scale > 0,
             f"--loss-scale must be positive, got {args.loss_scale}")
    _require(args.initial_loss_scale > 0 and args.min_loss_scale > 0
             and args.loss_scale_window > 0 and args.hysteresis >= 1,
             "--initial-loss-scale, --min-loss-scale, --loss-scale-window must be positive and "
             "--hysteresis >= 1")
    _require(args.ddp_bucket_size is None or args.ddp_num_buckets is None,
             "--ddp-bucket-size and --ddp-num-buckets are exclusive; pass one")
    for dest in ("ddp_bucket_size", "ddp_num_buckets"):
        value = getattr(args, dest)
        _require(value is None or value > 0,
                 f"--{dest.replace('_', '-')} must be positive, got {value}")
    if args.fp16 and args.loss_scale is None:
        # As Megatron-LM: with dynamic loss scaling an overflow is the scaler's signal (the
        # step is skipped and the scale lowered), not a reason to stop.
        args.check_for_nan_in_loss_and_grad = False
    _require(not args.overlap_param_gather or args.use_distributed_optimizer,
             "--overlap-param-gather needs --use-distributed-optimizer (it overlaps the "
             "distributed optimizer's parameter all-gather)")


def train_iters_for_samples(train_samples: int, global_batch_size: int, rampup) -> int:
    """Iterations a sample-based run takes (Megatron's rule): during the ramp-up each iteration
    consumes the ramped batch, after it the full --global-batch-size; a last incomplete batch
    is dropped."""
    if rampup is None:
        return train_samples // global_batch_size
    start, increment, ramp_samples = rampup
    per_increment = ramp_samples / ((global_batch_size - start) // increment)
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        batch = global_batch_size if consumed > ramp_samples else \
            start + int(consumed / per_increment) * increment
        consumed += batch
        iterations += 1
    return iterations + max(0, train_samples - consumed) // global_batch_size


def check_schedule(args) -> None:
    """Run length and LR schedule (after the batch sizes are known)."""
    _require((args.train_iters is None) != (args.train_samples is None),
             "pass exactly one of --train-iters (iteration-based run) and --train-samples "
             "(sample-based run)")
    for dest in ("train_iters", "train_samples", "lr_decay_iters", "lr_decay_samples",
                 "lr_wsd_decay_iters", "lr_wsd_decay_samples"):
        value = getattr(args, dest)
        _require(value is None or value > 0,
                 f"--{dest.replace('_', '-')} must be positive, got {value}")
    _require(args.lr > 0, f"--lr must be positive, got {args.lr}")
    _require(0.0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must be in [0, --lr "
                                            f"{args.lr}]")
    _require(0.0 <= args.lr_warmup_init <= args.lr,
             f"--lr-warmup-init {args.lr_warmup_init} must be in [0, --lr {args.lr}]")
    _require(args.lr_warmup_fraction is None or 0.0 <= args.lr_warmup_fraction < 1.0,
             f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction} (the "
             f"warmup must end before the decay does)")
    unit, other = ("iters", "samples") if args.train_iters is not None else ("samples", "iters")
    for name in ("lr_decay", "lr_wsd_decay"):
        _require(getattr(args, f"{name}_{other}") is None,
                 f"--{name.replace('_', '-')}-{other} needs a --train-{other} run; this run "
                 f"counts in {unit} (use --{name.replace('_', '-')}-{unit})")
    _require(getattr(args, f"lr_warmup_{other}") == 0,
             f"--lr-warmup-{other} needs a --train-{other} run; this run counts in {unit} "
             f"(use --lr-warmup-{unit})")
    _require(args.lr_warmup_fraction is None or getattr(args, f"lr_warmup_{unit}") == 0,
             f"--lr-warmup-fraction and --lr-warmup-{unit} are exclusive; pass one")
    _require(args.rampup_batch_size is None or args.train_samples is not None,
             "--rampup-batch-size needs a sample-based run: pass --train-samples instead of "
             "--train-iters (as Megatron-LM)")
    if args.train_samples is not None:
        args.train_iters = train_iters_for_samples(args.train_samples, args.global_batch_size,
                                                   args.rampup_batch_size)
        _require(args.train_iters > 0, f"--train-samples {args.train_samples} is less than one "
                                       f"global batch ({args.global_batch_size})")
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
    elif args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    decay = getattr(args, f"lr_decay_{unit}")
    warmup = getattr(args, f"lr_warmup_{unit}")
    _require(0 <= warmup < decay, f"--lr-warmup-{unit} {warmup} must be in [0, "
                                  f"--lr-decay-{unit} {decay}) (the warmup must end before "
                                  f"the decay does)")
    wsd = getattr(args, f"lr_wsd_decay_{unit}")
    _require(args.lr_decay_style != "WSD" or wsd is not None,
             f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} (the length of its annealing "
             f"phase)")
    _require(wsd is None or wsd <= decay,
             f"--lr-wsd-decay-{unit} {wsd} must be <= --lr-decay-{unit} {decay}")
    _require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
             "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
             "exclusive; pass one")


def check_batch_sizes(args) -> None:
    """--global-batch-size, --rampup-batch-size and the micro-batch count (Megatron's rules)."""
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    _require(mbs > 0, f"--micro-batch-size must be positive, got {mbs}")
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    _require(gbs > 0, f"--global-batch-size must be positive, got {gbs}")
    unit = mbs * dp
    check_global_batch(args)
    args.num_micro_batches = max(1, gbs // unit)  # at the full batch size
    if args.rampup_batch_size is None:
        return
    start, increment, samples = args.rampup_batch_size
    _require(start > 0 and increment > 0 and samples > 0,
             f"--rampup-batch-size {start} {increment} {samples}: start, increment and "
             f"samples must be positive")
    _require(start < gbs and (gbs - start) % increment == 0,
             f"--rampup-batch-size start {start} must be below --global-batch-size {gbs} and "
             f"reach it in steps of {increment}")
    _require(args.decrease_batch_size_if_needed or (start % unit == 0 and increment % unit == 0),
             f"--rampup-batch-size start {start} and increment {increment} must be multiples of "
             f"--micro-batch-size {mbs} x data-parallel size {dp} (or pass "
             f"--decrease-batch-size-if-needed)")
    ramp_as_step_schedule(args)  # its rules, where megatron-core needs the ramp so


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
    _require(not getattr(args, "step_batch_size_schedule", None),
             f"{given}: this megatron-core ignores it beside --step-batch-size-schedule; drop "
             f"one of them")
    _require(not args.decrease_batch_size_if_needed,
             f"{given} with --decrease-batch-size-if-needed: this megatron-core ramps only by "
             f"a step schedule, which cannot decrease the batch; drop one of them")
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


def check_checkpoint(args) -> None:
    _require(not (args.use_distributed_optimizer and args.ckpt_format == "torch"
                  and getattr(args, "disable_gloo_process_groups", False)),
             "--disable-gloo-process-groups with --use-distributed-optimizer --ckpt-format "
             "torch: that state is gathered over gloo groups (Megatron-LM refuses it too); "
             "pass --ckpt-format torch_dist, or drop the flag")
    _require(not (args.finetune and args.load is None and args.pretrained_checkpoint is None),
             "--finetune needs --load DIR or --pretrained-checkpoint DIR")
    _require(not args.exit_on_missing_checkpoint or args.load is not None
             or args.pretrained_checkpoint is not None,
             "--exit-on-missing-checkpoint needs --load DIR (or --pretrained-checkpoint DIR)")
