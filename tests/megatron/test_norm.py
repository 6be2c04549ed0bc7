"""norm.TorchNorm: the torch norms of the EoD layer spec (sequence-parallel weights marked;
--apply-layernorm-1p's zero-centred gamma as TransformerEngine and apex store it, which
megatron-core's torch wrapper refuses and our norm silently ignored)."""

import types

import pytest
import torch

from megatron_eod.megatron.norm import TorchNorm


def config(normalization, centred, sequence_parallel=False):
    return types.SimpleNamespace(normalization=normalization, sequence_parallel=sequence_parallel,
                                 layernorm_zero_centered_gamma=centred)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centred_gamma_scales_by_weight_plus_one(normalization):
    x = torch.randn(5, 3, 16, dtype=torch.float64)
    plain = TorchNorm(config(normalization, False), 16).double()
    centred = TorchNorm(config(normalization, True), 16).double()
    assert torch.equal(centred.weight, torch.zeros(16, dtype=torch.float64))
    torch.testing.assert_close(centred(x), plain(x))  # at initialisation: the same norm
    with torch.no_grad():  # a TE/apex checkpoint's gamma - 1 is the plain norm's gamma
        centred.weight.uniform_(-0.5, 0.5)
        plain.weight.copy_(centred.weight + 1)
        if normalization == "LayerNorm":
            centred.bias.normal_()
            plain.bias.copy_(centred.bias)
    torch.testing.assert_close(centred(x), plain(x))
    assert set(centred.state_dict()) == set(plain.state_dict())


def test_weights_are_marked_for_sequence_parallel_gradients():
    norm = TorchNorm(config("LayerNorm", True, sequence_parallel=True), 8)
    assert all(p.sequence_parallel for p in norm.parameters())
