"""Merge partial attention results with their log-sum-exps.

One job: given the running (out, lse) of some query rows and a new partial (out_i, lse_i)
over more keys, produce the result over all keys:
    lse = log(exp(lse) + exp(lse_i)),  out = out * exp(lse_prev - lse) + out_i * exp(lse_i - lse)
A row that has seen no key yet has lse = -inf and out = 0 and stays so (never NaN, never +inf).

On CUDA the arithmetic runs as one fused kernel (`torch.compile` of `merged`, dynamic shapes:
the row count changes every ring step) instead of ~10 elementwise launches; set
MEGATRON_EOD_FUSED_MERGE=0 to run it eagerly. If compiling fails (no Triton, an old driver)
it falls back to eager once, with a warning. The gather and scatter of the rows stay indexing.

Shape key: T = query rows, H = heads, D = head dim. lse is [T, H], out is [T, H, D].
"""

import os
import warnings

import torch

__all__ = ["merge_into", "merged"]

_FUSED = {"fn": None, "failed": False}


def merged(out_TH, lse_TH, part_TH, part_lse_TH):
    """-> (out, lse) over both key sets, in out's and lse's dtypes."""
    new_lse = torch.logaddexp(lse_TH, part_lse_TH)
    # exp(-inf - -inf) would be NaN: rows still without keys keep weight 0.
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse_TH - safe).unsqueeze(-1).to(out_TH.dtype)
    w_new = torch.exp(part_lse_TH - safe).unsqueeze(-1).to(out_TH.dtype)
    return out_TH * w_old + part_TH.to(out_TH.dtype) * w_new, new_lse


def _fused_merged():
    if _FUSED["fn"] is None:
        _FUSED["fn"] = torch.compile(merged, dynamic=True)
    return _FUSED["fn"]


def merge_into(out_TH: torch.Tensor, lse_TH: torch.Tensor, rows: torch.Tensor,
               part_TH: torch.Tensor, part_lse_TH: torch.Tensor, fused=None) -> None:
    """In place: fold the partial result of `rows` into the accumulators out/lse. `fused`:
    None = on CUDA unless MEGATRON_EOD_FUSED_MERGE=0."""
    if fused is None:
        fused = out_TH.is_cuda and os.environ.get("MEGATRON_EOD_FUSED_MERGE", "1") != "0"
    args = (out_TH[rows], lse_TH[rows], part_TH, part_lse_TH)
    new_out, new_lse = None, None
    if fused and not _FUSED["failed"]:
        try:
            new_out, new_lse = _fused_merged()(*args)
        except Exception as error:  # noqa: BLE001 - any compiler failure: run eagerly
            _FUSED["failed"] = True
            warnings.warn(f"fused log-sum-exp merge unavailable ({type(error).__name__}: "
                          f"{error}); merging eagerly")
    if new_out is None:
        new_out, new_lse = merged(*args)
    out_TH[rows] = new_out
    lse_TH[rows] = new_lse
