"""The reference runs several functional test files compare with, made once per session."""

import pytest

from tests.training.runs import EVALUATE, metrics_records, train


@pytest.fixture(scope="session")
def baseline(short_docs_data, tmp_path_factory):
    """The tiny GPT at CP=1 x DP=4, uninterrupted, evaluated at the end: (losses, log, its
    --metrics-file records)."""
    folder = tmp_path_factory.mktemp("cp1")
    losses, log = train(folder, "cp1", short_docs_data, *EVALUATE)
    return losses, log, metrics_records(folder / "cp1.jsonl")


@pytest.fixture(scope="session")
def learned_cp1(short_docs_data, tmp_path_factory):
    """The same with Megatron-LM's default learned absolute positions and q/k layer norms."""
    return train(tmp_path_factory.mktemp("learned"), "cp1", short_docs_data,
                 "--position-embedding-type", "learned_absolute", "--qk-layernorm")


@pytest.fixture(scope="session")
def short_docs_without_eod(short_docs_data, tmp_path_factory):
    """short_docs_data's documents preprocessed without --append-eod: no EoD token anywhere;
    only the dataset's document index knows where a document ends."""
    import os

    from megatron_eod.data.preprocess import preprocess_jsonl
    from megatron_eod.data.tokenizers import ByteTokenizer

    prefix = str(tmp_path_factory.mktemp("no_eod") / "short")
    preprocess_jsonl(os.path.join(os.path.dirname(short_docs_data), "short.jsonl"), prefix,
                     ByteTokenizer(), append_eod=False, log=lambda message: None)
    return prefix + "_text_document"
