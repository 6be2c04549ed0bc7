"""Mixture-of-experts GPTs through Megatron-LM's REAL trainer with EoD reset under CP, on gloo
CPU ranks: megatron-core's own MoE layer (router, token dispatcher, experts) beside our EoD
attention (megatron/layer_spec.py takes megatron-core's decoder block spec and puts EoD
attention in each layer)."""

import os
import re

import pytest

from tests.training.runs import relative, train

# 4 experts, top-2, the load-balancing loss, one dense layer then one MoE layer
# (--moe-layer-freq); dropout off (tests/training/runs.py), so CP=N == CP=1 holds exactly
# where the routing does (no token dropping).
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96",
       "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
       "--moe-layer-freq", "[0,1]", "--moe-token-dispatcher-type", "alltoall",
       "--disable-bias-linear"]

TOL = 1e-5


def balancing_losses(log):
    """Megatron-LM's logged load-balancing loss by iteration (--log-interval 1: each its own)."""
    found = re.findall(r"iteration\s+(\d+)/.*?load_balancing_loss: ([0-9.E+-]+)", log)
    return {int(i): float(value) for i, value in found}


@pytest.fixture(scope="module")
def moe_cp1(short_docs_data, tmp_path_factory):
    losses, log = train(tmp_path_factory.mktemp("moe_cp1"), "cp1", short_docs_data, *MOE)
    return losses, balancing_losses(log)


@pytest.mark.parametrize("algo", [["ring"], ["ulysses"], ["hybrid", "--ulysses-degree-in-cp",
                                                          "2"]], ids=lambda a: a[0])
def test_moe_cp4_losses_match_cp1(moe_cp1, short_docs_data, tmp_path, algo):
    """The language-model loss and the router's load-balancing loss per iteration: the latter
    counts tokens per expert, summed over the CP group, so where a token sits (our plan's
    order, not the sequence's) does not change it."""
    losses, log = train(tmp_path, "cp4", short_docs_data, *MOE, "--context-parallel-size", "4",
                        "--context-parallel-algo", *algo)
    expected, expected_balancing = moe_cp1
    assert sorted(losses) == sorted(expected)
    assert relative(losses, expected) < TOL, (losses, expected)
    balancing = balancing_losses(log)
    assert sorted(balancing) == sorted(expected_balancing) and balancing
    assert relative(balancing, expected_balancing) < TOL, (balancing, expected_balancing)


def test_expert_parallel_moe_cp2_matches_cp1(short_docs_data, tmp_path):
    """EP=2 (megatron-core's all-to-all dispatcher between the two expert ranks over gloo) at
    CP=2 ring == CP=1 at the same EP (the experts' initial weights depend on the EP size)."""
    ep = [*MOE, "--expert-model-parallel-size", "2"]
    expected, _ = train(tmp_path, "cp1", short_docs_data, *ep)
    losses, _ = train(tmp_path, "cp2", short_docs_data, *ep,
                      "--context-parallel-size", "2")
    assert relative(losses, expected) < TOL, (losses, expected)


def test_moe_torch_dist_checkpoint_resumes_at_another_cp_size(moe_cp1, short_docs_data,
                                                              tmp_path):
    """Saved at CP=4 ring (experts, router and all, megatron-core's torch_dist), resumed at
    CP=2 x DP=2: the uninterrupted CP=1 losses."""
    expected, _ = moe_cp1
    ckpt = str(tmp_path / "ckpt")
    first, _ = train(tmp_path, "save", short_docs_data, *MOE, "--context-parallel-size", "4",
                     "--save", ckpt, "--save-interval", "2", "--exit-interval", "2")
    assert os.path.isdir(os.path.join(ckpt, "iter_0000002"))
    resumed, _ = train(tmp_path, "load", short_docs_data, *MOE, "--context-parallel-size", "2",
                       "--load", ckpt)
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
    assert relative({**first, **resumed}, expected) < TOL, (first, resumed, expected)


def test_shared_experts_z_loss_allgather_and_mtp_at_cp4_match_cp1(short_docs_data, tmp_path):
    """The rest of what a DeepSeek-style MoE launch adds, in one pair of runs: shared experts,
    the router's z-loss, the all-gather dispatcher and two multi-token prediction heads."""
    flags = [*MOE, "--moe-shared-expert-intermediate-size", "64", "--moe-z-loss-coeff", "1e-3",
             "--moe-token-dispatcher-type", "allgather", "--mtp-num-layers", "2"]
    expected, expected_log = train(tmp_path, "cp1", short_docs_data, *flags)
    losses, log = train(tmp_path, "cp4", short_docs_data, *flags, "--context-parallel-size", "4")
    assert relative(losses, expected) < TOL, (losses, expected)
    balancing, expected_balancing = balancing_losses(log), balancing_losses(expected_log)
    assert balancing and relative(balancing, expected_balancing) < TOL
