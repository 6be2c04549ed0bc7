"""Stage 2, plan: `cu_seqlens` + CP size + algorithm -> `CPPlan` (same on every rank)."""

from megatron_eod.plan.cp_plan import ALGORITHMS, CPPlan, plan_context_parallel
from megatron_eod.plan.kv_schedule import GroupSchedule, KernelCall, RingStep

__all__ = ["ALGORITHMS", "CPPlan", "plan_context_parallel", "GroupSchedule", "KernelCall",
           "RingStep"]
