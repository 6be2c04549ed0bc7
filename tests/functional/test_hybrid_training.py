"""pretrain_hybrid.py: megatron-core's HybridModel (upstream's successor to GPTModel) through
Megatron-LM's REAL trainer with EoD reset under CP, on gloo CPU ranks. '*-' repeated is a GPT
block: the same losses at every CP size, and a GPT checkpoint of pretrain_gpt.py continues
here (megatron-core >= 0.19's load-time translation)."""

import importlib.util
import os

import pytest

from tests.training.runs import relative, train

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core.models.hybrid") is None,
    reason="HybridModel needs megatron-core >= 0.18")

PATTERN = ["--hybrid-layer-pattern", "*-*-"]
TOL = 1e-5


def hybrid(tmp_path, name, data, *extra):
    # --hybrid-layer-pattern sets the layers (Megatron-LM's rule: --num-layers left out)
    return train(tmp_path, name, data, *PATTERN, *extra, drop=("--num-layers",),
                 entry="pretrain_hybrid")[0]


@pytest.fixture(scope="module")
def hybrid_cp1(short_docs_data, tmp_path_factory):
    return hybrid(tmp_path_factory.mktemp("hybrid_cp1"), "cp1", short_docs_data)


def test_star_dash_star_dash_is_pretrain_gpts_two_layer_gpt(hybrid_cp1, baseline):
    """'*-*-' from scratch trains as pretrain_gpt.py's 2-layer GPT on the same data: megatron-
    core draws the two models' initial weights in the same order (seen equal to the last digit
    on 0.19.2), so the weights are the same too."""
    assert relative(hybrid_cp1, baseline[0]) < TOL, (hybrid_cp1, baseline[0])


@pytest.mark.parametrize("algo", [["ring"], ["hybrid", "--ulysses-degree-in-cp", "2"]],
                         ids=lambda a: a[0])
def test_hybrid_model_cp4_losses_match_cp1(hybrid_cp1, short_docs_data, tmp_path, algo):
    losses = hybrid(tmp_path, "cp4", short_docs_data, "--context-parallel-size", "4",
                    "--context-parallel-algo", *algo)
    assert relative(losses, hybrid_cp1) < TOL, (losses, hybrid_cp1)


@pytest.mark.skipif(importlib.util.find_spec(
    "megatron.core.dist_checkpointing.gpt_checkpoint_interop") is None,
    reason="the GPT -> hybrid checkpoint translation is megatron-core >= 0.19's")
def test_a_gpt_checkpoint_continues_under_pretrain_hybrid(baseline, short_docs_data, tmp_path):
    """pretrain_gpt.py (2 layers) saved at iteration 2 (torch_dist, the model-space optimizer
    format the translation needs), continued by pretrain_hybrid.py '*-*-' at CP=4: the
    uninterrupted GPT run's losses, so the two are the same model on the same data."""
    reference = baseline[0]
    ckpt = str(tmp_path / "ckpt")
    reshardable = "--dist-ckpt-optim-fully-reshardable"
    first, _ = train(tmp_path, "gpt", short_docs_data, reshardable, "--save", ckpt,
                     "--save-interval", "2", "--exit-interval", "2")
    assert os.path.isdir(os.path.join(ckpt, "iter_0000002"))
    resumed = hybrid(tmp_path, "hybrid", short_docs_data, reshardable, "--load", ckpt,
                     "--context-parallel-size", "4")
    assert sorted(resumed) == [3, 4]
    assert relative({**first, **resumed}, reference) < TOL, (first, resumed, reference)


def test_a_moe_hybrid_pattern_cp4_matches_cp1(short_docs_data, tmp_path):
    """'*E*E': attention and MoE layers (megatron-core's MoETransformerLayer, 4 experts,
    top-2) at CP=4 ring == CP=1."""
    moe = ["--hybrid-layer-pattern", "*E*E", "--num-experts", "4", "--moe-router-topk", "2",
           "--moe-ffn-hidden-size", "96", "--disable-bias-linear"]
    expected = train(tmp_path, "cp1", short_docs_data, *moe, drop=("--num-layers",),
                     entry="pretrain_hybrid")[0]
    losses = train(tmp_path, "cp4", short_docs_data, *moe, "--context-parallel-size", "4",
                   drop=("--num-layers",), entry="pretrain_hybrid")[0]
    assert relative(losses, expected) < TOL, (losses, expected)
