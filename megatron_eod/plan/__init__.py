"""Stage 2, plan: `cu_seqlens` + CP size + algorithm -> `CPPlan` (same on every rank).

    pieces.py      Pieces: which token ranges each CP group holds
    cost.py        pair counts, key/value traffic and the balance bound (one place)
    partition.py   the sweep that places documents on groups (never fails)
    local_order.py each group's rows ordered so the rows reading received keys are one run
    kv_schedule.py one group's kernel calls and ring steps, built on demand
    cp_plan.py     CPPlan, plan_context_parallel, ulysses_degree_for
"""

from megatron_eod.plan.cost import BALANCE_TOLERANCE, balance_bound
from megatron_eod.plan.cp_plan import ALGORITHMS, CPPlan, plan_context_parallel, ulysses_degree_for
from megatron_eod.plan.kv_schedule import GroupSchedule, KernelCall, RingStep
from megatron_eod.plan.pieces import Pieces

__all__ = ["ALGORITHMS", "BALANCE_TOLERANCE", "CPPlan", "GroupSchedule", "KernelCall",
           "Pieces", "RingStep", "balance_bound", "plan_context_parallel",
           "ulysses_degree_for"]
