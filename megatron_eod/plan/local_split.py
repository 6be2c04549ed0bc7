"""A group's local call as two calls, for running them side by side on a GPU.

One job: split the local causal call of a group (one sequence per run of the group's pieces of
a document, over the local rows in order) at a sequence boundary into two calls over two runs
of rows, and say which to launch first.

Why: a varlen flash kernel is a grid of blocks with the head slowest, so the last head's
longest blocks (the last query blocks of the longest document; in the backward, its first key
blocks) start near the end of the call and run on alone: a tail that weighs more the less
work a call has, which is the case of a CP rank's call (tools/dispatch_model.py). Launched
first on one CUDA stream, the part holding the longest document starts its longest blocks
earlier, and the other part, launched after on another stream (the call over received keys
between them), fills the slots its tail leaves idle. The dispatch model puts the busiest ring
rank's kernels at 1.05-1.09x the ideal with this split against 1.12-1.19x for the two calls
side by side and 1.17-1.28x in sequence (docs/BENCHMARKS.md); a model, not a measurement.

The rule (host work, O(sequences)): the first part is the side of the longest sequence, that
sequence included, holding fewer pairs: the rows up to and including it, or the rows from it
on. A call of one sequence is not split. Nothing else about the call changes: each part's
sequences are the same runs of rows, so the two parts compute exactly the local call's pairs,
and each reads and writes its own run of rows (q, k, v, out and their gradients as slices).

What it does not do: no streams, no choice of whether to split (attention/batched.py runs the
parts side by side when asked to and the kernel writes into given tensors).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import numpy as np
import torch

from megatron_eod.plan.cost import doc_pairs
from megatron_eod.plan.kv_schedule import GroupSchedule, KernelCall, make_call

__all__ = ["split_local_call", "with_local_parts"]


def _part(lengths: np.ndarray, start: int) -> KernelCall:
    """A causal call of sequences `lengths` over the rows from `start` on (cu_seqlens count
    from 0: the attention passes it the slice of rows)."""
    rows = np.arange(start, start + int(lengths.sum()), dtype=np.int64)
    return make_call(lengths, lengths, rows, rows, causal=True)


def split_local_call(local: KernelCall) -> Optional[Tuple[KernelCall, KernelCall]]:
    """(first, then): the local call in two (see the module), or None for a call of fewer
    than two sequences. `local` must be a local call as kv_schedule.local_call makes it
    (causal, queries = keys = the local rows in order) with its index tensors on the host."""
    if not local.causal or local.q_span != local.k_span or \
            not torch.equal(local.cu_seqlens_q, local.cu_seqlens_k):
        raise ValueError("split_local_call takes a group's local call (causal, over the "
                         "local rows in place), not a call over received keys")
    cu = local.cu_seqlens_q.numpy().astype(np.int64)
    lengths = np.diff(cu)
    if lengths.size < 2:
        return None
    longest = int(np.argmax(lengths))
    pairs = np.cumsum(doc_pairs(lengths))
    before = int(pairs[longest])  # pairs of the rows up to and including it
    after = int(pairs[-1] - (pairs[longest - 1] if longest else 0))  # of the rows from it on
    # A side that is the whole call is no split: the other side is then the one.
    if longest == lengths.size - 1 or (longest > 0 and after < before):
        cut = longest  # first = the sequences from the longest on
        first, then = _part(lengths[cut:], int(cu[cut])), _part(lengths[:cut], 0)
    else:
        cut = longest + 1  # first = the sequences up to and including the longest
        first, then = _part(lengths[:cut], 0), _part(lengths[cut:], int(cu[cut]))
    return first, then


def with_local_parts(schedule: GroupSchedule) -> GroupSchedule:
    """The schedule with its local call's two parts (host tensors), where it splits."""
    return dataclasses.replace(schedule, local_parts=split_local_call(schedule.local))
