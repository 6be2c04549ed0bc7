"""Multi-latent attention (megatron-core's MLA, --multi-latent-attention) through Megatron-LM's
REAL trainer with EoD reset under CP, on gloo CPU ranks: its RoPE at the reset positions of
each rank's tokens (megatron/mla.py), q/k head dim != v head dim (core_attention.py pads), so
CP=N == CP=1."""

import pytest

from tests.megatron.tiny_model import NEEDS_MLA, mla_buildable
from tests.training.runs import train

# q/kv LoRA ranks, a decoupled RoPE head dim, v head dim != q/k head dim; YaRN as DeepSeek-V3
MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "24",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "24",
       "--rope-type", "yarn", "--rotary-scaling-factor", "4"]
DROP = ("--group-query-attention", "--num-query-groups")  # MLA has no GQA (Megatron-LM's rule)
TOL = 1e-5
pytestmark = pytest.mark.skipif(not mla_buildable(), reason=NEEDS_MLA)


def relative(a, b):
    return max(abs(a[i] - b[i]) / abs(b[i]) for i in b)


@pytest.fixture(scope="module")
def mla_cp1(short_docs_data, tmp_path_factory):
    return train(tmp_path_factory.mktemp("mla_cp1"), "cp1", short_docs_data, *MLA, drop=DROP)[0]


@pytest.mark.parametrize("algo", [["ring"], ["ulysses"], ["hybrid", "--ulysses-degree-in-cp",
                                                          "2"]], ids=lambda a: a[0])
def test_mla_cp4_losses_match_cp1(mla_cp1, short_docs_data, tmp_path, algo):
    losses, _ = train(tmp_path, "cp4", short_docs_data, *MLA, "--context-parallel-size", "4",
                      "--context-parallel-algo", *algo, drop=DROP)
    assert relative(losses, mla_cp1) < TOL, (losses, mla_cp1)
