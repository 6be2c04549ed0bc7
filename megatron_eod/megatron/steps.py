"""Megatron's GPT step functions with EoD reset under context parallelism.

One job: the functions a Megatron pretraining loop calls per micro-batch, with Megatron's
signatures and semantics, built on batch.py (`plan_batch`, `local_batch`) and, by default,
plan_ahead.py (each stream read and planned one micro-batch early on a worker thread):

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

import time
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megatron_eod.megatron import mtp
from megatron_eod.megatron.batch import LocalBatch, local_batch, plan_batch
from megatron_eod.megatron.imports import import_megatron
from megatron_eod.megatron.plan_ahead import PlanAhead, ReadFailed, header_size, read_or_failure

__all__ = ["EodGPTSteps", "is_dataset_built_on_rank"]

_KEYS = ("tokens", "labels", "loss_mask")
# doc_starts: 1 where a document starts, from the dataset's own document boundaries
# (Megatron-LM's --dataloader-inter-document-masking; its samples' cu_seqlens).
_DTYPES = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
           "doc_starts": torch.int64}


def _ps():
    return import_megatron("megatron.core.parallel_state")


def _rows(batch) -> int:
    return batch["tokens"].shape[0]


def _add_host_tokens(batch) -> None:
    """A CPU copy of the batch's tokens (and document starts) for the planner thread. On a
    GPU it is started without a host sync; the thread waits on the `tokens_ready` event, not
    the step."""
    names = [key for key in ("tokens", "doc_starts") if key in batch]
    if batch["tokens"].device.type == "cpu":
        batch.update({f"{key}_cpu": batch[key] for key in names})
        return
    for key in names:
        host = torch.empty(batch[key].shape, dtype=batch[key].dtype, pin_memory=True)
        host.copy_(batch[key], non_blocking=True)
        batch[f"{key}_cpu"] = host
    ready = torch.cuda.Event()
    ready.record()
    batch["tokens_ready"] = ready


def _doc_starts(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """[rows, S] 1 where a document starts, from GPTDataset's per-row cu_seqlens [rows, S+1]
    (padded with S past its last document)."""
    cu = cu_seqlens.long()
    starts = torch.zeros(cu.shape[0], seq_length, dtype=torch.int64)
    rows, at = torch.nonzero(cu < seq_length, as_tuple=True)
    starts[rows, cu[rows, at]] = 1
    return starts


def _worker_init(device: torch.device):
    """The plan-ahead thread's start: on a GPU, this rank's device (a CUDA call from a thread
    that never selected one would create a context on GPU 0)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return lambda: torch.cuda.set_device(index)


def is_dataset_built_on_rank() -> bool:
    """Datasets (and data iterators) live on TP rank 0 of every pipeline stage."""
    return _ps().get_tensor_model_parallel_rank() == 0


class EodGPTSteps:
    def __init__(self, eod_token_id: int, registry, seq_length: int, micro_batch_size: int,
                 algo: str = "ring", ulysses_degree: Optional[int] = None,
                 reset_position_ids: bool = True, reset_attention_mask: bool = True,
                 eod_mask_loss: bool = False, pad_token_id: Optional[int] = None,
                 device: Optional[torch.device] = None, plan_ahead: bool = True,
                 eval_micro_batch_size: Optional[int] = None,
                 one_row_evaluation: bool = False, fused_tiles: bool = False,
                 documents_from_index: bool = False, mtp: bool = False):
        self.eod, self.registry = eod_token_id, registry
        self.mtp = mtp  # the model has multi-token prediction heads (--mtp-num-layers)
        self.seq_length = seq_length
        # Rows a micro-batch may have: training's, and evaluation's where Megatron-LM (>= 0.18,
        # --eval-micro-batch-size) reads validation and test data in other micro-batches.
        self.rows = {micro_batch_size: "--micro-batch-size"}
        if eval_micro_batch_size not in (None, micro_batch_size):
            self.rows[eval_micro_batch_size] = "--eval-micro-batch-size"
        if one_row_evaluation:  # Megatron-LM >= 0.19's --full-validation: 1 sequence each
            self.rows.setdefault(1, "--full-validation's one sequence")
        self.algo, self.ulysses_degree = algo, ulysses_degree
        # fused_tiles: the plans carry the fused kernels' tiles (--cp-fused-forward's layer
        # spec needs them; the attention refuses a plan without them).
        self.flags = dict(reset_position_ids=reset_position_ids,
                          reset_attention_mask=reset_attention_mask,
                          eod_mask_loss=eod_mask_loss, pad_token_id=pad_token_id,
                          fused_tiles=fused_tiles)
        # documents_from_index: the samples' own cu_seqlens cut the documents, not the EoD
        # tokens (--dataloader-inter-document-masking).
        self.keys = _KEYS + (("doc_starts",) if documents_from_index else ())
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.plan_ahead = plan_ahead
        self.last_plan = None  # the plan of the micro-batch get_batch returned last
        self._ahead: Optional[PlanAhead] = None
        self._waited_now = 0.0

    @property
    def plan_wait_s(self) -> float:
        """Seconds get_batch has waited for plans so far (the step's cost of planning)."""
        return self._waited_now + (self._ahead.waited_s if self._ahead else 0.0)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()

    def _read(self, data_iterator):
        """TP source rank: the next micro-batch (device tensors + CPU tokens) or None."""
        if data_iterator is None:
            raise ValueError("get_batch: TP rank 0 of every pipeline stage needs a data "
                             "iterator (build datasets where is_dataset_built_on_rank())")
        try:
            sample = next(data_iterator)
        except StopIteration:
            return None
        batch = {}
        rows = tuple(sample["tokens"].shape)[0] if sample["tokens"].dim() == 2 else None
        if "doc_starts" in self.keys:
            if "cu_seqlens" not in sample:
                raise ValueError("get_batch: --dataloader-inter-document-masking needs the "
                                 "samples' cu_seqlens (a GPTDataset built with "
                                 "inter_document_masking)")
            sample = {**sample, "doc_starts": _doc_starts(sample["cu_seqlens"], self.seq_length)}
        for key in self.keys:
            t = sample[key]
            if rows not in self.rows or tuple(t.shape) != (rows, self.seq_length):
                expected = " or ".join(f"[{flag}, --seq-length] = [{n}, {self.seq_length}]"
                                       for n, flag in self.rows.items())
                raise ValueError(f"get_batch: {key} has shape {tuple(t.shape)}, expected "
                                 f"{expected}")
            # Not blocking: a blocking copy would drain the device's queue per micro-batch.
            batch[key] = t.to(self.device, _DTYPES[key], non_blocking=True)
        batch["tokens_cpu"] = sample["tokens"].to("cpu", torch.int64)
        if "doc_starts" in sample:
            batch["doc_starts_cpu"] = sample["doc_starts"]
        return batch

    def _share(self, header, batches):
        """The TP source's header and batches on every TP rank (one small header broadcast,
        then three tensors per batch read)."""
        ps = _ps()
        if ps.get_tensor_model_parallel_world_size() == 1:
            return header, batches
        group, src = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()
        head = torch.tensor(header if header else [0] * PlanAhead.HEADER_SIZE,
                            dtype=torch.int64).to(self.device)
        dist.broadcast(head, src=src, group=group)
        header = head.tolist()  # the host needs it to know what follows (as Megatron's own
        source = ps.get_tensor_model_parallel_rank() == 0  # get_batch, which sends sizes)
        shared = []
        for i, rows in enumerate(PlanAhead.batches_in(header)):
            if rows <= 0:  # the stream's end, or a read that failed on the source
                shared.append(None if rows == 0 else batches[i] if source else ReadFailed())
                continue
            batch = batches[i] if source else {key: torch.empty(
                (rows, self.seq_length), device=self.device, dtype=_DTYPES[key])
                for key in self.keys}
            for key in self.keys:
                dist.broadcast(batch[key], src=src, group=group)
            if not source:
                _add_host_tokens(batch)
            shared.append(batch)
        return header, shared

    def _plan(self, batch):
        """Host work for one micro-batch (runs on the plan-ahead worker thread)."""
        ready = batch.get("tokens_ready")
        if ready is not None:
            ready.synchronize()
        # Without context parallelism every algorithm is the plain local call.
        algo, degree = (self.algo, self.ulysses_degree) if self._cp["size"] > 1 else ("ring",
                                                                                     None)
        return plan_batch(batch["tokens_cpu"], self.eod, self._cp["size"], self._cp["rank"],
                          algo, degree, doc_starts=batch.get("doc_starts_cpu"), **self.flags)

    def get_batch(self, data_iterator) -> LocalBatch:
        ps = _ps()
        if not hasattr(self, "_cp"):  # parallel state exists from here on
            cp_size = ps.get_context_parallel_world_size()
            self._cp = {"size": cp_size, "rank": ps.get_context_parallel_rank(),
                        "group": ps.get_context_parallel_group() if cp_size > 1 else None}
        source = ps.get_tensor_model_parallel_rank() == 0
        if self.plan_ahead:
            if self._ahead is None:
                self._ahead = PlanAhead(self._read, self._share, self._plan, source,
                                        _worker_init(self.device), size=_rows)
            data, planned = self._ahead.next(data_iterator)
        else:
            # A failed read is shared too: TP peers must not wait for its batch.
            read = [read_or_failure(self._read, data_iterator)] if source else []
            flags = [header_size(r, _rows) for r in read] or [0]
            _, (data,) = self._share([0, 0, -1, 1] + flags + [0, -1, 0], read)
            if data is None:
                raise StopIteration
            if isinstance(data, ReadFailed):
                data.raise_()
            start = time.perf_counter()
            planned = self._plan(data)
            self._waited_now += time.perf_counter() - start
        batch = local_batch(planned, data["tokens"], data["labels"], self.registry,
                            self._cp["group"], loss_mask=data["loss_mask"])
        self.last_plan = batch.plan
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
        if not self.mtp:
            output = model(batch.tokens, batch.position_ids, batch.attention_mask,
                           labels=batch.labels)
            return output, partial(self.loss_func, batch.loss_mask)
        # Multi-token prediction: megatron-core's MTP heads shift within documents while this
        # forward runs, and get a loss mask that ends each document (megatron/mtp.py).
        context = self.registry.lookup(batch.attention_mask)
        mtp_loss_mask = mtp.loss_mask_for_mtp(batch.loss_mask, context)
        with mtp.current(context, mtp_loss_mask):
            output = model(batch.tokens, batch.position_ids, batch.attention_mask,
                           labels=batch.labels, loss_mask=mtp_loss_mask)
        return output, partial(self.loss_func, batch.loss_mask)
