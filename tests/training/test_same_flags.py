"""Every rank is launched with the same flags and versions (training/same_flags.py): a rank
given another value stops every rank at start-up, naming the flag, both ranks and values,
before any group is made (both trainers)."""

import argparse
import enum
import socket

import pytest
import torch

from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.same_flags import check_same_flags, comparable_values, difference
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import import_megatron_lm
from tests.training.runs import flags, start_each


def _args(**values):
    base = dict(lr=3e-4, seed=1234, rank=0, local_rank=0, params_dtype=torch.bfloat16,
                data_path=["1.0", "a_text_document"], persist_layer_norm=True, make=object())
    return argparse.Namespace(**{**base, **values})


def test_the_compared_values():
    values = comparable_values(_args(rank=5, local_rank=3))
    assert values == comparable_values(_args())  # the rank's own numbers are not compared
    assert {"lr", "seed", "params_dtype", "data_path", "persist_layer_norm"} <= values.keys()
    assert values["data_path"] == "['1.0', 'a_text_document']"  # as the flags gave it
    assert "make" not in values  # an object: its repr could differ without meaning anything
    # Enums by name (Megatron-LM's --attention-backend); what may differ by node is not
    # compared: where the logging rank writes, the loader workers a node starts.
    backend = enum.Enum("AttnBackend", "flash unfused")
    assert comparable_values(_args(attention_backend=backend.unfused))["attention_backend"] == \
        "AttnBackend.unfused"
    per_node = dict(tensorboard_dir="/tb/node3-2359", num_workers=8, mmap_bin_files=False,
                    num_dataset_builder_threads=4, memory_snapshot_path="/x/node3.pickle")
    assert comparable_values(_args(**per_node)) == values
    assert values["the torch version"] == str(torch.__version__)
    assert values["the megatron-core version"].startswith("0.")


def test_the_difference_in_words():
    one, other = comparable_values(_args()), comparable_values(_args(lr=6e-4))
    assert difference(one, one) is None
    names = ("rank 0 (a)", "rank 9 (b)")
    argv = ["--lr", "6e-4"], ["--lr=3e-4"]
    assert difference(one, other, argv, names) == (
        "rank 9 (b) has --lr 0.0006 where rank 0 (a) has 0.0003")
    # Not on either command line: a default, or a value set from other flags.
    assert difference(one, other, (), names) == (
        "rank 9 (b) has lr (a default, or set from other flags) 0.0006 where rank 0 (a) has "
        "0.0003")
    # A --no- flag, a value only one rank's version has, the count past three, flags first.
    other = comparable_values(_args(persist_layer_norm=False, extra=1, lr=1.0, seed=1, zeta=2))
    said = difference(one, other, ((), ["--no-persist-layer-norm", "--seed", "1"]), names)
    assert said == ("rank 9 (b) has --no-persist-layer-norm: persist_layer_norm False where rank "
                    "0 (a) has True; --seed 1 where rank 0 (a) has 1234; extra (a default, or set "
                    "from other flags) 1 where rank 0 (a) has (not set) and 2 more (its command "
                    "line adds --no-persist-layer-norm --seed)")
    # The --no- option on rank 0's command line only: this rank did not give it.
    said = difference(other, one, (["--no-persist-layer-norm"], ()), names)
    assert said.startswith("rank 9 (b) has persist_layer_norm True where rank 0 (a) has False "
                           "(its --no-persist-layer-norm)")
    # A flag stored under another name (Megatron-LM's --disable-bias-linear sets
    # add_bias_linear): the command lines' own difference names it.
    other = comparable_values(_args(add_bias_linear=False))
    said = difference(comparable_values(_args(add_bias_linear=True)), other,
                      (["--lr", "1"], ["--lr", "1", "--disable-bias-linear"]), names)
    assert said == ("rank 9 (b) has add_bias_linear (a default, or set from other flags) False "
                    "where rank 0 (a) has True (its command line adds --disable-bias-linear)")
    # Long values shortened (a blend of 1,000 files is one value).
    blend = comparable_values(_args(data_path=["1.0", "x" * 500]))
    assert len(difference(one, blend, (), names)) < 400
    # Spelled as given: Megatron-LM's --override-opt_param-scheduler.
    other = dict(one, override_opt_param_scheduler="True")
    assert difference(one, other, ([], ["--override-opt_param-scheduler"]), names).startswith(
        "rank 9 (b) has --override-opt_param-scheduler True where rank 0 (a) has (not set)")
    # Versions that differ are named alone (another megatron-core differs in hundreds of
    # defaults, which would bury it).
    versions = dict(other, **{"the torch version": "2.0.0", "new_default": "1"})
    assert difference(one, versions, ((), ["--disable-bias-linear"]), names) == (
        f"rank 9 (b) has the torch version 2.0.0 where rank 0 (a) has "
        f"{one['the torch version']}")


def _check(rank, world, lrs):
    try:
        check_same_flags(_args(lr=lrs[rank], rank=rank), ["--lr", str(lrs[rank])])
    except FlagError as error:
        return str(error)
    return None


def test_every_rank_raises_the_first_difference():
    assert run_ranks(_check, 3, [3e-4] * 3) == [None] * 3
    errors = run_ranks(_check, 4, [3e-4, 3e-4, 6e-4, 1e-3])
    host = socket.gethostname()
    assert errors == [errors[0]] * 4 and errors[0] == (
        f"the ranks were launched with different flags: rank 2 ({host}) has --lr 0.0006 where "
        f"rank 0 ({host}) has 0.0003 (2 of 4 ranks differ from rank 0). Every rank must run "
        f"with the same flags and versions: check what the launch script computes on each "
        f"node")


@pytest.mark.parametrize("flag", [("--seed", "7"), ("--context-parallel-size", "1")])
def test_megatron_lm_trainer_stops_every_rank(short_docs_data, tmp_path, flag):
    """Checked right before Megatron-LM makes its groups: another --seed (or --lr) on a rank
    trained on silently (its replica drifting); another CP size left the ranks waiting in
    megatron-core's group creation until the timeout."""
    import_megatron_lm()
    argv = flags(short_docs_data, None, "--context-parallel-size", "2")
    results = run_ranks(start_each, 2, [argv, argv + list(flag)], timeout=240, daemon=False)
    assert [code for code, _ in results] == [2, 2], results
    for _, text in results:
        assert "pretrain_gpt.py: error: the ranks were launched with different flags: rank 1 " \
            f"({socket.gethostname()}) has {flag[0]} {flag[1]} where rank 0" in text, text[-2000:]
        assert "Traceback" not in text
