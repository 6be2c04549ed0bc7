"""Data preparation, upstream of stage 1: tokenizers, the offline sample corpus, and
jsonl -> Megatron indexed datasets. Imports megatron-core lazily (only to write datasets)."""

from megatron_eod.data.tokenizers import (
    TOKENIZER_TYPES, ByteTokenizer, NullTokenizer, build_tokenizer, padded_vocab_size)

__all__ = ["TOKENIZER_TYPES", "ByteTokenizer", "NullTokenizer", "build_tokenizer",
           "padded_vocab_size"]
