"""Stage 3, attention: `context_parallel_attention` over a `CPPlan` (Ring, Ulysses, Hybrid).

The entry is api.py (one pipeline: [Ulysses all-to-all] -> ring schedule -> [all-to-all back]);
ring.py executes a rank's schedule, ulysses.py the all-to-alls, backends.py the varlen kernels,
comm.py the transfers, groups.py the hybrid sub-groups.
"""

from megatron_eod.attention.api import context_parallel_attention
from megatron_eod.attention.groups import create_hybrid_groups

__all__ = ["context_parallel_attention", "create_hybrid_groups"]
