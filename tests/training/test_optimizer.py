"""The lean trainer's optimizer, LR schedule and batch ramp-up are megatron-core's, driven by
Megatron's flags, and each flag changes what it should:

- the distributed optimizer (ZeRO-1) with grad-reduce and param-gather overlap at DP=2 x CP=2
  gives the CP=1 per-iteration losses (1e-5);
- --optimizer sgd trains differently from Adam;
- a sample-based run (--train-samples, --lr-warmup-samples) is the iteration-based run;
- --rampup-batch-size ramps the global batch (Megatron's rule), --lr-decay-style WSD holds the
  LR then anneals it in its last --lr-wsd-decay-samples, inverse-square-root decays it as
  max_lr * sqrt(warmup / step).
"""

import json
import math
import os

import pytest

from tests.functional.test_cpu_training import assert_same, cp1, train  # noqa: F401
from tests.functional.tiny_gpt import ITERS
from tests.training.test_checkpoint_formats import refused

pytestmark = pytest.mark.timeout(300)


def run(tmp_path, name, world, data, *extra, drop=()):
    """-> (losses, training records) of a tiny run with a --metrics-file."""
    metrics = tmp_path / f"{name}.jsonl"
    losses = train(world, data, *extra, "--metrics-file", str(metrics), drop=drop)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return losses, [r for r in records if "kind" not in r]


@pytest.mark.parametrize("buckets", [[], ["--ddp-bucket-size", "20000"]],
                         ids=["one-bucket", "several-buckets"])
def test_distributed_optimizer_with_overlap_equals_cp1(cp1, short_docs_data, buckets):  # noqa: F811
    losses = train(4, short_docs_data, "--context-parallel-size", "2",
                   "--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--overlap-param-gather", *buckets)
    assert_same(losses, cp1)


def test_sgd_is_not_adam(cp1, short_docs_data):  # noqa: F811
    losses = train(1, short_docs_data, "--optimizer", "sgd", "--sgd-momentum", "0.5")
    assert losses[0] == pytest.approx(cp1[0], rel=1e-6)  # the same model before any step
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[-1] - cp1[-1]) > 1e-3


SAMPLES = ["--train-samples", "40", "--lr-decay-samples", "40"]
ITER_BASED = ("--train-iters", "--lr-warmup-iters")  # tiny_flags: 10 iters, warmup 2


def test_sample_based_run_is_the_iteration_based_run(cp1, short_docs_data, tmp_path):  # noqa: F811
    losses = train(1, short_docs_data, *SAMPLES, "--lr-warmup-samples", "8", drop=ITER_BASED)
    assert losses == cp1


def test_rampup_batch_size_ramps_the_global_batch(short_docs_data, tmp_path):
    # Start at 2, +2 per 8 ramp samples, up to 4: 2, 2, 2, 2 (8 samples), then 4 up to 40.
    _, records = run(tmp_path, "ramp", 1, short_docs_data, *SAMPLES, "--rampup-batch-size", "2",
                     "2", "8", drop=ITER_BASED)
    batches = [r["tokens"] // 128 for r in records]
    assert batches == [2, 2, 2, 2] + [4] * 8 and sum(batches) == 40
    # As Megatron-LM: a checkpoint when the micro-batch count changes (1 -> 2, after 4).
    save = str(tmp_path / "ckpt")
    train(1, short_docs_data, *SAMPLES, "--rampup-batch-size", "2", "2", "8", "--save", save,
          drop=ITER_BASED)
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == [
        "iter_0000004", "iter_0000012"]


def test_wsd_holds_then_anneals(short_docs_data, tmp_path):
    _, records = run(tmp_path, "wsd", 1, short_docs_data, *SAMPLES, "--lr-warmup-samples", "8",
                     "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "16",
                     "--lr-wsd-decay-style", "linear",
                     drop=ITER_BASED + ("--lr-decay-style",))
    lrs = [r["lr"] for r in records]  # iteration i runs at sample 4 * (i - 1)
    assert lrs[0] == 0 and lrs[1] == pytest.approx(1e-3)  # warmup over 8 samples
    assert lrs[2:7] == [pytest.approx(2e-3)] * 5  # samples 8..24: held at --lr
    # samples 28, 32, 36 of the 16-sample anneal from --lr to --min-lr (linear)
    assert lrs[7:] == [pytest.approx(2e-4 + (2e-3 - 2e-4) * (1 - k / 16)) for k in (4, 8, 12)]


def test_inverse_square_root_decay(short_docs_data, tmp_path):
    _, records = run(tmp_path, "isqrt", 1, short_docs_data, "--lr-decay-style",
                     "inverse-square-root", "--min-lr", "0",
                     drop=("--lr-decay-style", "--min-lr"))
    lrs = [r["lr"] for r in records]
    warmup = 2 * 4  # samples
    for i, lr in enumerate(lrs[3:], start=3):
        assert lr == pytest.approx(2e-3 * math.sqrt(warmup / (4 * i)))
    assert len(lrs) == ITERS


def test_scaler_and_optimizer_flags_reach_megatron_core():
    """fp16 needs a GPU to run; its grad-scaler flags must still land in the OptimizerConfig
    megatron-core builds the scaler from (Megatron-LM's field mapping)."""
    from megatron_eod.training.args import parse_args
    from megatron_eod.training.optimizer import optimizer_config

    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "128", "--train-iters", "10", "--lr", "1e-3",
                       "--mock-data", "--fp16", "--initial-loss-scale", "65536",
                       "--min-loss-scale", "2", "--loss-scale-window", "50", "--hysteresis",
                       "4", "--use-distributed-optimizer", "--overlap-param-gather",
                       "--adam-beta2", "0.95", "--clip-grad", "0.5"],
                      world_size=1, cuda_available=True)
    config = optimizer_config(args)
    assert (config.fp16, config.initial_loss_scale, config.min_loss_scale) == (True, 65536, 2)
    assert (config.loss_scale_window, config.hysteresis, config.loss_scale) == (50, 4, None)
    assert config.use_distributed_optimizer and config.overlap_param_gather
    assert (config.adam_beta2, config.clip_grad, config.optimizer) == (0.95, 0.5, "adam")
    sgd = optimizer_config(parse_args(["--num-layers", "2", "--hidden-size", "64",
                                       "--num-attention-heads", "4", "--seq-length", "128",
                                       "--train-iters", "10", "--lr", "1e-3", "--mock-data",
                                       "--optimizer", "sgd", "--sgd-momentum", "0.5"],
                                      world_size=1, cuda_available=False))
    assert (sgd.optimizer, sgd.sgd_momentum) == ("sgd", 0.5)


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]],
                         ids=["regular", "distributed"])
def test_resuming_with_another_lr_needs_a_scheduler_choice(short_docs_data, tmp_path, optimizer):
    """Megatron's rule: the checkpoint's schedule and the flags must agree, unless
    --override-opt_param-scheduler (the flags win) or --use-checkpoint-opt_param-scheduler
    (the checkpoint wins); with megatron-core 0.19 too, whose optimizer pairs saved param
    groups by their max/min LR (a new --lr found none)."""
    save = str(tmp_path / "ckpt")
    train(1, short_docs_data, "--save", save, "--exit-interval", "4", *optimizer)
    said = refused(1, short_docs_data, "--load", save, "--lr", "1e-3", *optimizer)
    assert ("schedule differs from the checkpoint's: --lr: 0.001 here, 0.002 in the checkpoint; "
            "pass --override-opt_param-scheduler to follow the flags, or "
            "--use-checkpoint-opt_param-scheduler") in said  # was megatron-core's traceback
    assert "--lr-decay-iters/-samples (default: --train-iters/-samples): 80 (in samples) here, " \
           "40 in the checkpoint" in refused(1, short_docs_data, "--load", save,
                                              "--lr-decay-iters", "20", *optimizer)
    _, flags_win = run(tmp_path, "override", 1, short_docs_data, "--load", save, "--lr", "1e-3",
                       "--override-opt_param-scheduler", *optimizer, drop=("--lr",))
    _, ckpt_wins = run(tmp_path, "checkpoint", 1, short_docs_data, "--load", save, "--lr", "1e-3",
                       "--use-checkpoint-opt_param-scheduler", *optimizer, drop=("--lr",))
    assert flags_win[0]["iteration"] == ckpt_wins[0]["iteration"] == 5
    assert flags_win[0]["lr"] < 1e-3 < ckpt_wins[0]["lr"] <= 2e-3


def test_no_save_optim_resumes_with_a_fresh_optimizer(short_docs_data, tmp_path):
    """Only when asked: a plain resume of a checkpoint without its optimizer state is refused
    (it restarted Adam and the LR warm-up silently; Megatron-LM refuses it too)."""
    save, full = str(tmp_path / "ckpt"), None
    first = train(1, short_docs_data, "--save", save, "--exit-interval", "4", "--no-save-optim")
    line = refused(1, short_docs_data, "--load", save)
    assert line == (f"pretrain_gpt.py: error: --load {save}: iteration 4 was saved without its "
                    f"optimizer state (--no-save-optim), and resuming it would restart the "
                    f"optimizer and the learning-rate schedule: pass --no-load-optim to resume "
                    f"its weights with a fresh optimizer and schedule, or --finetune to start "
                    f"from iteration 0")
    rest = train(1, short_docs_data, "--load", save, "--no-load-optim")
    full = train(1, short_docs_data)
    assert first == full[:4] and len(rest) == 6
    assert rest[0] == pytest.approx(full[4], rel=1e-6)  # same weights and data ...
    assert rest[1] != pytest.approx(full[5], rel=1e-4)  # ... then Adam restarts from zero


def _parsed(*extra, cuda=False):
    from megatron_eod.training.args import parse_args

    return parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "128", "--train-iters", "10", "--lr", "1e-3",
                       "--mock-data", *extra], world_size=1, cuda_available=cuda)


def test_ddp_bucket_flags():
    from megatron_eod.training.model import ddp_config

    assert ddp_config(_parsed(), 1000).bucket_size is None  # no overlap: one bucket
    assert ddp_config(_parsed("--overlap-grad-reduce", "--ddp-bucket-size", "300"),
                      1000).bucket_size == 300
    assert ddp_config(_parsed("--overlap-grad-reduce", "--ddp-num-buckets", "4"),
                      1000).bucket_size == 250
    assert not _parsed("--no-align-grad-reduce").align_grad_reduce


def test_fp16_dynamic_loss_scaling_turns_the_nan_stop_off():
    """As Megatron-LM: with a dynamic scale, an overflow skips the step; a fixed
    --loss-scale keeps the stop."""
    assert not _parsed("--fp16", cuda=True).check_for_nan_in_loss_and_grad
    assert _parsed("--fp16", "--loss-scale", "1024", cuda=True).check_for_nan_in_loss_and_grad
    assert _parsed("--bf16", cuda=True).check_for_nan_in_loss_and_grad
