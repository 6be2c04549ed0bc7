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

import pytest

from tests.functional.test_cpu_training import assert_same, cp1, train  # noqa: F401
from tests.functional.tiny_gpt import ITERS

pytestmark = pytest.mark.timeout(300)


def run(tmp_path, name, world, data, *extra, drop=()):
    """-> (losses, training records) of a tiny run with a --metrics-file."""
    metrics = tmp_path / f"{name}.jsonl"
    losses = train(world, data, *extra, "--metrics-file", str(metrics), drop=drop)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return losses, [r for r in records if "kind" not in r]


def test_distributed_optimizer_with_overlap_equals_cp1(cp1, tiny_data):  # noqa: F811
    losses = train(4, tiny_data, "--context-parallel-size", "2", "--use-distributed-optimizer",
                   "--overlap-grad-reduce", "--overlap-param-gather")
    assert_same(losses, cp1)


def test_sgd_is_not_adam(cp1, tiny_data):  # noqa: F811
    losses = train(1, tiny_data, "--optimizer", "sgd", "--sgd-momentum", "0.5")
    assert losses[0] == pytest.approx(cp1[0], rel=1e-6)  # the same model before any step
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[-1] - cp1[-1]) > 1e-3


SAMPLES = ["--train-samples", "40", "--lr-decay-samples", "40"]
ITER_BASED = ("--train-iters", "--lr-warmup-iters")  # tiny_flags: 10 iters, warmup 2


def test_sample_based_run_is_the_iteration_based_run(cp1, tiny_data, tmp_path):  # noqa: F811
    losses = train(1, tiny_data, *SAMPLES, "--lr-warmup-samples", "8", drop=ITER_BASED)
    assert losses == cp1


def test_rampup_batch_size_ramps_the_global_batch(tiny_data, tmp_path):
    # Start at 2, +2 per 8 ramp samples, up to 4: 2, 2, 2, 2 (8 samples), then 4 up to 40.
    _, records = run(tmp_path, "ramp", 1, tiny_data, *SAMPLES, "--rampup-batch-size", "2",
                     "2", "8", drop=ITER_BASED)
    batches = [r["tokens"] // 128 for r in records]
    assert batches == [2, 2, 2, 2] + [4] * 8 and sum(batches) == 40


def test_wsd_holds_then_anneals(tiny_data, tmp_path):
    _, records = run(tmp_path, "wsd", 1, tiny_data, *SAMPLES, "--lr-warmup-samples", "8",
                     "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "16",
                     "--lr-wsd-decay-style", "linear",
                     drop=ITER_BASED + ("--lr-decay-style",))
    lrs = [r["lr"] for r in records]  # iteration i runs at sample 4 * (i - 1)
    assert lrs[0] == 0 and lrs[1] == pytest.approx(1e-3)  # warmup over 8 samples
    assert lrs[2:7] == [pytest.approx(2e-3)] * 5  # samples 8..24: held at --lr
    # samples 28, 32, 36 of the 16-sample anneal from --lr to --min-lr (linear)
    assert lrs[7:] == [pytest.approx(2e-4 + (2e-3 - 2e-4) * (1 - k / 16)) for k in (4, 8, 12)]


def test_inverse_square_root_decay(tiny_data, tmp_path):
    _, records = run(tmp_path, "isqrt", 1, tiny_data, "--lr-decay-style",
                     "inverse-square-root", "--min-lr", "0",
                     drop=("--lr-decay-style", "--min-lr"))
    lrs = [r["lr"] for r in records]
    warmup = 2 * 4  # samples
    for i, lr in enumerate(lrs[3:], start=3):
        assert lr == pytest.approx(2e-3 * math.sqrt(warmup / (4 * i)))
    assert len(lrs) == ITERS
