"""megatron-eod: EoD-reset training under context parallelism for Megatron.

The public contract (see docs/ARCHITECTURE.md): `build_doc_layout` today;
`plan_context_parallel` and `context_parallel_attention` arrive with the attention core.
Importing this package has no side effects and needs only torch.
"""

from megatron_eod.layout import DocLayout, build_doc_layout, dense_attention_mask

__version__ = "0.1.0"

__all__ = ["DocLayout", "build_doc_layout", "dense_attention_mask", "__version__"]
