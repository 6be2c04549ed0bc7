"""Merge partial attention results with their log-sum-exps.

One job: given the running (out, lse) of some query rows and a new partial (out_i, lse_i)
over more keys, produce the result over all keys:
    lse = log(exp(lse) + exp(lse_i)),  out = out * exp(lse_prev - lse) + out_i * exp(lse_i - lse)
A row that has seen no key yet has lse = -inf and out = 0 and stays so (never NaN, never +inf).

Shape key: T = query rows, H = heads, D = head dim. lse is [T, H], out is [T, H, D].
"""

import torch

__all__ = ["merge_into"]


def merge_into(out_TH: torch.Tensor, lse_TH: torch.Tensor, rows: torch.Tensor,
               part_TH: torch.Tensor, part_lse_TH: torch.Tensor) -> None:
    """In place: fold the partial result of `rows` into the accumulators out/lse."""
    old_lse = lse_TH[rows]
    new_lse = torch.logaddexp(old_lse, part_lse_TH)
    # exp(-inf - -inf) would be NaN: rows still without keys keep weight 0.
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(old_lse - safe).unsqueeze(-1)
    w_new = torch.exp(part_lse_TH - safe).unsqueeze(-1)
    out_TH[rows] = out_TH[rows] * w_old.to(out_TH.dtype) + part_TH.to(out_TH.dtype) * w_new.to(
        out_TH.dtype)
    lse_TH[rows] = new_lse
