"""The float64 oracle: dense, document-masked causal attention over the whole stream.

Every multi-rank attention test compares each rank's rows (and their q/k/v gradients) with
this single-process computation on the full batch. Deliberately naive: a dense [N, N] mask
from the documents, key/value heads repeated for GQA, softmax in float64. Also the random
layouts the tests draw, and a plan schedule with its row runs forgotten (every row by index).
"""

import dataclasses

import torch

__all__ = ["dense_document_attention", "random_layout_tokens", "schedule_without_spans"]


def dense_document_attention(q_NHD, k_NGD, v_NGD, cu_seqlens, softmax_scale):
    n = q_NHD.shape[0]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc_N = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    idx = torch.arange(n)
    allowed_NN = (doc_N[:, None] == doc_N[None, :]) & (idx[None, :] <= idx[:, None])
    rep = q_NHD.shape[1] // k_NGD.shape[1]
    k_NHD, v_NHD = k_NGD.repeat_interleave(rep, 1), v_NGD.repeat_interleave(rep, 1)
    scores_HNN = torch.einsum("qhd,khd->hqk", q_NHD, k_NHD) * softmax_scale
    scores_HNN = scores_HNN.masked_fill(~allowed_NN, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores_HNN.softmax(-1), v_NHD)


def random_layout_tokens(kind, b, s, eod, seed):
    """Token ids [b, s] whose EoDs make the layouts the tests need.

    "mixed": random EoDs, runs of EoDs (1-token documents), one row without any EoD;
    "spanning": no EoD at all (one document per row; with b=1 it spans every rank);
    "short": very frequent EoDs (mostly 1- and 2-token documents).
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, eod, (b, s), generator=gen)
    if kind == "spanning":
        return tokens
    p = {"mixed": 0.04, "short": 0.5}[kind]
    tokens[torch.rand(b, s, generator=gen) < p] = eod
    if kind == "mixed":
        start = int(torch.randint(0, s - 4, (1,), generator=gen))
        tokens[0, start:start + 3] = eod  # consecutive EoDs: 1-token documents
        if b > 1:
            tokens[b - 1] = torch.randint(0, eod, (s,), generator=gen)  # a row with no EoD
    return tokens


def schedule_without_spans(schedule):
    """The same schedule with every row run forgotten: all rows by index (gathers); but the
    batched call's keys, which are its receive buffer by construction (kv_batched.py)."""
    strip = lambda call: dataclasses.replace(call, q_span=None, k_span=None)  # noqa: E731
    batched = schedule.batched
    if batched is not None:
        call = batched.call
        batched = dataclasses.replace(batched, send_span=None, call=None if call is None else
                                      dataclasses.replace(call, q_span=None))
    return dataclasses.replace(schedule, batched=batched, steps=tuple(
        dataclasses.replace(step, send_span=None,
                            call=None if step.call is None else strip(step.call))
        for step in schedule.steps))
