"""Stage 1, documents: token ids + EoD id -> `DocLayout` (varlen metadata, no dense mask)."""

from megatron_eod.layout.doc_layout import DocLayout, build_doc_layout, dense_attention_mask

__all__ = ["DocLayout", "build_doc_layout", "dense_attention_mask"]
