"""Virtual pipeline stages in the lean trainer (--num-layers-per-virtual-pipeline-stage /
--num-virtual-stages-per-pipeline-rank, megatron-core's interleaved schedule), as Megatron-LM
runs them (16 of its 142 GPT functional-test configs):

- a PP=1 checkpoint continues at PP=2 x CP=2 with two chunks a rank, iteration for iteration
  the PP=1 run's (the same weights, another layer placement and schedule), and the chunked
  run's own checkpoint ("model0", "model1", as Megatron-LM's) continues at PP=1 the same way;
- a --ckpt-format torch checkpoint of other virtual stages is refused naming them;
- the flags' rules are Megatron-LM's, plus the micro-batch counts megatron-core's schedule
  would refuse mid-run (each step of a batch ramp), at start-up.
(Initial weights depend on the layer placement, as in Megatron-LM: runs are compared from a
common checkpoint.)"""

import json

import pytest

from megatron_eod.training.args import parse_args
from megatron_eod.training.cp_flags import FlagError
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks
from tests.training.test_nan_stop import _train

pytestmark = pytest.mark.timeout(300)

FOUR_LAYERS = ("--num-layers", "4")
VP = ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1")


def _run(world, data, *extra):
    results = run_ranks(_train, world, tiny_flags(data, *FOUR_LAYERS, *extra,
                                                  drop=("--num-layers",)),
                        daemon=False, timeout=240)
    assert [code for code, *_ in results] == [0] * world, results
    return results[-1][2], results[-1][1]  # the last rank holds the loss (last stage)


def _close(a, b, rel=1e-5):
    assert len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b)), (a, b)


def checkpoint_at_8(data, tmp_path):
    """The PP=1 run's 10 losses, and the folder of its checkpoint at iteration 8 (the
    latest there)."""
    start = str(tmp_path / "start")
    reference, _ = _run(1, data, "--save", start, "--save-interval", "8")  # at 8, 10
    with open(f"{start}/latest_checkpointed_iteration.txt", "w") as f:
        f.write("8")
    return reference, start


def test_chunks_continue_a_checkpoint_as_the_unchunked_run(tiny_data, tmp_path):
    chunked = str(tmp_path / "chunked")
    reference, start = checkpoint_at_8(tiny_data, tmp_path)
    losses, _ = _run(4, tiny_data, *VP, "--context-parallel-size", "2", "--load", start,
                     "--save", chunked, "--exit-interval", "9")
    back, _ = _run(1, tiny_data, "--load", chunked)
    assert len(reference) == 10 and len(losses) == len(back) == 1
    _close(losses + back, reference[8:])
    # TP=2 (with sequence parallelism): the second TP rank reads no data and holds no
    # iterators (the schedule still wants one per chunk; it stopped there); a validation at
    # iteration 9. Vocabulary padding 64 x TP keeps TP=1's 384 rows.
    tp, _ = _run(4, tiny_data, *VP, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                 "--make-vocab-size-divisible-by", "64", "--load", start, "--exit-interval",
                 "9", "--eval-interval", "9")
    _close(tp, reference[8:9])


def test_the_overlapped_warmup_and_flush_train_as_the_default_schedule(tiny_data, tmp_path):
    """--overlap-p2p-communication-warmup-flush (a Megatron-LM functional-test config: PP=4,
    two chunks, groups of 5 of 10 micro-batches) on gloo: megatron-core frees the warmup's
    last output twice while its send is pending, and drops the last forward send of a
    forward-only pass unwaited. The CPU stand-ins freed the memory the send still read (NaN
    losses, different each run) and let gloo cancel the dropped send (the next stage waited
    forever at the first evaluation); both trainers ran into them."""
    layout = ("--num-layers", "8", "--pipeline-model-parallel-size", "4",
              "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1",
              "--global-batch-size", "10", "--microbatch-group-size-per-virtual-pipeline-stage",
              "5", "--train-iters", "3", "--eval-interval", "2", "--lr-decay-iters", "10")
    records = []
    for name, flags in (("default", ()), ("flush", ("--overlap-p2p-communication-warmup-flush",))):
        metrics = tmp_path / f"{name}.jsonl"
        results = run_ranks(_train, 4, tiny_flags(tiny_data, *layout, *flags, "--metrics-file",
                                                  str(metrics), drop=("--num-layers",)),
                            daemon=False, timeout=120)
        assert [code for code, *_ in results] == [0] * 4, results
        records.append([(r.get("kind"), r["iteration"], r["lm_loss"], r.get("grad_norm"))
                        for r in map(json.loads, metrics.read_text().splitlines())])
    assert records[0] == records[1] and len(records[0]) == 3 + 3  # 2 validations and a test


def test_a_torch_checkpoint_of_other_virtual_stages_is_refused(tiny_data, tmp_path):
    save = str(tmp_path / "ckpt")
    _run(2, tiny_data, *VP, "--ckpt-format", "torch", "--save", save, "--exit-interval", "2")
    results = run_ranks(_train, 2, tiny_flags(tiny_data, *FOUR_LAYERS, "--pipeline-model-parallel-size",
                                              "2", "--load", save, drop=("--num-layers",)),
                        daemon=False, timeout=240)
    assert [code for code, *_ in results] == [2, 2], results
    assert "holds the model chunks ['model0', 'model1'], this run has ['model']" in results[0][1]


_BASE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128", "--lr", "1e-3", "--train-iters", "10", "--mock-data"]


def _parse(*flags, world_size=4):
    base = _BASE[:-3] + _BASE[-1:] if "--train-samples" in flags else _BASE  # sample-based
    return parse_args(base + list(flags), world_size=world_size, cuda_available=False)


def test_virtual_stages_from_either_flag():
    by_layers = _parse("--pipeline-model-parallel-size", "2",
                       "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "4")
    by_count = _parse("--pipeline-model-parallel-size", "2",
                      "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "4")
    for args in (by_layers, by_count):
        assert args.virtual_pipeline_model_parallel_size == 2
        assert args.microbatch_group_size_per_vp_stage == 2 and args.overlap_p2p_comm
    one = _parse("--pipeline-model-parallel-size", "2",
                 "--num-layers-per-virtual-pipeline-stage", "4")
    assert one.virtual_pipeline_model_parallel_size is None and not one.overlap_p2p_comm


@pytest.mark.parametrize("flags,match", [
    (["--num-layers-per-virtual-pipeline-stage", "1", "--num-virtual-stages-per-pipeline-rank",
      "2"], r"are exclusive"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     r"--num-layers 8 / --pipeline-model-parallel-size 2 must be a multiple of "
     r"--num-layers-per-virtual-pipeline-stage 3"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3"],
     r"--num-layers 8 must be divisible by --pipeline-model-parallel-size x "
     r"--num-virtual-stages-per-pipeline-rank = 2 x 3"),
    (["--num-layers-per-virtual-pipeline-stage", "2"],
     r"virtual pipeline stages need --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
      "--no-overlap-p2p-communication"], r"and > 2 with --no-overlap-p2p-communication"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
      "--microbatch-group-size-per-virtual-pipeline-stage", "1"],
     r"--microbatch-group-size-per-virtual-pipeline-stage 1 must be >= "
     r"--pipeline-model-parallel-size 2"),
    (["--microbatch-group-size-per-virtual-pipeline-stage", "2"], r"needs virtual pipeline "),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     r"virtual pipeline stages: 1 micro-batches a step \(batch 2 / --micro-batch-size 1 x "
     r"data-parallel size 2\) do not fit --microbatch-group-size-per-virtual-pipeline-stage 2"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
      "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "100", "--train-samples",
      "1000"],
     r"virtual pipeline stages: 1 micro-batches a step \(batch 2 "),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--recompute-granularity", "full", "--recompute-num-layers", "2"],
     r"--recompute-num-layers 2 must be in \[1, --num-layers / --pipeline-model-parallel-size "
     r"/ virtual stages = 1\]"),
])
def test_rules(flags, match):
    with pytest.raises(FlagError, match=match):
        _parse(*flags)
