"""`megatron_eod.training.args_optim`: Megatron's optimizer, LR-schedule, batch ramp-up and
checkpoint flags, what they derive, and every FlagError rule (through `parse_args`, CPU only,
no process groups)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_eod.training.args import FlagError, parse_args
from megatron_eod.training.flag_rules import rampup_as_step_schedule
from tests.training.test_args import MODEL, parse

BAD = [
    (["--train-samples", 40], 1, False, r"pass exactly one of --train-iters .* and "
     r"--train-samples"),
    (["--lr-decay-samples", 40], 1, False, r"--lr-decay-samples needs a --train-samples run; "
     r"this run counts in iters \(use --lr-decay-iters\)"),
    (["--lr-warmup-samples", 8], 1, False, r"--lr-warmup-samples needs a --train-samples run"),
    (["--global-batch-size", 4, "--rampup-batch-size", 2, 2, 10], 1, False,
     r"--rampup-batch-size needs a sample-based run: pass --train-samples"),
    (["--lr-warmup-fraction", 0.1, "--lr-warmup-iters", 2], 1, False,
     r"--lr-warmup-fraction and --lr-warmup-iters are exclusive"),
    (["--lr-decay-style", "WSD"], 1, False,
     r"--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", 20], 1, False,
     r"--lr-wsd-decay-iters 20 must be <= --lr-decay-iters 10"),
    (["--lr-warmup-init", 1.0], 1, False, r"--lr-warmup-init 1.0 must be in \[0, --lr 0.001\]"),
    (["--start-weight-decay", 0.1, "--end-weight-decay", 0.2], 1, False,
     r"--start-weight-decay 0.1 and --end-weight-decay 0.2 differ: pass "
     r"--weight-decay-incr-style linear or cosine"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"], 1, False,
     r"are exclusive"),
    (["--sgd-momentum", 1.0], 1, False, r"--sgd-momentum must be in \[0, 1\)"),
    (["--loss-scale", 0], 1, False, r"--loss-scale must be positive"),
    (["--hysteresis", 0], 1, False, r"--hysteresis >= 1"),
    (["--ddp-bucket-size", 10, "--ddp-num-buckets", 2], 1, False,
     r"--ddp-bucket-size and --ddp-num-buckets are exclusive"),
    (["--ddp-num-buckets", 0], 1, False, r"--ddp-num-buckets must be positive"),
    (["--overlap-param-gather"], 1, False,
     r"--overlap-param-gather needs --use-distributed-optimizer"),
    (["--finetune"], 1, False, r"--finetune needs --load DIR or --pretrained-checkpoint DIR"),
    (["--ckpt-format", "torch", "--use-distributed-optimizer", "--disable-gloo-process-groups"],
     1, False, r"--disable-gloo-process-groups with --use-distributed-optimizer --ckpt-format "
               r"torch: .* pass --ckpt-format torch_dist, or drop the flag"),
    (["--transformer-impl", "transformer_engine"], 1, False,
     r"--transformer-impl transformer_engine needs CUDA; pass --transformer-impl local"),
]


@pytest.mark.parametrize("extra,world_size,cuda,match", BAD)
def test_invalid_combinations(extra, world_size, cuda, match):
    with pytest.raises(FlagError, match=match):
        parse(*extra, world_size=world_size, cuda=cuda)


def parse_samples(*extra, world_size=1):
    """A sample-based run: MODEL without --train-iters."""
    model = MODEL[:MODEL.index("--train-iters")] + MODEL[MODEL.index("--train-iters") + 2:]
    return parse_args(model + ["--mock-data"] + [str(x) for x in extra], world_size=world_size,
                      cuda_available=False)


def test_megatron_optimizer_and_schedule_defaults():
    args = parse()
    assert (args.optimizer, args.initial_loss_scale, args.hysteresis) == ("adam", 2.0 ** 32, 2)
    assert args.loss_scale is None and args.loss_scale_window == 1000
    assert args.start_weight_decay == args.end_weight_decay == args.weight_decay == 0.01
    assert args.ckpt_format == "torch_dist" and not args.use_distributed_optimizer
    assert args.train_samples is None and args.lr_warmup_init == 0.0
    assert args.lr_wsd_decay_style == "exponential" and args.transformer_impl is None


def test_sample_based_runs_derive_their_iterations():
    args = parse_samples("--train-samples", 100, "--global-batch-size", 4)
    assert (args.train_iters, args.lr_decay_samples) == (25, 100)
    # Ramp 2 -> 4 (+2 after 8 samples): 2, 2, 2, 2, then 4 from sample 8: 4 + (100 - 12) // 4
    args = parse_samples("--train-samples", 100, "--global-batch-size", 4,
                         "--rampup-batch-size", 2, 2, 8)
    assert args.train_iters == 5 + 22


@pytest.mark.parametrize("extra,world_size,match", [
    (["--train-samples", 3, "--global-batch-size", 4], 1, r"--train-samples 3 is less than one "
     r"global batch \(4\)"),
    (["--train-samples", 40, "--lr-decay-iters", 5], 1, r"--lr-decay-iters needs a "
     r"--train-iters run; this run counts in samples"),
    (["--train-samples", 40, "--lr-warmup-iters", 2], 1, r"--lr-warmup-iters needs a "
     r"--train-iters run"),
    (["--train-samples", 40, "--global-batch-size", 8, "--rampup-batch-size", 2, 4, 10], 1,
     r"--rampup-batch-size start 2 must be below --global-batch-size 8 and reach it in steps "
     r"of 4"),
    (["--train-samples", 40, "--global-batch-size", 8, "--rampup-batch-size", 8, 2, 10], 1,
     r"start 8 must be below --global-batch-size 8"),
    (["--train-samples", 40, "--global-batch-size", 8, "--rampup-batch-size", 2, 2, 10], 4,
     r"--rampup-batch-size start 2 and increment 2 must be multiples of --micro-batch-size 1 x "
     r"data-parallel size 4"),
    (["--train-samples", 40, "--rampup-batch-size", 0, 1, 10], 1,
     r"start, increment and samples must be positive"),
    (["--train-samples", 40, "--global-batch-size", 4, "--rampup-batch-size", 2, 2, 0], 1,
     r"start, increment and samples must be positive"),
])
def test_sample_based_errors(extra, world_size, match):
    with pytest.raises(FlagError, match=match):
        parse_samples(*extra, world_size=world_size)


def test_decrease_batch_size_if_needed_relaxes_divisibility():
    args = parse("--global-batch-size", 6, "--micro-batch-size", 4,
                 "--decrease-batch-size-if-needed")
    assert args.num_micro_batches == 1


def _batch_at(schedule: str, consumed: int) -> int:
    """A step schedule's batch at `consumed` samples (megatron-core >= 0.18's rule: the batch
    of the last threshold reached)."""
    batch = None
    for entry in schedule.split():
        threshold, size = map(int, entry.split(":"))
        if consumed >= threshold:
            batch = size
    return batch


@settings(max_examples=300, deadline=None)
@given(start=st.integers(1, 64), increment=st.integers(1, 32), increments=st.integers(1, 40),
       samples=st.integers(1, 5000))
def test_rampup_as_a_step_schedule_is_megatron_cores_ramp(start, increment, increments,
                                                          samples):
    """megatron-core >= 0.18 ignores --rampup-batch-size; the step schedule the trainers use
    instead gives megatron-core <= 0.17's own ramp (RampupBatchsizeNumMicroBatchesCalculator)
    its batch at every consumed-sample count."""
    calculators = pytest.importorskip("megatron.core.num_microbatches_calculator")
    ramp_class = getattr(calculators, "RampupBatchsizeNumMicroBatchesCalculator", None)
    if ramp_class is None:
        pytest.skip("this megatron-core has no batch ramp-up of its own (>= 0.18)")
    gbs = start + increment * increments
    schedule = rampup_as_step_schedule(start, increment, samples, gbs)
    thresholds = [int(entry.split(":")[0]) for entry in schedule.split()]
    assert thresholds[0] == 0 and thresholds == sorted(set(thresholds))
    ramp = ramp_class(global_batch_size=gbs, micro_batch_size=1, data_parallel_size=1,
                      decrease_batch_size_if_needed=False, rank=1,
                      start_global_batch_size=start, batch_size_increment=increment,
                      ramup_samples=samples)
    for consumed in sorted({*range(0, min(samples, 400) + 3), *thresholds,
                            *(t - 1 for t in thresholds if t), samples, samples + 1}):
        ramp.update(consumed, consistency_check=False)
        assert _batch_at(schedule, consumed) == ramp.get_current_global_batch_size(), consumed
