"""`build_doc_layout` against megatron-core's own GPTDataset, the independent reference.

For all 8 combinations of (reset_position_ids, reset_attention_mask, eod_mask_loss) and
b in {1, 2, 4}, 1,000 samples drawn through BlendedMegatronDatasetBuilder from an indexed
dataset with EoD tokens: the layout expanded to a dense mask equals the mask megatron-core
builds, and position_ids and loss_mask are equal too. Exact equality: all integers / 0-1.
"""

import itertools

import numpy
import pytest
import torch

from megatron_eod import build_doc_layout, dense_attention_mask
from megatron_eod.data.tokenizers import ByteTokenizer
from megatron_eod.megatron.dataset import blend_prefixes, build_gpt_datasets, parse_data_path
from tests.harness import run_ranks

SEQ_LENGTH = 96
NUM_SAMPLES = 1000


def write_indexed_dataset(prefix, documents, dtype=numpy.uint16):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def random_documents(seed, n_docs=600):
    """Heavy-tailed byte documents, each ending with EoD; some are a lone EoD (so two EoDs
    meet) and some are longer than a sample (so some rows hold no EoD at all)."""
    rng = numpy.random.default_rng(seed)
    eod = ByteTokenizer.eod
    docs = []
    for _ in range(n_docs):
        kind = rng.random()
        if kind < 0.1:
            length = 0
        elif kind < 0.15:
            length = int(rng.integers(SEQ_LENGTH + 1, 3 * SEQ_LENGTH))
        else:
            length = int(min(rng.lognormal(2.5, 1.0), 4 * SEQ_LENGTH))
        docs.append(list(rng.integers(0, 256, size=length)) + [eod])
    return docs


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("indexed") / "random_text_document")
    write_indexed_dataset(prefix, random_documents(seed=7))
    return prefix


FLAGS = list(itertools.product([False, True], repeat=3))


@pytest.mark.parametrize("reset_position_ids,reset_attention_mask,eod_mask_loss", FLAGS)
def test_layout_matches_megatron_gpt_dataset(tmp_path, data_prefix, reset_position_ids,
                                             reset_attention_mask, eod_mask_loss):
    tokenizer = ByteTokenizer()
    train, _, _ = build_gpt_datasets(
        data_prefix, SEQ_LENGTH, tokenizer, num_samples=[NUM_SAMPLES, 0, 0], split="100,0,0",
        reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss, create_attention_mask=True, path_to_cache=str(tmp_path))
    order = numpy.random.default_rng(0).permutation(len(train))[:NUM_SAMPLES]
    samples = [train[int(i)] for i in order]
    assert len(samples) == NUM_SAMPLES

    # The samples must exercise the cases the semantics hinge on, or the test proves little.
    tokens = torch.stack([s["tokens"] for s in samples])
    is_eod = tokens == tokenizer.eod
    assert is_eod[:, 0].any() and is_eod[:, -1].any(), "need EoD at first and last position"
    assert (is_eod[:, 1:] & is_eod[:, :-1]).any(), "need consecutive EoDs"
    assert (~is_eod.any(dim=1)).any(), "need rows without any EoD"

    for b in (1, 2, 4):
        for start in range(0, NUM_SAMPLES - b + 1, b):
            rows = samples[start:start + b]
            layout = build_doc_layout(
                torch.stack([r["tokens"] for r in rows]), tokenizer.eod,
                reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
                eod_mask_loss=eod_mask_loss, vocab_size=tokenizer.vocab_size)
            expected_mask = torch.stack([r["attention_mask"] for r in rows])
            assert torch.equal(dense_attention_mask(layout), expected_mask), (b, start)
            assert torch.equal(layout.position_ids, torch.stack([r["position_ids"] for r in rows]))
            assert torch.equal(layout.loss_mask, torch.stack([r["loss_mask"] for r in rows]))


def test_parse_data_path_forms_and_errors(data_prefix):
    assert parse_data_path(data_prefix) == ([data_prefix], None)
    assert parse_data_path(["0.3", data_prefix, "0.7", data_prefix]) == (
        [data_prefix, data_prefix], [0.3, 0.7])
    with pytest.raises(ValueError, match="--data-path .*does not exist"):
        parse_data_path(data_prefix + "_missing")
    with pytest.raises(ValueError, match="WEIGHT PREFIX pairs"):
        parse_data_path(["0.5", data_prefix, data_prefix])
    with pytest.raises(ValueError, match="weights must be positive"):
        parse_data_path(["-1", data_prefix])
    with pytest.raises(ValueError, match="at least one"):
        parse_data_path([])


def test_blend_prefixes_lists_each_once(data_prefix):
    blend = ([data_prefix, data_prefix], [0.3, 0.7])
    per_split = [([data_prefix], None), None, ([data_prefix], [1.0])]
    assert blend_prefixes(blend, None) == blend_prefixes(None, per_split) == [data_prefix]


def _splits_built(rank, world, prefixes, weights, cache):
    train, valid, test = build_gpt_datasets(
        None, SEQ_LENGTH, ByteTokenizer(), [16, 0, 0], split="90,8,2", path_to_cache=cache,
        blend=(prefixes, weights))
    return len(train), valid is None, test is None


@pytest.mark.parametrize("weights", [None, [0.3, 0.7]], ids=["one-prefix", "weighted-blend"])
def test_a_split_asked_for_no_sample_is_none(tmp_path, data_prefix, weights):
    """--eval-iters 0 asks for 0 validation and test samples. megatron-core builds a weighted
    blend's splits as empty datasets then, on which Megatron-LM's sampler stopped every rank
    ("no sample to consume: 0"): such a split is None, as one that --split leaves empty.
    (On a gloo rank: megatron-core 0.16 builds a blend with torch.distributed.)"""
    prefixes = [data_prefix] * (2 if weights else 1)
    (train, valid_none, test_none), = run_ranks(_splits_built, 1, prefixes, weights,
                                                str(tmp_path))
    assert train >= 16 and valid_none and test_none
