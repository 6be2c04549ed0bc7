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

    def rotary_freqs(self, dim: int, base: float, dtype, device) -> torch.Tensor:
        """[n_local, 1, 1, dim] rotary angles from the local position ids (cached)."""
        key = (dim, base, dtype, str(device))
        if key not in self._rope:
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                                    device=device) / dim))
            angles = self.position_ids.to(device, torch.float32)[:, None] * inv_freq[None, :]
            self._rope[key] = torch.cat([angles, angles], dim=-1)[:, None, None, :].to(dtype)
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
