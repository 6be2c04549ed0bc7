"""`plan_context_parallel`: the CP plan every rank computes identically from `cu_seqlens`.

One job: validate the arguments, place the stream on groups (partition.py), order each
group's rows for the exchange (local_order.py) and expose what
ranks and the attention need: `token_index(rank)` and `schedule(rank)` (kv_schedule.py,
built on first use for the asking rank's group only), plus `stats()` for benchmarks and tests.

Ranks and groups: `ulysses_degree` u ranks that are consecutive in the CP group form one
Ulysses group; the R = cp/u groups form the ring (Ring: u = 1; Ulysses: u = cp, R = 1;
Hybrid: anything between; `ulysses_degree_for` is the one statement of that rule). Group g
holds its pieces' tokens in local order; its u ranks hold consecutive equal shards of that
list, and the Ulysses all-to-all reassembles it.

What it does not do: no communication, no device work (tensors are built on the CPU;
`CPPlan.to(device)` makes later schedules land on the device, once per micro-batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from megatron_eod.plan.cost import balance_bound, doc_pairs
from megatron_eod.plan.kv_batched import MAX_RECEIVED_PER_ROW, rows_received, with_batched
from megatron_eod.plan.kv_schedule import (GroupSchedule, SplitDocuments, build_schedule,
                                           schedule_totals)
from megatron_eod.plan.local_order import order_for_exchange
from megatron_eod.plan.forward_tiles import with_fused_tiles
from megatron_eod.plan.local_split import with_local_parts
from megatron_eod.plan.partition import Placement, partition_documents
from megatron_eod.plan.pieces import Pieces

__all__ = ["ALGORITHMS", "CPPlan", "plan_context_parallel", "ulysses_degree_for"]

ALGORITHMS = ("ring", "ulysses", "hybrid")


@dataclass(frozen=True, eq=False)
class CPPlan:
    algo: str
    cp_size: int
    ulysses_degree: int
    num_tokens: int
    cu_seqlens: torch.Tensor  # int32, the global document offsets (CPU)
    pieces: Pieces = field(repr=False)
    placement: Placement = field(repr=False)  # which candidate layout, and what was tried
    device: Optional[torch.device] = None
    # Whether batched schedules carry the fused kernels' tiles (plan/forward_tiles.py): what
    # --cp-fused-forward runs; without it they cost host time for nothing.
    fused_tiles: bool = True
    # Built on first use; shared by the copies `to` makes (same pieces, same answers).
    _split: Dict[str, SplitDocuments] = field(default_factory=dict, repr=False,
                                              compare=False)
    _cache: Dict[Tuple[str, int], object] = field(default_factory=dict, repr=False,
                                                  compare=False)

    @property
    def ring_size(self) -> int:
        return self.cp_size // self.ulysses_degree

    def group_of(self, rank: int) -> int:
        """The ring group (Ulysses group index) of a CP rank."""
        self._check_rank(rank)
        return rank // self.ulysses_degree

    def token_index(self, rank: int) -> torch.Tensor:
        """int64 [b*s // cp] on the CPU: stream positions this rank holds, in local order (a
        tensor of the caller's own: changing it leaves the plan as it was)."""
        group, shard = divmod(self._check_rank(rank), self.ulysses_degree)
        per_rank = self.num_tokens // self.cp_size
        return self._group_tokens(group)[shard * per_rank:(shard + 1) * per_rank].clone()

    def group_tokens(self, group: int) -> torch.Tensor:
        """int64 [b*s // R]: stream positions ring group `group` holds, in local order (the
        caller's own tensor)."""
        return self._group_tokens(group).clone()

    def _group_tokens(self, group: int) -> torch.Tensor:
        key = ("tokens", group)
        if key not in self._cache:
            self._cache[key] = torch.from_numpy(self.pieces.token_index(group))
        return self._cache[key]

    def schedule(self, rank: int) -> GroupSchedule:
        """The rank's group schedule (on `self.device` when set); built once per group."""
        return self.group_schedule(self.group_of(rank))

    def group_schedule(self, group: int) -> GroupSchedule:
        key = ("schedule", group)
        if key not in self._cache:
            schedule = build_schedule(self._split_documents(), group)
            if self.batched_ring:
                schedule = with_batched(schedule, self._split_documents())
            schedule = with_local_parts(schedule)
            if self.fused_tiles and (not schedule.steps or schedule.batched is not None):
                schedule = with_fused_tiles(schedule)
            if self.device is not None and self.device.type != "cpu":
                schedule = schedule.to(self.device)
            self._cache[key] = schedule
        return self._cache[key]

    @property
    def batched_ring(self) -> bool:
        """Whether the schedules carry their batched form (kv_batched.py): unless some group
        would receive more than MAX_RECEIVED_PER_ROW x its rows. The same on every rank."""
        key = ("batched_ring", None)
        if key not in self._cache:
            split = self._split_documents()
            rows = self.pieces.tokens_per_group()
            self._cache[key] = all(
                rows_received(split, g) <= MAX_RECEIVED_PER_ROW * int(rows[g])
                for g in np.unique(split.pieces.group[split.index]))
        return self._cache[key]

    @property
    def schedules(self) -> Tuple[GroupSchedule, ...]:
        """Every group's schedule (simulations and tests; a rank needs only its own)."""
        return tuple(self.group_schedule(g) for g in range(self.ring_size))

    def to(self, device) -> "CPPlan":
        """The plan whose schedules live on `device` (call once per micro-batch): schedules
        built already (e.g. ahead, on a worker thread) are moved, later ones built there."""
        if isinstance(device, int) and not isinstance(device, bool):
            device = f"cuda:{device}"  # an index names a CUDA device, as in torch
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must name a torch device ('cuda', 'cuda:1', 'cpu', 0), "
                             f"got {device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device}: CUDA is not available here")
        moved = CPPlan(self.algo, self.cp_size, self.ulysses_degree, self.num_tokens,
                       self.cu_seqlens, self.pieces, self.placement, device, self.fused_tiles,
                       self._split)
        for key, value in self._cache.items():
            moved._cache[key] = value.to(device) if key[0] == "schedule" else value
        return moved

    def pairs_needed(self) -> int:
        """Causal query-key pairs a document mask needs over the whole micro-batch."""
        return int(doc_pairs(np.diff(self.cu_seqlens.numpy())).sum())

    def stats(self) -> Dict[str, object]:
        """Yardsticks, per CP rank, for one attention layer's forward:

        pairs_per_rank: query-key token pairs the rank's kernel calls evaluate per head (a
            Hybrid/Ulysses rank evaluates its whole group's pairs for its heads);
        kv_tokens_received_per_rank: key/value tokens received from other ranks in the ring
            exchange (for Hybrid, for the rank's heads) by the steps executor;
        kv_tokens_received_batched_per_rank: the same for the batched executor, which
            receives a token once per query piece of the group that reads it (kv_batched.py);
        ulysses_tokens_received_per_rank: tokens received in the input all-to-all;
        pairs_needed: pairs a document mask needs; wasted_pairs_ratio: evaluated / needed;
        balance: max / mean pairs over groups; balance_limit: the most the bound allows
            (cost.balance_bound); padding_tokens: tokens placed beyond the stream's;
        split_documents: documents held by more than one group;
        batched_ring: whether ring groups may run the batched executor (kv_batched.py);
        planner: the layout chosen (partition.py); planners: every candidate tried and how
            it did ("sweep" alone where the others would cost too much).
        The pairs and traffic come from the schedules' own relation (kv_schedule), so they
        can be checked against the independent cost model (cost.py).
        """
        u, groups = self.ulysses_degree, self.ring_size
        split = self._split_documents()
        totals = [schedule_totals(split, g) for g in range(groups)]
        group_evaluated = [p for p, _ in totals]
        batched = [rows_received(split, g) for g in range(groups)]
        needed = self.pairs_needed()
        lengths = np.diff(self.cu_seqlens.numpy())
        per_rank = self.num_tokens // self.cp_size
        mean = needed / groups
        return {
            "pairs_per_rank": [group_evaluated[r // u] for r in range(self.cp_size)],
            "kv_tokens_received_per_rank": [totals[r // u][1] for r in range(self.cp_size)],
            "kv_tokens_received_batched_per_rank": [batched[r // u] for r in range(self.cp_size)],
            "ulysses_tokens_received_per_rank": [per_rank * (u - 1)] * self.cp_size,
            "pairs_needed": needed,
            "wasted_pairs_ratio": sum(group_evaluated) / needed,
            "balance": max(group_evaluated) / mean,
            "balance_limit": balance_bound(mean, int(lengths.max())) / mean,
            "padding_tokens": int(self.pieces.length.sum()) - self.num_tokens,
            "split_documents": int(np.unique(split.doc).size),
            "batched_ring": self.batched_ring,
            "planner": self.placement.planner,
            "planners": dict(self.placement.tried),
        }

    def _split_documents(self) -> SplitDocuments:
        if "split" not in self._split:
            self._split["split"] = SplitDocuments(self.pieces)
        return self._split["split"]

    def _check_rank(self, rank) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not (
                0 <= rank < self.cp_size):
            raise ValueError(f"cp_rank must be an int in [0, {self.cp_size}), got {rank!r}")
        return int(rank)


def ulysses_degree_for(algo: str, cp_size: int, ulysses_degree: Optional[int] = None) -> int:
    """The Ulysses degree an algorithm implies: ring 1, ulysses cp_size, hybrid the given
    degree, which must divide cp_size. The one place this rule lives."""
    if algo not in ALGORITHMS:
        raise ValueError(f"algo (--context-parallel-algo) must be one of {ALGORITHMS}, got "
                         f"{algo!r}")
    if ulysses_degree is not None and (isinstance(ulysses_degree, bool) or not isinstance(
            ulysses_degree, (int, np.integer))):
        raise ValueError(f"ulysses_degree (--ulysses-degree-in-cp) must be None or an int, "
                         f"got {ulysses_degree!r}")
    if algo == "ring":
        if ulysses_degree not in (None, 1):
            raise ValueError(f"ulysses_degree (--ulysses-degree-in-cp) must be None or 1 for "
                             f"algo='ring', got {ulysses_degree}")
        return 1
    if algo == "ulysses":
        if ulysses_degree not in (None, cp_size):
            raise ValueError(f"ulysses_degree (--ulysses-degree-in-cp) must be None or "
                             f"cp_size ({cp_size}) for algo='ulysses', got {ulysses_degree}")
        return cp_size
    if ulysses_degree is None:
        raise ValueError("algo='hybrid' needs ulysses_degree (--ulysses-degree-in-cp)")
    u = ulysses_degree  # an int: checked above
    if u < 1 or cp_size % u:
        raise ValueError(f"ulysses_degree (--ulysses-degree-in-cp) {u!r} must be a positive "
                         f"int that divides cp_size (--context-parallel-size {cp_size})")
    return int(u)


def _validate_cu_seqlens(cu_seqlens) -> np.ndarray:
    """-> int64 numpy offsets, or ValueError naming the rule that is broken."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.layout != torch.strided or cu_seqlens.is_meta or cu_seqlens.is_nested:
            kind = "meta" if cu_seqlens.is_meta else "nested" if cu_seqlens.is_nested else \
                cu_seqlens.layout
            raise ValueError(f"cu_seqlens must be a dense tensor with values, got a {kind} one")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or \
                cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}")
        cu = cu_seqlens.detach().to("cpu", torch.int64).numpy()
    else:
        try:
            cu = np.asarray(cu_seqlens)
        except (ValueError, TypeError):  # ragged nesting
            raise ValueError(f"cu_seqlens must be a 1-D sequence of integer offsets, got "
                             f"{cu_seqlens!r:.80}") from None
        if cu.size == 0:
            cu = cu.astype(np.int64)  # an empty list: the offsets rule below names the error
        elif cu.dtype == object or not np.issubdtype(cu.dtype, np.integer):
            raise ValueError(f"cu_seqlens must hold integers, got {cu.dtype} values")
        else:
            cu = cu.astype(np.int64)
    if cu.ndim != 1:
        raise ValueError(f"cu_seqlens must be 1-D (document offsets into the flattened "
                         f"b*s stream), got shape {tuple(cu.shape)}")
    if cu.size < 2 or cu[0] != 0 or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError("cu_seqlens must start at 0 and strictly increase (one offset per "
                         "document start, then b*s)")
    return cu


def plan_context_parallel(cu_seqlens, cp_size: int, algo: str = "ring",
                          ulysses_degree: Optional[int] = None,
                          fused_tiles: bool = True) -> CPPlan:
    """Plan how `cp_size` ranks share the documents of one micro-batch (see the module).
    fused_tiles: whether its schedules carry the tiles the fused kernels need
    (TritonForwardBackend, --cp-fused-forward; False saves their host time). Never fails on
    a valid input; a bad one raises ValueError naming the rule."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ValueError(f"cp_size (--context-parallel-size) must be a positive int, got "
                         f"{cp_size!r}")
    cp_size = int(cp_size)
    u = ulysses_degree_for(algo, cp_size, ulysses_degree)
    cu = _validate_cu_seqlens(cu_seqlens)
    n = int(cu[-1])
    if cp_size > n:
        raise ValueError(f"cp_size (--context-parallel-size {cp_size}) must not exceed the "
                         f"tokens of the micro-batch (b*s = {n})")
    if n % cp_size:
        raise ValueError(f"b*s ({n} tokens) must be divisible by cp_size (--context-parallel-"
                         f"size {cp_size})")
    if n >= 1 << 31:
        raise ValueError(f"b*s ({n} tokens) must be below 2**31: the varlen kernels take "
                         f"int32 cu_seqlens")
    placement = partition_documents(cu, cp_size // u)
    placement = dataclasses.replace(placement, pieces=order_for_exchange(placement.pieces))
    return CPPlan(algo, cp_size, u, n, torch.from_numpy(cu.astype(np.int32)), placement.pieces,
                  placement, fused_tiles=bool(fused_tiles))
