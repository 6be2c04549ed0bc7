"""Per-micro-batch EoD metadata, handed to the attention layers through the attention mask.

One job: carry a micro-batch's `CPPlan`, its local position ids and the CP group from
`get_batch` to every `EodCoreAttention` of the model, so that the forward, a full-recompute
forward run during backward, and pipeline schedules with several micro-batches in flight all
see THEIR micro-batch's metadata. megatron-core passes `attention_mask` unchanged from
GPTModel to each layer's core attention and saves it (as a tensor) for recompute, so the mask
slot carries a 1-element int64 tensor: the id of the context in a registry owned by the model.

What it does not do: no planning (plan/), no communication. The registry keeps the last
`capacity` contexts, enough for every micro-batch a pipeline schedule keeps in flight. The id
tensor stays on the CPU even on GPUs: every layer reads it (`lookup`), and a CUDA id would
cost a device-to-host sync per layer.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

__all__ = ["EodBatchContext", "EodContextRegistry"]


@dataclass(frozen=True)
class EodBatchContext:
    plan: object  # megatron_eod.plan.CPPlan, tensors already on the compute device
    position_ids: torch.Tensor  # int64 [n_local]: reset positions of this rank's tokens
    cp_group: Optional[object]  # torch.distributed group (None when cp_size == 1)
    _rope: Dict[tuple, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def rotary_freqs(self, inv_freq: torch.Tensor, interleaved: bool = False,
                     interpolation_factor: Optional[float] = None) -> torch.Tensor:
        """[n_local, 1, 1, dim] rotary angles of the local RESET position ids, laid out as
        megatron-core's RotaryEmbedding lays out angles for positions 0..s-1 (halves, or
        interleaved pairs), positions divided by `interpolation_factor` when given (cached)."""
        key = (inv_freq.data_ptr(), str(inv_freq.device), interleaved, interpolation_factor)
        if key not in self._rope:
            positions = self.position_ids.to(inv_freq.device, torch.float32)
            if interpolation_factor is not None:
                positions = positions * (1.0 / interpolation_factor)
            angles = torch.outer(positions, inv_freq)
            if interleaved:
                angles = angles.repeat_interleave(2, dim=-1)
            else:
                angles = torch.cat([angles, angles], dim=-1)
            self._rope[key] = angles[:, None, None, :]
        return self._rope[key]


class EodContextRegistry:
    """Maps small int ids to contexts; `attention_mask = registry.register(ctx)`."""

    def __init__(self, capacity: int = 64):
        if capacity < 1:
            raise ValueError(f"registry capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._contexts: "OrderedDict[int, EodBatchContext]" = OrderedDict()
        self._next = 0

    def register(self, context: EodBatchContext, device=None) -> torch.Tensor:
        key = self._next
        self._next += 1
        self._contexts[key] = context
        while len(self._contexts) > self.capacity:
            self._contexts.popitem(last=False)
        return torch.tensor([key], dtype=torch.int64, device=device)

    def lookup(self, attention_mask: torch.Tensor) -> EodBatchContext:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.numel() != 1:
            raise ValueError("EodCoreAttention expects the attention_mask slot to hold the id "
                             "returned by EodContextRegistry.register (got "
                             f"{type(attention_mask).__name__})")
        key = int(attention_mask.item())
        if key not in self._contexts:
            raise ValueError(f"EoD batch context {key} is no longer registered (raise the "
                             f"registry capacity above {self.capacity})")
        return self._contexts[key]
