"""A micro-batch as one CP rank needs it: its tokens in plan order plus the EoD context.

One job, in two halves so the first can run ahead on a worker thread (plan_ahead.py):
* `plan_batch` (host only, thread-safe): from the micro-batch's tokens on the CPU, the
  document layout and the CP plan (identical on every rank, no communication), with this
  rank's token index and schedule already built;
* `local_batch` (the step's thread): this rank's tokens, labels, loss mask and reset
  position ids picked with `plan.token_index`, the plan moved to the device, and the
  attention context registered. Position ids, labels and the loss mask travel with the
  tokens, so any token order is correct. The result is packed as one row ([1, b*s/cp]); the
  attention restores document boundaries from the plan.

What it does not do: no tensor-parallel broadcast and no pipeline-stage handling (steps.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_eod.layout import DocLayout, build_doc_layout, doc_layout_from_starts
from megatron_eod.megatron.batch_context import EodBatchContext
from megatron_eod.plan import CPPlan, plan_context_parallel
from megatron_eod.plan.kv_schedule import to_device

__all__ = ["LocalBatch", "PlannedBatch", "plan_batch", "local_batch", "slice_batch_for_cp"]


@dataclass(frozen=True)
class PlannedBatch:
    layout: DocLayout  # on the CPU
    plan: CPPlan  # on the CPU; the rank's token index and schedule are built
    cp_rank: int


@dataclass(frozen=True)
class LocalBatch:
    tokens: torch.Tensor  # int64 [1, n_local]
    labels: torch.Tensor  # int64 [1, n_local]
    loss_mask: torch.Tensor  # float32 [1, n_local]
    position_ids: torch.Tensor  # int64 [1, n_local], reset after every EoD
    attention_mask: torch.Tensor  # int64 [1]: the context id (see batch_context.py)
    plan: object


def plan_batch(tokens: torch.Tensor, eod_token_id: int, cp_size: int = 1, cp_rank: int = 0,
               algo: str = "ring", ulysses_degree: Optional[int] = None,
               reset_position_ids: bool = True, reset_attention_mask: bool = True,
               eod_mask_loss: bool = False, pad_token_id: Optional[int] = None,
               fused_tiles: bool = True,
               doc_starts: Optional[torch.Tensor] = None) -> PlannedBatch:
    """Layout + plan of one micro-batch from CPU tokens [b, s]; host work only. fused_tiles:
    the plan's schedules carry the fused kernels' tiles (--cp-fused-forward). doc_starts
    (CPU [b, s], true where a document starts): the documents are those, not the EoD
    tokens' (--dataloader-inter-document-masking; the reset and loss flags then do not
    apply: positions restart at every document, the dataset's loss mask is the one)."""
    if doc_starts is not None:
        layout = doc_layout_from_starts(doc_starts)
    else:
        layout = build_doc_layout(tokens, eod_token_id, reset_position_ids=reset_position_ids,
                                  reset_attention_mask=reset_attention_mask,
                                  eod_mask_loss=eod_mask_loss, pad_token_id=pad_token_id)
    plan = plan_context_parallel(layout.cu_seqlens, cp_size, algo, ulysses_degree, fused_tiles)
    plan.token_index(cp_rank)  # built here, off the step
    plan.schedule(cp_rank)
    return PlannedBatch(layout, plan, cp_rank)


def local_batch(planned: PlannedBatch, tokens: torch.Tensor, labels: torch.Tensor, registry,
                cp_group=None, loss_mask: Optional[torch.Tensor] = None) -> LocalBatch:
    """This rank's rows of the micro-batch on `tokens.device`, and its registered context."""
    device = tokens.device
    plan = planned.plan.to(device) if device.type != "cpu" else planned.plan
    move = lambda t: to_device(t, device)  # noqa: E731
    idx = move(plan.token_index(planned.cp_rank))
    flat = lambda t: move(t.reshape(-1))[idx].unsqueeze(0)  # noqa: E731
    mask = move(planned.layout.loss_mask)
    mask = mask if loss_mask is None else mask * loss_mask
    positions = flat(planned.layout.position_ids)
    context = EodBatchContext(plan=plan, position_ids=positions[0], cp_group=cp_group)
    return LocalBatch(tokens=flat(tokens), labels=flat(labels), loss_mask=flat(mask),
                      position_ids=positions, attention_mask=registry.register(context),
                      plan=plan)


def slice_batch_for_cp(tokens, labels, eod_token_id, registry, cp_size=1, cp_rank=0,
                       cp_group=None, algo="ring", ulysses_degree=None,
                       reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False,
                       pad_token_id: Optional[int] = None, loss_mask=None) -> LocalBatch:
    """Both halves at once (no planning ahead)."""
    planned = plan_batch(tokens.cpu(), eod_token_id, cp_size, cp_rank, algo, ulysses_degree,
                         reset_position_ids, reset_attention_mask, eod_mask_loss, pad_token_id)
    return local_batch(planned, tokens, labels, registry, cp_group, loss_mask)
