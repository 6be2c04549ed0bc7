"""Place the documents of a packed stream on CP groups: the planner's choice among layouts.

One job: try a few layouts, keep those that are exact and balanced, and return the one that
makes the busiest group receive the fewest key/value tokens. Every group gets exactly N/R
tokens; balance is always within `cost.balance_bound` because the sweep (sweep.py), which
never fails and is balanced by construction, is always among the candidates.

Candidates, in this order (ties go to the earlier one):
  sweep                the reference layout; always tried, always valid
  sweep, head cuts     the sweep cutting documents of any length head-first at its sparse end
                       (fewer keys on rows of a few long documents; may land off balance)
  pack(spread, filler) whole-document packing (pack.py) with three settings
The others are tried only where their host work stays small (`_OPTIMIZE_LIMITS`: at most
32 groups and 2,048 documents, the packer placing documents one by one) and where the sweep
leaves something to gain (its busiest group receives more than 1% of a share of tokens), so
planning cost never grows with documents x CP. They are kept only within ACCEPT_BALANCE
(stricter than the bound: balance comes first). Every rank makes the same choice.

What it does not do: no key/value schedule (kv_schedule.py), no padding ever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np

from megatron_eod.plan.cost import balance_bound, doc_pairs, group_kv_received, group_pairs
from megatron_eod.plan.pack import pack_documents
from megatron_eod.plan.pieces import Pieces
from megatron_eod.plan.sweep import sweep_documents

__all__ = ["Placement", "partition_documents", "ACCEPT_BALANCE"]

ACCEPT_BALANCE = 1.005  # a candidate other than the sweep must keep max/mean pairs this low
_OPTIMIZE_LIMITS = dict(max_groups=32, max_documents=2048, min_gain=0.01)
_PACK_SETTINGS = ((0.9, 0.05), (0.9, 0.2), (0.6, 0.2))  # (spread, filler_fraction)


@dataclass(frozen=True)
class Placement:
    pieces: Pieces
    planner: str  # the candidate that was chosen
    tried: Tuple[Tuple[str, str], ...]  # (candidate, its outcome) in the order tried


def _optimizers(cu: np.ndarray, groups: int) -> List[Tuple[str, Callable[[], Optional[Pieces]]]]:
    """The candidates besides the sweep, where they are cheap enough to try."""
    if not 1 < groups <= _OPTIMIZE_LIMITS["max_groups"] or \
            cu.size - 1 > _OPTIMIZE_LIMITS["max_documents"]:
        return []
    out = [("sweep, head cuts", lambda: sweep_documents(cu, groups, float("inf")))]
    for spread, filler in _PACK_SETTINGS:
        out.append((f"pack(spread={spread}, filler={filler})",
                    lambda s=spread, f=filler: pack_documents(cu, groups, s, f)))
    return out


def _not_a_partition(pieces: Pieces, cu: np.ndarray, share_tokens: int) -> str:
    """What is wrong with a candidate's pieces ("" if nothing): every group exactly a share
    of tokens, every piece inside its document, no token held twice."""
    if pieces.group.size and (pieces.group.min() < 0 or pieces.group.max() >= pieces.groups):
        return "group index out of range"
    if not (pieces.tokens_per_group() == share_tokens).all():
        return "token counts are not exact"
    if not ((pieces.start >= cu[pieces.doc]) & (pieces.end <= cu[pieces.doc + 1])).all():
        return "a piece crosses a document boundary"
    order = np.argsort(pieces.start, kind="stable")
    if (pieces.start[order][1:] < pieces.end[order][:-1]).any():
        return "a token is held twice"
    return ""


def partition_documents(cu_seqlens, groups: int) -> Placement:
    """The placement of the stream described by `cu_seqlens` on `groups` groups."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    sweep = sweep_documents(cu, groups)
    optimizers = _optimizers(cu, groups)
    if not optimizers:
        return Placement(sweep, "sweep", (("sweep", "chosen"),))
    share_tokens = int(cu[-1]) // groups
    lengths = np.diff(cu)
    mean = int(doc_pairs(lengths).sum()) / groups
    received = int(group_kv_received(sweep).max())
    best = ((received, int(group_pairs(sweep).max())), "sweep", sweep)
    tried = [("sweep", f"busiest group receives {received} tokens")]
    if received <= _OPTIMIZE_LIMITS["min_gain"] * share_tokens:
        return Placement(sweep, "sweep", tuple(tried))
    limit = min(balance_bound(mean, int(lengths.max())), ACCEPT_BALANCE * mean)
    for name, make in optimizers:
        try:  # a bug in an optimizer must not stop training: it is reported, the sweep stays
            pieces = make()
            if pieces is None:
                tried.append((name, "not applicable"))
                continue
            problem = _not_a_partition(pieces, cu, share_tokens)
            if problem:
                tried.append((name, f"failed: {problem}"))
                continue
            pairs = group_pairs(pieces)
            if pairs.max() > limit:
                tried.append((name, f"off balance ({pairs.max() / mean:.4f})"))
                continue
            key = (int(group_kv_received(pieces).max()), int(pairs.max()))
        except Exception as error:
            tried.append((name, f"failed: {type(error).__name__}: {error}"))
            continue
        tried.append((name, f"busiest group receives {key[0]} tokens"))
        if key < best[0]:
            best = (key, name, pieces)
    return Placement(best[2], best[1], tuple(tried))
