"""Multi-token prediction (megatron-core's MTP block, --mtp-num-layers) through Megatron-LM's
REAL trainer with EoD reset under CP, on gloo CPU ranks: its heads shift within documents and
weigh their losses by the micro-batch's counts (megatron/mtp.py), so CP=N trains as CP=1.
Megatron-LM logs each rank's MTP loss mean, averaged: under CP only close to CP=1's."""

import re

import pytest

from tests.training.runs import relative, train

# Two heads, weighted as much as the main loss: their gradients move the model's weights as
# much as its own, so a head that took a wrong neighbour moves the losses past TOL.
MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "1.0"]
TOL = 1e-5


def mtp_losses(log):
    """Megatron-LM's logged MTP losses by (iteration, head): --log-interval 1."""
    found = {}
    for line in log.splitlines():
        at = re.search(r"iteration\s+(\d+)/", line)
        if at:
            for head, value in re.findall(r"mtp_(\d+) loss: ([0-9.E+-]+)", line):
                found[int(at.group(1)), int(head)] = float(value)
    return found


@pytest.fixture(scope="module")
def mtp_cp1(short_docs_data, tmp_path_factory):
    losses, log = train(tmp_path_factory.mktemp("mtp_cp1"), "cp1", short_docs_data, *MTP)
    return losses, mtp_losses(log)


@pytest.mark.parametrize("algo", [["ring"], ["ulysses"], ["hybrid", "--ulysses-degree-in-cp",
                                                          "2"]], ids=lambda a: a[0])
def test_mtp_cp4_losses_match_cp1(mtp_cp1, short_docs_data, tmp_path, algo):
    losses, log = train(tmp_path, "cp4", short_docs_data, *MTP, "--context-parallel-size", "4",
                        "--context-parallel-algo", *algo)
    expected, expected_heads = mtp_cp1
    assert relative(losses, expected) < TOL, (losses, expected)
    heads = mtp_losses(log)
    assert sorted(heads) == sorted(expected_heads) and {h for _, h in heads} == {1, 2}
    assert relative(heads, expected_heads) < 0.02, (heads, expected_heads)
