"""Megatron's GPT step functions with EoD reset under context parallelism.

One job: the functions a Megatron pretraining loop calls per micro-batch, with Megatron's
signatures and semantics, built on `slice_batch_for_cp`:

    steps = EodGPTSteps(eod_token_id, registry, seq_length, micro_batch_size, ...)
    steps.get_batch(data_iterator)        # TP broadcast -> EoD layout + CP plan -> LocalBatch
    steps.forward_step(data_iterator, model)   # for megatron-core's pipeline schedules
    steps.loss_func(loss_mask, output_tensor)  # (loss sum, tokens, {"lm loss": [sum, tokens]})
    is_dataset_built_on_rank()            # TP rank 0 of EVERY pipeline stage

Every pipeline stage reads the micro-batch (tokens are needed everywhere: the plan decides
which tokens a rank holds and every layer's attention needs it), so the data iterator lives
on TP rank 0 of every stage and the tokens are broadcast inside the TP group. The layout and
plan are made BEFORE any middle-stage early return: every stage gets position ids and the
plan. The loss is per token: `loss_func` returns the masked loss SUM and the token count
(megatron-core's `calculate_per_token_loss` mode), so the schedule and
`finalize_model_grads` divide by the tokens of the whole global batch across DP and CP
ranks, which makes the loss and gradients independent of how tokens are spread.

What it does not do: no dataset building, no optimizer, no logging (megatron_eod/training).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megatron_eod.megatron.batch import LocalBatch, slice_batch_for_cp
from megatron_eod.megatron.imports import import_megatron

__all__ = ["EodGPTSteps", "is_dataset_built_on_rank"]

_KEYS = ("tokens", "labels", "loss_mask")


def _ps():
    return import_megatron("megatron.core.parallel_state")


def is_dataset_built_on_rank() -> bool:
    """Datasets (and data iterators) live on TP rank 0 of every pipeline stage."""
    return _ps().get_tensor_model_parallel_rank() == 0


class EodGPTSteps:
    def __init__(self, eod_token_id: int, registry, seq_length: int, micro_batch_size: int,
                 algo: str = "ring", ulysses_degree: Optional[int] = None,
                 reset_position_ids: bool = True, reset_attention_mask: bool = True,
                 eod_mask_loss: bool = False, pad_token_id: Optional[int] = None,
                 device: Optional[torch.device] = None):
        self.eod, self.registry = eod_token_id, registry
        self.shape = (micro_batch_size, seq_length)
        self.algo, self.ulysses_degree = algo, ulysses_degree
        self.flags = dict(reset_position_ids=reset_position_ids,
                          reset_attention_mask=reset_attention_mask,
                          eod_mask_loss=eod_mask_loss, pad_token_id=pad_token_id)
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.pairs_seen = 0  # causal pairs a document mask needs, summed over micro-batches

    def _broadcast(self, data_iterator):
        """TP rank 0 reads the next micro-batch; every TP rank gets tokens/labels/loss_mask."""
        ps = _ps()
        tensors = {}
        if ps.get_tensor_model_parallel_rank() == 0:
            if data_iterator is None:
                raise ValueError("get_batch: TP rank 0 of every pipeline stage needs a data "
                                 "iterator (build datasets where is_dataset_built_on_rank())")
            sample = next(data_iterator)
            for key in _KEYS:
                t = sample[key]
                if tuple(t.shape) != self.shape:
                    raise ValueError(f"get_batch: {key} has shape {tuple(t.shape)}, expected "
                                     f"[--micro-batch-size, --seq-length] = {list(self.shape)}")
                tensors[key] = t.to(self.device, torch.float32 if key == "loss_mask"
                                    else torch.int64)
        if ps.get_tensor_model_parallel_world_size() > 1:
            group, src = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()
            for key in _KEYS:
                if key not in tensors:
                    tensors[key] = torch.empty(self.shape, device=self.device, dtype=(
                        torch.float32 if key == "loss_mask" else torch.int64))
                dist.broadcast(tensors[key], src=src, group=group)
        return tensors

    def get_batch(self, data_iterator) -> LocalBatch:
        ps = _ps()
        data = self._broadcast(data_iterator)
        cp_size = ps.get_context_parallel_world_size()
        batch = slice_batch_for_cp(
            data["tokens"], data["labels"], self.eod, self.registry, cp_size=cp_size,
            cp_rank=ps.get_context_parallel_rank(),
            cp_group=ps.get_context_parallel_group() if cp_size > 1 else None,
            algo=self.algo if cp_size > 1 else "ring",
            ulysses_degree=self.ulysses_degree if self.algo == "hybrid" and cp_size > 1
            else None, loss_mask=data["loss_mask"], **self.flags)
        self.pairs_seen += batch.plan.pairs_needed()
        # Middle pipeline stages use only the plan (via attention_mask) and never the labels;
        # they still got everything, so no stage lacks position ids or the plan.
        return batch

    def loss_func(self, loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        """Per-token losses [1, n] -> (masked sum, token count, {"lm loss": [sum, count]})."""
        losses = output_tensor.float().reshape(-1)
        mask = loss_mask.reshape(-1).float()
        loss_sum = torch.sum(losses * mask)
        num_tokens = mask.sum().to(torch.int)
        report = torch.stack([loss_sum.detach().clone(), mask.sum()])
        return loss_sum, num_tokens, {"lm loss": report}

    def forward_step(self, data_iterator, model):
        batch = self.get_batch(data_iterator)
        output = model(batch.tokens, batch.position_ids, batch.attention_mask,
                       labels=batch.labels)
        return output, partial(self.loss_func, batch.loss_mask)
