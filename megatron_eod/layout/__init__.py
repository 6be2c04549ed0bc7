"""Stage 1, documents: token ids + EoD id (or where documents start) -> `DocLayout` (varlen
metadata, no dense mask)."""

from megatron_eod.layout.doc_layout import (DocLayout, build_doc_layout, dense_attention_mask,
                                            doc_layout_from_starts)

__all__ = ["DocLayout", "build_doc_layout", "dense_attention_mask", "doc_layout_from_starts"]
