"""`plan_context_parallel`: the CP plan every rank computes identically from `cu_seqlens`.

One job: validate the arguments, place the stream on groups (partition.py), build each
group's schedule (kv_schedule.py) and expose what ranks and the attention need:
`token_index(rank)` and `schedule(rank)`, plus `stats()` for benchmarks and tests.

Ranks and groups: `ulysses_degree` u ranks that are consecutive in the CP group form one
Ulysses group; the R = cp/u groups form the ring (Ring: u = 1; Ulysses: u = cp, R = 1;
Hybrid: anything between). Group g holds its pieces' tokens in local order; its u ranks hold
consecutive equal shards of that list, and the Ulysses all-to-all reassembles it.

What it does not do: no communication, no device work (tensors are built on the CPU;
`CPPlan.to(device)` moves them once per micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from megatron_eod.plan.cost import doc_pairs
from megatron_eod.plan.kv_schedule import GroupSchedule, build_schedules
from megatron_eod.plan.partition import Pieces, partition_documents

__all__ = ["ALGORITHMS", "CPPlan", "plan_context_parallel"]

ALGORITHMS = ("ring", "ulysses", "hybrid")


@dataclass(frozen=True)
class CPPlan:
    algo: str
    cp_size: int
    ulysses_degree: int
    num_tokens: int
    cu_seqlens: torch.Tensor  # int32, the global document offsets (CPU)
    pieces: Pieces = field(repr=False)
    schedules: Tuple[GroupSchedule, ...] = field(repr=False)

    @property
    def ring_size(self) -> int:
        return self.cp_size // self.ulysses_degree

    def group_of(self, rank: int) -> int:
        """The ring group (Ulysses group index) of a CP rank."""
        self._check_rank(rank)
        return rank // self.ulysses_degree

    def token_index(self, rank: int) -> torch.Tensor:
        """int64 [b*s // cp]: stream positions this rank holds, in its local order."""
        self._check_rank(rank)
        group, shard = divmod(rank, self.ulysses_degree)
        tokens = torch.from_numpy(self.pieces.token_index(group))
        per_rank = self.num_tokens // self.cp_size
        return tokens[shard * per_rank:(shard + 1) * per_rank]

    def schedule(self, rank: int) -> GroupSchedule:
        return self.schedules[self.group_of(rank)]

    def to(self, device) -> "CPPlan":
        """The plan with every schedule tensor on `device` (call once per micro-batch)."""
        return CPPlan(self.algo, self.cp_size, self.ulysses_degree, self.num_tokens,
                      self.cu_seqlens, self.pieces,
                      tuple(s.to(device) for s in self.schedules))

    def pairs_needed(self) -> int:
        """Causal query-key pairs a document mask needs over the whole micro-batch."""
        return int(doc_pairs(np.diff(self.cu_seqlens.numpy())).sum())

    def stats(self) -> Dict[str, object]:
        """Yardsticks, per CP rank, for one attention layer's forward:

        pairs_per_rank: query-key token pairs the rank evaluates per head (a Hybrid/Ulysses
            rank evaluates its whole group's pairs for its heads);
        kv_tokens_received_per_rank: key/value tokens received from other ranks in the ring
            exchange (for Hybrid, for the rank's heads);
        ulysses_tokens_received_per_rank: tokens received in the input all-to-all;
        pairs_needed: pairs a document mask needs; wasted_pairs_ratio: evaluated / needed
            (per head and head group); padding_tokens: always 0.
        """
        u = self.ulysses_degree
        group_pairs = [s.pairs for s in self.schedules]
        pairs = [group_pairs[r // u] for r in range(self.cp_size)]
        kv = [self.schedules[r // u].kv_tokens_received for r in range(self.cp_size)]
        per_rank = self.num_tokens // self.cp_size
        needed = self.pairs_needed()
        return {
            "pairs_per_rank": pairs,
            "kv_tokens_received_per_rank": kv,
            "ulysses_tokens_received_per_rank": [per_rank * (u - 1)] * self.cp_size,
            "pairs_needed": needed,
            "wasted_pairs_ratio": sum(group_pairs) / needed if needed else 1.0,
            "balance": max(group_pairs) / (sum(group_pairs) / len(group_pairs)),
            "padding_tokens": 0,
        }

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.cp_size}), got {rank}")


def _validate(cu_seqlens, cp_size, algo, ulysses_degree) -> Tuple[torch.Tensor, int]:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size (--context-parallel-size) must be a positive int, got "
                         f"{cp_size!r}")
    if algo not in ALGORITHMS:
        raise ValueError(f"algo (--context-parallel-algo) must be one of {ALGORITHMS}, got "
                         f"{algo!r}")
    if algo == "ring":
        if ulysses_degree not in (None, 1):
            raise ValueError(f"ulysses_degree must be None or 1 for algo='ring', got "
                             f"{ulysses_degree}")
        u = 1
    elif algo == "ulysses":
        if ulysses_degree not in (None, cp_size):
            raise ValueError(f"ulysses_degree must be None or cp_size ({cp_size}) for "
                             f"algo='ulysses', got {ulysses_degree}")
        u = cp_size
    else:
        if ulysses_degree is None:
            raise ValueError("algo='hybrid' needs ulysses_degree (--ulysses-degree-in-cp)")
        u = ulysses_degree
        if isinstance(u, bool) or not isinstance(u, int) or u < 1 or cp_size % u:
            raise ValueError(f"ulysses_degree (--ulysses-degree-in-cp) must divide cp_size "
                             f"(--context-parallel-size {cp_size}), got {u!r}")
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens)
    cu = cu_seqlens.detach().to("cpu", torch.int64).flatten()
    if cu.numel() < 2 or cu[0] != 0 or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError("cu_seqlens must start at 0 and strictly increase (one offset per "
                         "document start, then b*s)")
    n = int(cu[-1])
    if n % cp_size:
        raise ValueError(f"b*s ({n} tokens) must be divisible by cp_size (--context-parallel-"
                         f"size {cp_size})")
    return cu, u


def plan_context_parallel(cu_seqlens, cp_size: int, algo: str = "ring",
                          ulysses_degree: Optional[int] = None) -> CPPlan:
    """Plan how `cp_size` ranks share the documents of one micro-batch (see the module)."""
    cu, u = _validate(cu_seqlens, cp_size, algo, ulysses_degree)
    groups = cp_size // u
    pieces = partition_documents(cu.numpy(), groups)
    schedules = build_schedules(pieces, groups)
    return CPPlan(algo, cp_size, u, int(cu[-1]), cu.to(torch.int32), pieces, tuple(schedules))
