"""Shared fixtures. torch and megatron-core are imported here, in the parent, so that forked
ranks (tests/harness.py) inherit them instead of importing them again."""

import os
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU, Triton kernels (the fused forward, attention/triton_forward.py) run through
# Triton's interpreter on CPU tensors. Triton reads this when it is first imported, which
# megatron-core does (below): it must be set before.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

with warnings.catch_warnings():
    # megatron-core warns at import that TransformerEngine/apex are absent: expected on CPU.
    warnings.simplefilter("ignore")
    import megatron.core  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.datasets.gpt_dataset  # noqa: F401
    import numpy.ma  # noqa: F401 - np.unique imports it on first use: once here, not per rank

# One intra-op thread per pytest-xdist worker (scripts/test_cpu.sh runs two); two otherwise.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else
                      max(1, min(2, os.cpu_count() or 1)))

# Property-based tests (hypothesis): CI runs a fixed, derandomized sample per property (each
# test asks for `examples(n)`: n under "ci"); `--hypothesis-profile=long` runs ten times as
# many fresh ones. The plugin loads a profile named on the command line after this file.
_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_COMMON)
settings.register_profile("long", max_examples=1000, **_COMMON)
settings.load_profile("ci")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than ten seconds")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


TINY_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                           "tiny_corpus.jsonl.gz")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small indexed dataset made once per session (byte tokens, EoD appended): the data of
    the tiny GPT runs. Its corpus is committed (fixtures/tiny_corpus.jsonl.gz: what
    `write_sample_corpus(max_bytes=300_000, seed=1234)` wrote from CPython 3.11's standard
    library, PSF License) rather than written here, because another Python's stdlib gives
    another corpus: the GPU machine (Python 3.12) must train on the data of the CPU golden
    losses."""
    import gzip
    import shutil

    from megatron_eod.data.preprocess import preprocess_jsonl
    from megatron_eod.data.tokenizers import ByteTokenizer

    root = tmp_path_factory.mktemp("tiny_data")
    corpus = os.path.join(root, "stdlib.jsonl")
    with gzip.open(TINY_CORPUS, "rb") as src, open(corpus, "wb") as dst:
        shutil.copyfileobj(src, dst)
    prefix = os.path.join(root, "stdlib")
    preprocess_jsonl(corpus, prefix, ByteTokenizer(), append_eod=True, log=lambda msg: None)
    return prefix + "_text_document"


@pytest.fixture(scope="session")
def short_docs_data(tmp_path_factory):
    """The tiny corpus cut into short documents (about 2 EoDs per 128-token row): the data of
    the CP/TP/PP parity runs, so that their rows hold many documents, 2-token ones (a byte and
    its EoD; 1-token ones where a row starts at a document's EoD), and documents spanning CP
    ranks and rows. tiny_data's documents (the
    stdlib's files, 1,600 bytes on average) leave most 128-token rows without an EoD, where a
    wrong mask, position id or loss mask would not change the losses."""
    import gzip
    import json
    import random

    from megatron_eod.data.preprocess import preprocess_jsonl
    from megatron_eod.data.tokenizers import ByteTokenizer

    root = tmp_path_factory.mktemp("short_docs_data")
    corpus = os.path.join(root, "short.jsonl")
    lengths = random.Random(7)
    with gzip.open(TINY_CORPUS, "rt") as src, open(corpus, "w") as dst:
        for line in src:
            text, at = json.loads(line)["text"], 0
            while at < len(text):
                end = at + lengths.choice([1, 2, 5, 12, 25, 40, 80, 300])
                dst.write(json.dumps({"text": text[at:end]}) + "\n")
                at = end
    prefix = os.path.join(root, "short")
    preprocess_jsonl(corpus, prefix, ByteTokenizer(), append_eod=True, log=lambda msg: None)
    return prefix + "_text_document"
