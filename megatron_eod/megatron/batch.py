"""A micro-batch as one CP rank needs it: its tokens in plan order plus the EoD context.

One job: from the full micro-batch (the same `tokens`/`labels` on every CP rank), build the
document layout and the CP plan (identical on every rank, no communication), pick this rank's
tokens with `plan.token_index`, and register the attention context. Position ids, labels and
the loss mask travel with the tokens, so any token order is correct. The result is packed as
one row ([1, b*s/cp]); the attention restores document boundaries from the plan.

What it does not do (yet): the tensor-parallel broadcast and pipeline-stage handling of
Megatron's get_batch arrive with the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_eod.layout import build_doc_layout
from megatron_eod.megatron.batch_context import EodBatchContext
from megatron_eod.plan import plan_context_parallel

__all__ = ["LocalBatch", "slice_batch_for_cp"]


@dataclass(frozen=True)
class LocalBatch:
    tokens: torch.Tensor  # int64 [1, n_local]
    labels: torch.Tensor  # int64 [1, n_local]
    loss_mask: torch.Tensor  # float32 [1, n_local]
    position_ids: torch.Tensor  # int64 [1, n_local], reset after every EoD
    attention_mask: torch.Tensor  # int64 [1]: the context id (see batch_context.py)
    plan: object


def slice_batch_for_cp(tokens, labels, eod_token_id, registry, cp_size=1, cp_rank=0,
                       cp_group=None, algo="ring", ulysses_degree=None,
                       reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False,
                       pad_token_id: Optional[int] = None, loss_mask=None) -> LocalBatch:
    layout = build_doc_layout(tokens, eod_token_id, reset_position_ids=reset_position_ids,
                              reset_attention_mask=reset_attention_mask,
                              eod_mask_loss=eod_mask_loss, pad_token_id=pad_token_id)
    plan = plan_context_parallel(layout.cu_seqlens, cp_size, algo, ulysses_degree)
    device = tokens.device
    plan = plan.to(device) if device.type != "cpu" else plan
    idx = plan.token_index(cp_rank).to(device)
    flat = lambda t: t.reshape(-1)[idx].unsqueeze(0)  # noqa: E731
    mask = layout.loss_mask if loss_mask is None else layout.loss_mask * loss_mask
    positions = flat(layout.position_ids)
    context = EodBatchContext(plan=plan, position_ids=positions[0], cp_group=cp_group)
    return LocalBatch(tokens=flat(tokens), labels=flat(labels), loss_mask=flat(mask),
                      position_ids=positions, attention_mask=registry.register(context),
                      plan=plan)
