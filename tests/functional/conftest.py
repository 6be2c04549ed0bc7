"""The tiny CPU training setup shared by the functional tests: a small indexed dataset made
once per session from the offline sample corpus (byte tokens, EoD appended)."""

import os

import pytest

from megatron_eod.data.preprocess import preprocess_jsonl
from megatron_eod.data.sample_corpus import write_sample_corpus
from megatron_eod.data.tokenizers import ByteTokenizer


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_data")
    corpus = os.path.join(root, "stdlib.jsonl")
    write_sample_corpus(corpus, max_bytes=300_000, seed=1234)
    prefix = os.path.join(root, "stdlib")
    preprocess_jsonl(corpus, prefix, ByteTokenizer(), append_eod=True, log=lambda msg: None)
    return prefix + "_text_document"
