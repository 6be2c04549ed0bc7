"""Multi-latent attention (megatron-core's MLA, --multi-latent-attention) through Megatron-LM's
REAL trainer with EoD reset under CP, on gloo CPU ranks: its RoPE at the reset positions of
each rank's tokens (megatron/mla.py), q/k head dim != v head dim (core_attention.py pads), so
CP=N == CP=1."""

import pytest

from tests.megatron.tiny_model import NEEDS_MLA, mla_buildable
from tests.training.runs import relative, train

# q/kv LoRA ranks, a decoupled RoPE head dim, v head dim != q/k head dim; YaRN as DeepSeek-V3
MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "24",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "24",
       "--rope-type", "yarn", "--rotary-scaling-factor", "4"]
DROP = ("--group-query-attention", "--num-query-groups")  # MLA has no GQA (Megatron-LM's rule)
TOL = 1e-5
pytestmark = pytest.mark.skipif(not mla_buildable(), reason=NEEDS_MLA)


@pytest.fixture(scope="module")
def mla_cp1(short_docs_data, tmp_path_factory):
    return train(tmp_path_factory.mktemp("mla_cp1"), "cp1", short_docs_data, *MLA, drop=DROP)[0]


@pytest.mark.parametrize("algo", [["ring"], ["ulysses"], ["hybrid", "--ulysses-degree-in-cp",
                                                          "2"]], ids=lambda a: a[0])
def test_mla_cp4_losses_match_cp1(mla_cp1, short_docs_data, tmp_path, algo):
    losses, _ = train(tmp_path, "cp4", short_docs_data, *MLA, "--context-parallel-size", "4",
                      "--context-parallel-algo", *algo, drop=DROP)
    assert relative(losses, mla_cp1) < TOL, (losses, mla_cp1)


def test_an_mla_moe_mtp_checkpoint_resumes_at_another_cp_size(short_docs_data, tmp_path):
    """DeepSeek-V3's shape in small: MLA, experts and MTP heads in one model, saved at CP=4
    ring (megatron-core's torch_dist), resumed at CP=2 x DP=2: the uninterrupted CP=1 losses."""
    from tests.functional.test_moe_training import MOE
    from tests.functional.test_mtp_training import MTP

    flags = [*MLA, *MOE, *MTP]
    expected, _ = train(tmp_path, "cp1", short_docs_data, *flags, drop=DROP)
    ckpt = str(tmp_path / "ckpt")
    first, _ = train(tmp_path, "save", short_docs_data, *flags, "--context-parallel-size", "4",
                     "--save", ckpt, "--save-interval", "2", "--exit-interval", "2", drop=DROP)
    resumed, _ = train(tmp_path, "load", short_docs_data, *flags, "--context-parallel-size",
                       "2", "--load", ckpt, drop=DROP)
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
    assert relative({**first, **resumed}, expected) < TOL, (first, resumed, expected)
