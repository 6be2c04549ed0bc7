"""megatron-eod: EoD-reset training under context parallelism for Megatron.

The public contract (docs/ARCHITECTURE.md):
    build_doc_layout(tokens, eod_token_id, ...)            -> DocLayout
    plan_context_parallel(cu_seqlens, cp_size, algo, ...)  -> CPPlan
    context_parallel_attention(q, k, v, plan, group=...)   -> out
    create_hybrid_groups(cp_group, ulysses_degree)          (once, for algo="hybrid")
Importing this package has no side effects and needs only torch and numpy.
"""

from megatron_eod.attention import context_parallel_attention, create_hybrid_groups
from megatron_eod.layout import DocLayout, build_doc_layout, dense_attention_mask
from megatron_eod.plan import CPPlan, plan_context_parallel

__version__ = "0.1.0"

__all__ = ["DocLayout", "build_doc_layout", "dense_attention_mask", "CPPlan",
           "plan_context_parallel", "context_parallel_attention", "create_hybrid_groups",
           "__version__"]
