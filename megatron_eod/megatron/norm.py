"""PyTorch LayerNorm/RMSNorm for megatron-core specs, with sequence parallelism allowed.

One job: megatron-core's torch norm wrapper (`WrappedTorchNorm`, used when neither
TransformerEngine nor apex is installed, so always on CPU) refuses `--sequence-parallel` and
zero-centred gamma. A norm needs nothing special under sequence parallelism except that its
weight gradients, computed from the rank's slice of the sequence, are summed over the TP
group; megatron-core's `finalize_model_grads` does that for parameters marked
`sequence_parallel = True`. This class builds the same torch norm and marks its parameters.
With `layernorm_zero_centered_gamma` (--apply-layernorm-1p) the weight is stored as gamma - 1
(initialised to 0) and the norm scales by weight + 1, as TransformerEngine's and apex's do, so
their checkpoints load as the same model.

What it does not do: no fused kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["TorchNorm"]


class _ZeroCentred:
    """The weight stored as gamma - 1: initialised to 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)


class _ZeroCentredLayerNorm(_ZeroCentred, torch.nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class _ZeroCentredRMSNorm(_ZeroCentred, torch.nn.RMSNorm):
    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class TorchNorm:
    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        centred = getattr(config, "layernorm_zero_centered_gamma", False)
        if config.normalization == "LayerNorm":
            norm = (_ZeroCentredLayerNorm if centred else torch.nn.LayerNorm)(hidden_size,
                                                                               eps=eps)
        elif config.normalization == "RMSNorm":
            norm = (_ZeroCentredRMSNorm if centred else torch.nn.RMSNorm)(hidden_size, eps=eps)
        else:
            raise ValueError(f"--normalization {config.normalization!r}: LayerNorm or RMSNorm")
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm
