"""Uneven pipeline stages in the lean trainer (--decoder-first-pipeline-num-layers,
--decoder-last-pipeline-num-layers, --account-for-embedding-in-pipeline-split,
--account-for-loss-in-pipeline-split), as Megatron-LM and megatron-core split the layers:

- a PP=1 checkpoint continues at PP=2 x CP=2 with 1 + 3 layers, and at PP=3 with the
  embedding and the loss each taking a layer's place (1 + 2 + 1 layers), iteration for
  iteration the PP=1 run's; the uneven run's own checkpoint continues at PP=1 the same way;
- a --ckpt-format torch checkpoint of another split is refused naming it;
- the split's rules (Megatron-LM's and megatron-core's) at start-up, one line naming the flags.
(Before, all four flags were refused as a feature the lean trainer lacks.)"""

import glob

import pytest
import torch

from megatron_eod.training.args import parse_args
from megatron_eod.training.cp_flags import FlagError
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks
from tests.training.test_nan_stop import _train
from tests.training.test_virtual_pipeline import _close, _run, checkpoint_at_8

pytestmark = pytest.mark.timeout(300)

FIRST_1 = ("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1")


def test_uneven_stages_continue_a_checkpoint_as_the_even_run(tiny_data, tmp_path):
    uneven = str(tmp_path / "uneven")
    reference, start = checkpoint_at_8(tiny_data, tmp_path)
    losses, _ = _run(4, tiny_data, *FIRST_1, "--context-parallel-size", "2", "--load", start,
                     "--save", uneven, "--exit-interval", "9")
    back, _ = _run(1, tiny_data, "--load", uneven)
    ends, _ = _run(3, tiny_data, "--pipeline-model-parallel-size", "3",
                   "--account-for-embedding-in-pipeline-split",
                   "--account-for-loss-in-pipeline-split", "--load", start, "--exit-interval", "9")
    assert len(reference) == 10 and len(losses) == len(back) == len(ends) == 1
    _close(losses + back, reference[8:])
    _close(ends, reference[8:9])


def test_a_torch_checkpoint_of_another_split_is_refused(tiny_data, tmp_path):
    save = str(tmp_path / "ckpt")
    _run(2, tiny_data, *FIRST_1, "--ckpt-format", "torch", "--save", save, "--exit-interval", "2")
    built = []  # each stage's own file: the layers it built
    for stage in ("000", "001"):
        state = torch.load(glob.glob(f"{save}/iter_0000002/mp_rank_00_{stage}/*.pt")[0],
                           map_location="cpu", weights_only=False)["model"]
        built.append(len({key.split(".")[2] for key in state if key.startswith("decoder.layers.")}))
    assert built == [1, 3]
    results = run_ranks(_train, 2, tiny_flags(tiny_data, "--num-layers", "4",
                                              "--pipeline-model-parallel-size", "2", "--load",
                                              save, drop=("--num-layers",)),
                        daemon=False, timeout=240)
    assert [code for code, *_ in results] == [2, 2], results
    assert "saved with [1, 3] layers on the pipeline stages loads only with that split " \
           "(this run: [2, 2]" in results[0][1]


_BASE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128", "--lr", "1e-3", "--train-iters", "10", "--mock-data",
         "--global-batch-size", "16"]


def _layers(*flags, world_size=4):
    return parse_args(_BASE + list(flags), world_size=world_size,
                      cuda_available=False).pipeline_stage_layers


@pytest.mark.parametrize("flags, layers", [
    ((), [8]),
    (("--pipeline-model-parallel-size", "4"), [2, 2, 2, 2]),
    (("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3"),
     [3, 5]),
    (("--pipeline-model-parallel-size", "4", "--decoder-last-pipeline-num-layers", "2"),
     [2, 2, 2, 2]),
    (("--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "5"),
     [5, 1, 1, 1]),
    (("--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "1",
      "--decoder-last-pipeline-num-layers", "1"), [1, 3, 3, 1]),
    (("--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split",
      "--account-for-loss-in-pipeline-split"), [4, 4]),
    (("--num-layers", "6", "--pipeline-model-parallel-size", "2",
      "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"),
     [3, 3]),
    (("--num-layers", "7", "--pipeline-model-parallel-size", "4",
      "--account-for-embedding-in-pipeline-split"), [1, 2, 2, 2]),
    (("--num-layers", "2", "--pipeline-model-parallel-size", "4",
      "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"),
     [0, 1, 1, 0]),
    (("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--decoder-first-pipeline-num-layers", "2"), [2, 6]),
    (("--num-layers", "6", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "2",
      "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"),
     [3, 3]),
])
def test_stage_layers_as_megatron_core_builds_them(flags, layers):
    assert _layers(*flags) == layers


@pytest.mark.parametrize("flags, match", [
    (("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "8"),
     r"--num-layers 8 less --decoder-first-pipeline-num-layers 8 leaves 0 layers for the "
     r"other 1 pipeline stage: they need the same number each, at least 1"),
    (("--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "3"),
     r"leaves 5 layers for the other 3 pipeline stages"),
    (("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "0"),
     r"--decoder-first-pipeline-num-layers must be >= 1, got 0"),
    (("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
      "--decoder-last-pipeline-num-layers", "3"),
     r"--num-layers 8 must equal --decoder-first-pipeline-num-layers 3 and "
     r"--decoder-last-pipeline-num-layers 3 added: there is no other pipeline stage"),
    (("--decoder-first-pipeline-num-layers", "4", "--decoder-last-pipeline-num-layers", "4"),
     r"together need --pipeline-model-parallel-size >= 2, got 1"),
    (("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
      "--account-for-loss-in-pipeline-split"), r"are exclusive \(megatron-core's rule\)"),
    (("--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split"),
     r"--num-layers 8 \+ 1 \(--account-for-embedding-in-pipeline-split\) must be divisible "
     r"by --pipeline-model-parallel-size 2"),
    (("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--decoder-first-pipeline-num-layers", "3"),
     r"--decoder-first-pipeline-num-layers 3 must be divisible by the virtual stages a rank "
     r"\(2\)"),
    (("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
      "--decoder-last-pipeline-num-layers", "2"),
     r"take their virtual stages from --num-virtual-stages-per-pipeline-rank"),
    (("--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
      "--recompute-num-layers", "6", "--decoder-first-pipeline-num-layers", "3"),
     r"--recompute-num-layers 6 must be in \[1, the layers of the largest pipeline stage = 5\]"),
    # megatron-core's uniform method reads past a stage whose layers N does not divide (a
    # review: accepted, then an IndexError in the first forward)
    (("--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
      "--recompute-num-layers", "3", "--decoder-first-pipeline-num-layers", "2"),
     r"--recompute-method uniform --recompute-num-layers 3 must divide the layers of every "
     r"pipeline stage \(some have 2\): pass a divisor, or --recompute-method block"),
    (("--num-layers", "7", "--pipeline-model-parallel-size", "2", "--recompute-granularity",
      "full", "--recompute-num-layers", "2", "--account-for-embedding-in-pipeline-split",
      "--num-virtual-stages-per-pipeline-rank", "2"),
     r"must divide the layers of every pipeline stage chunk \(some have 1\)"),
])
def test_a_split_megatron_core_would_refuse_is_one_line(flags, match):
    with pytest.raises(FlagError, match=match):
        _layers(*flags)


def test_the_block_method_takes_any_count_up_to_the_largest_stage():
    assert _layers("--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                   "--recompute-method", "block", "--recompute-num-layers", "3",
                   "--decoder-first-pipeline-num-layers", "2") == [2, 6]
