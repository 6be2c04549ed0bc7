"""PyTorch LayerNorm/RMSNorm for megatron-core specs, with sequence parallelism allowed.

One job: megatron-core's torch norm wrapper (`WrappedTorchNorm`, used when neither
TransformerEngine nor apex is installed, so always on CPU) refuses `--sequence-parallel`.
A norm needs nothing special under sequence parallelism except that its weight gradients,
computed from the rank's slice of the sequence, are summed over the TP group;
megatron-core's `finalize_model_grads` does that for parameters marked
`sequence_parallel = True`. This class builds the same torch norm and marks its parameters.

What it does not do: no fused kernels, no zero-centred gamma.
"""

from __future__ import annotations

import torch

__all__ = ["TorchNorm"]


class TorchNorm:
    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"--normalization {config.normalization!r}: LayerNorm or RMSNorm")
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm
