"""Megatron-LM launch-script flags the lean trainer once refused as unknown, so that one
script ran under Megatron-LM's trainer and stopped under ours: --exit-duration-in-mins and
--skip-train do what they do there, --dataloader-type single, --use-dist-ckpt and
--no-create-attention-mask-in-dataloader are accepted (what the lean trainer does anyway), and
the loaders it does not have are refused by name. (--no-mmap-bin-files:
tests/functional/test_cpu_training.py.)"""

import json
import os

import pytest

from megatron_eod.training.args import FlagError, parse_args
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks
from tests.training.test_nan_stop import _train

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128", "--train-iters", "10", "--lr", "1e-3", "--mock-data"]


@pytest.mark.parametrize("flags", [["--dataloader-type", "single"], ["--use-dist-ckpt"],
                                   ["--no-create-attention-mask-in-dataloader"]])
def test_flags_meaning_what_the_lean_trainer_does_are_accepted(flags):
    parse_args([*MODEL, *flags], world_size=1, cuda_available=False)


@pytest.mark.parametrize("kind", ["cyclic", "external"])
def test_loaders_the_lean_trainer_lacks_are_refused_by_name(kind):
    with pytest.raises(FlagError, match=f"--dataloader-type {kind}: the lean trainer reads "
                                        f"the samples in order, each once"):
        parse_args([*MODEL, "--dataloader-type", kind], world_size=1, cuda_available=False)
    # 0: off, as Megatron-LM reads it
    assert parse_args([*MODEL, "--exit-duration-in-mins", "0"], world_size=1,
                      cuda_available=False).exit_duration_in_mins == 0


def _train_with_a_fast_clock(rank, world, argv):
    """Each look at the clock finds it 25 s later: --exit-duration-in-mins 1 is past at the
    third iteration's check (start-up, then 25, 50, 75 s)."""
    from megatron_eod.training import pretrain as module

    ticks = iter(range(0, 10 ** 6, 25))
    module._now = lambda: float(next(ticks))
    return _train(rank, world, argv)


def test_exit_duration_saves_and_stops_every_rank(tiny_data, tmp_path):
    save = tmp_path / "ckpt"
    argv = tiny_flags(tiny_data, "--context-parallel-size", "2", "--save", str(save),
                      "--exit-duration-in-mins", "1")
    results = run_ranks(_train_with_a_fast_clock, 2, argv, daemon=False)  # saving forks
    assert [code for code, _, _ in results] == [0, 0], results
    assert len(results[-1][2]) == 3
    assert "exiting after 1.2 minutes (--exit-duration-in-mins 1)" in results[0][1]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_skip_train_evaluates_the_loaded_checkpoint(tiny_data, tmp_path):
    """As Megatron-LM's --skip-train: no iteration; the validation and test losses of the
    loaded weights at the loaded iteration, validation read from its first sample as
    Megatron-LM's loaders do there (not from where the saving run's evaluations stopped): the
    losses of a run that evaluates the same weights only after its last iteration."""
    save, metrics = str(tmp_path / "ckpt"), tmp_path / "m.jsonl"
    reference = tmp_path / "reference.jsonl"
    short = ("--train-iters", "4")
    run_ranks(_train, 1, tiny_flags(tiny_data, *short, "--eval-interval", "1000",
                                    "--metrics-file", str(reference)), daemon=False)
    # Evaluates at iteration 2 too: its checkpoint has consumed validation samples.
    run_ranks(_train, 1, tiny_flags(tiny_data, *short, "--eval-interval", "2", "--save", save),
              daemon=False)
    results = run_ranks(_train, 1, tiny_flags(tiny_data, *short, "--load", save, "--skip-train",
                                              "--metrics-file", str(metrics)), daemon=False)
    assert results[0][0] == 0 and results[0][2] == [], results
    assert "skipping training (--skip-train is on)" in results[0][1]
    evaluated = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["kind"], r["iteration"]) for r in evaluated] == [("valid", 4), ("test", 4)]
    assert evaluated == [json.loads(line) for line in reference.read_text().splitlines()
                         if "kind" in json.loads(line)]
    assert sorted(os.listdir(save)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]


def test_no_mmap_bin_files_reaches_megatron_cores_dataset_config(tiny_data, monkeypatch):
    """(Training on it gives the same losses, tests/functional/test_cpu_training.py: that
    alone would pass with the flag ignored.)"""
    from megatron_eod.training import eod_wiring
    from megatron_eod.training.data import build_tokenizer_from_args

    built = {}
    monkeypatch.setattr(eod_wiring, "build_gpt_datasets",
                        lambda *a, **settings: built.update(settings) or (None, None, None))
    for flags, mapped in (([], True), (["--no-mmap-bin-files"], False)):
        args = parse_args(tiny_flags(tiny_data, *flags), world_size=1, cuda_available=False)
        eod_wiring.datasets(args, build_tokenizer_from_args(args), [8, 8, 8])
        assert built["mmap_bin_files"] is mapped
