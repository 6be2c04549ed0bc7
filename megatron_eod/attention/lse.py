"""Merge partial attention results with their log-sum-exps.

One job: given the running (out, lse) of some query rows and a new partial (out_i, lse_i)
over more keys, produce the result over all keys:
    lse = log(exp(lse) + exp(lse_i)),  out = out * exp(lse_prev - lse) + out_i * exp(lse_i - lse)
A row that has seen no key yet has lse = -inf and out = 0 and stays so (never NaN, never +inf).

The merge updates the rows in place: by index (gather, arithmetic, scatter) or, when the
rows are one run known at planning time (`span`), on slices (no gather, no scatter). On CUDA
each runs as one `torch.compile`d function (dynamic shapes: the row count changes every ring
step), so gather, arithmetic and scatter fuse instead of ~15 launches; set
MEGATRON_EOD_FUSED_MERGE=0 to run it eagerly. If compiling fails (no Triton, an old driver)
it falls back to eager once, with a warning.

Shape key: T = query rows, H = heads, D = head dim. lse is [T, H], out is [T, H, D].
"""

import os
import warnings

import torch

__all__ = ["merge_into", "merged"]

_FUSED = {"rows": None, "span": None, "failed": False}


def merged(out_TH, lse_TH, part_TH, part_lse_TH):
    """-> (out, lse) over both key sets, in out's and lse's dtypes."""
    new_lse = torch.logaddexp(lse_TH, part_lse_TH)
    # exp(-inf - -inf) would be NaN: rows still without keys keep weight 0.
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse_TH - safe).unsqueeze(-1).to(out_TH.dtype)
    w_new = torch.exp(part_lse_TH - safe).unsqueeze(-1).to(out_TH.dtype)
    return out_TH * w_old + part_TH.to(out_TH.dtype) * w_new, new_lse


def _merge_rows(out_TH, lse_TH, rows, part_TH, part_lse_TH):
    new_out, new_lse = merged(out_TH[rows], lse_TH[rows], part_TH, part_lse_TH)
    out_TH[rows] = new_out
    lse_TH[rows] = new_lse


def _merge_span(out_TH, lse_TH, part_TH, part_lse_TH):
    """out_TH, lse_TH: slices (views) of the accumulators, updated in place."""
    new_out, new_lse = merged(out_TH, lse_TH, part_TH, part_lse_TH)
    out_TH.copy_(new_out)
    lse_TH.copy_(new_lse)


_EAGER = {"rows": _merge_rows, "span": _merge_span}


def _fused(kind):
    if _FUSED[kind] is None:
        _FUSED[kind] = torch.compile(_EAGER[kind], dynamic=True)
    return _FUSED[kind]


def merge_into(out_TH: torch.Tensor, lse_TH: torch.Tensor, rows: torch.Tensor,
               part_TH: torch.Tensor, part_lse_TH: torch.Tensor, span=None,
               fused=None) -> None:
    """In place: fold the partial result of `rows` into the accumulators out/lse. `span`:
    (start, stop) when rows is that run. `fused`: None = on CUDA unless
    MEGATRON_EOD_FUSED_MERGE=0."""
    if fused is None:
        fused = out_TH.is_cuda and os.environ.get("MEGATRON_EOD_FUSED_MERGE", "1") != "0"
    if span is not None:
        kind, args = "span", (out_TH[span[0]:span[1]], lse_TH[span[0]:span[1]], part_TH,
                              part_lse_TH)
    else:
        kind, args = "rows", (out_TH, lse_TH, rows, part_TH, part_lse_TH)
    if fused and not _FUSED["failed"]:
        try:
            _fused(kind)(*args)
            return
        except Exception as error:  # noqa: BLE001 - any compiler failure: run eagerly
            _FUSED["failed"] = True
            warnings.warn(f"fused log-sum-exp merge unavailable ({type(error).__name__}: "
                          f"{error}); merging eagerly")
    _EAGER[kind](*args)
