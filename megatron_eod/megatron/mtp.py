"""Multi-token prediction (megatron-core's MTP block) over EoD micro-batches under CP.

One job: megatron-core's MTP shifts the tokens, position ids, labels and loss mask one token
left per depth (`roll_tensor`), along the sequence as IT lays it out under CP (two zigzag
chunks a rank) or within THD sequences. Our micro-batch is one packed row per rank in the
plan's order, so that shift would take the wrong neighbours. `install()` puts
`roll_in_documents` in its place, which, while a model forward of an EoD micro-batch runs
(`current(context)`, set by the steps), shifts within each DOCUMENT of the stream: a token's
next token is the one after it in its own document, nothing (0) after a document's last
token, wherever CP put either (one all-gather of the rolled tensor over the CP group, a few
bytes a token). Without such a context the original runs.

The count it returns beside the rolled tensor is what makes the heads' loss weights
the micro-batch's, not the rank's (`roll_in_documents`). Logged MTP losses are each rank's
mean, averaged, as Megatron-LM logs them: under CP they need not equal CP=1's.

`loss_mask_for_mtp(loss_mask, context)`: the loss mask handed to the model for its MTP heads,
zero at each document's last token, whose label is the next document's first token: rolled
k times, the k-th head's mask is zero wherever its target lies past the document's end,
whatever --eod-mask-loss says (the main head keeps its own mask).

What it does not do: no MTP layers (megatron-core's, with EoD attention in their transformer
layer: layer_spec.py), no loss (megatron-core's process_mtp_loss).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib

import torch

__all__ = ["current", "install", "loss_mask_for_mtp", "roll_in_documents"]

_CONTEXT = contextvars.ContextVar("eod_mtp_context", default=None)
# Where megatron-core looks roll_tensor up: its MTP module, and (<= 0.17) GPTModel's by-name
# import for its own MTP loss.
_TARGETS = ("megatron.core.transformer.multi_token_prediction",
            "megatron.core.models.gpt.gpt_model")
_ORIGINAL = {}


@contextlib.contextmanager
def current(context, mtp_loss_mask):
    """While the model forward of an EoD micro-batch runs: its batch context
    (batch_context.EodBatchContext) and the MTP loss mask handed to the model (this rank's
    part; its sum over the CP group is taken here, one all-reduce, for the count
    `roll_in_documents` returns)."""
    local = mtp_loss_mask.sum()
    total = local.clone()
    if context.cp_group is not None and torch.distributed.get_world_size(context.cp_group) > 1:
        torch.distributed.all_reduce(total, group=context.cp_group)
    token = _CONTEXT.set((context, local, total))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def _layout(context, device):
    """(this rank's stream positions, each local token's successor in its document or -1,
    every CP rank's stream positions in gather order), cached on the context."""
    key = ("mtp", str(device))
    cache = context._rope  # the context's per-micro-batch cache
    if key not in cache:
        plan, group = context.plan, context.cp_group
        rank = 0 if group is None else torch.distributed.get_rank(group)
        size = 1 if group is None else torch.distributed.get_world_size(group)
        owned = [plan.token_index(r).to(torch.int64) for r in range(size)]
        mine = owned[rank]
        cu = plan.cu_seqlens.to(torch.int64).cpu()
        ends = cu[torch.searchsorted(cu, mine, right=True)]
        successor = torch.where(mine + 1 < ends, mine + 1, torch.full_like(mine, -1))
        starts = torch.zeros(int(cu[-1]), dtype=torch.bool)
        starts[cu[:-1]] = True
        cache[key] = (successor.to(device), torch.cat(owned).to(device), int(cu[-1]),
                      starts.to(device))
    return cache[key]


def roll_in_documents(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    """megatron-core's `roll_tensor` (same arguments, (rolled, its sum)) for EoD micro-batches:
    see the module. Any other call (no EoD forward running) is the original's."""
    running = _CONTEXT.get()
    if running is None or tensor is None:
        return _ORIGINAL["roll_tensor"](tensor, shifts, dims, cp_group, packed_seq_params)
    context, mask_here, mask_total = running
    if shifts != -1 or dims not in (-1, tensor.dim() - 1):
        raise ValueError(f"EoD multi-token prediction shifts one token left along the last "
                         f"dimension; megatron-core asked for shifts={shifts}, dims={dims}")
    successor, gathered_positions, total, starts = _layout(context, tensor.device)
    local = tensor.contiguous()
    if local.dtype == torch.bool:  # a padding mask: gathered as bytes
        return tuple(x.bool() if x.dim() else x for x in roll_in_documents(
            local.to(torch.uint8), shifts, dims, cp_group, packed_seq_params))
    group = context.cp_group
    if group is not None and torch.distributed.get_world_size(group) > 1:
        parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, local, group=group)
        local_all = torch.cat(parts, dim=-1)
    else:
        local_all = local
    stream = local.new_zeros(local.shape[:-1] + (total,))
    stream[..., gathered_positions] = local_all
    rolled = stream[..., successor.clamp(min=0)]
    rolled = torch.where(successor >= 0, rolled, torch.zeros_like(rolled))
    # The count: megatron-core weights the k-th head's per-token loss by (the mask's sum
    # before rolling / this count), both this rank's. A rank's share of a micro-batch is not
    # a micro-batch, so the count returned makes that ratio the MICRO-BATCH's, as at CP=1:
    # this rank's part of the mask x the micro-batch's rolled sum / its sum before rolling.
    stream_rolled = stream.masked_fill(starts, 0).sum()
    count = mask_here * stream_rolled / mask_total.clamp(min=1)
    return rolled, count.to(rolled.sum().dtype) if rolled.dtype.is_floating_point else count


def loss_mask_for_mtp(loss_mask, context):
    """`loss_mask` [1, n_local] with each document's last token zeroed (see the module)."""
    successor = _layout(context, loss_mask.device)[0]
    return loss_mask * (successor >= 0).to(loss_mask.dtype).reshape(loss_mask.shape)


def install() -> None:
    """Put `roll_in_documents` where megatron-core looks roll_tensor up. Idempotent."""
    for name in _TARGETS:
        module = importlib.import_module(name)
        found = getattr(module, "roll_tensor", None)
        if found is None or found is roll_in_documents:
            continue
        _ORIGINAL.setdefault("roll_tensor", found)
        module.roll_tensor = roll_in_documents
