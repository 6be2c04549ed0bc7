"""Start-up dataset checks (data/checks.py): each broken or mismatched dataset is refused with
the file and the rule; a good one, with or without preprocessing's metadata file, passes."""

import json
import os
import shutil

import numpy
import pytest

from megatron_eod.data.checks import DatasetError, check_dataset
from megatron_eod.data.preprocess import preprocess_jsonl
from megatron_eod.data.tokenizers import ByteTokenizer, NullTokenizer

TEXTS = ["alpha beta", "gamma", "a longer document about delta and epsilon", "z"]


def make(tmp_path, name, texts=TEXTS, sidecar=True):
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess_jsonl(str(src), str(tmp_path / name), ByteTokenizer(), append_eod=True,
                     log=lambda m: 0)
    prefix = str(tmp_path / f"{name}_text_document")
    if not sidecar:  # as Megatron-LM's own tools/preprocess_data.py leaves it
        os.remove(prefix + ".json")
    return prefix


def raw(tmp_path, name, documents, dtype=numpy.uint16):
    """A dataset written with megatron-core's builder alone (no metadata file)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / name)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents:
        builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("sidecar", [True, False], ids=["ours", "megatron-tool"])
def test_a_good_dataset_passes(tmp_path, sidecar):
    check_dataset(make(tmp_path, "good", sidecar=sidecar), ByteTokenizer())


@pytest.mark.parametrize("sidecar", [True, False], ids=["ours", "megatron-tool"])
def test_a_truncated_bin_is_named(tmp_path, sidecar):
    prefix = make(tmp_path, "cut", sidecar=sidecar)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 50)
    with pytest.raises(DatasetError, match=r"cut_text_document\.bin: \d+ bytes, but .*truncated"):
        check_dataset(prefix, ByteTokenizer())


@pytest.mark.parametrize("sidecar", [True, False], ids=["ours", "megatron-tool"])
def test_the_idx_of_another_dataset_is_named(tmp_path, sidecar):
    prefix = make(tmp_path, "one", sidecar=sidecar)
    other = make(tmp_path, "two", texts=["something else entirely, and longer"] * 3)
    shutil.copy(other + ".idx", prefix + ".idx")
    with pytest.raises(DatasetError, match="one_text_document"):
        check_dataset(prefix, ByteTokenizer())


def test_a_flipped_dtype_code_is_named(tmp_path):
    prefix = make(tmp_path, "flip", sidecar=False)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(17)
        f.write(bytes([4]))  # uint16 -> int32
    with pytest.raises(DatasetError, match=r"flip_text_document\.idx: sequence offsets"):
        check_dataset(prefix, ByteTokenizer())
    with open(prefix + ".idx", "r+b") as f:
        f.seek(17)
        f.write(bytes([42]))
    with pytest.raises(DatasetError, match="unknown token dtype code 42"):
        check_dataset(prefix, ByteTokenizer())


def test_not_an_index_is_named(tmp_path):
    prefix = make(tmp_path, "junk")
    with open(prefix + ".idx", "wb") as f:
        f.write(b"hello, not an index")
    with pytest.raises(DatasetError, match=r"junk_text_document\.idx: not a Megatron"):
        check_dataset(prefix, ByteTokenizer())


def test_an_empty_dataset_is_refused(tmp_path):
    prefix = make(tmp_path, "empty", texts=["", ""])
    with pytest.raises(DatasetError, match="has no tokens"):
        check_dataset(prefix, ByteTokenizer())


def test_a_tokenizer_with_another_eod_is_refused(tmp_path):
    prefix = make(tmp_path, "eod")
    training = NullTokenizer(300)  # EoD 300 up to megatron-core 0.17, 299 from 0.18
    with pytest.raises(DatasetError, match=r"eod_text_document\.json: the data was made with "
                                           rf"EoD id 256.*EoD id is {training.eod}: train with "
                                           r"--vocab-size 256$"):
        check_dataset(prefix, training, eod_flags=lambda eod: f"--vocab-size {eod}")


def test_a_training_tokenizer_without_eos_is_named(tmp_path):
    """Megatron-LM's HuggingFaceTokenizer over a bare tokenizer.json has no eos (EoD None):
    "pass the tokenizer flags the data was made with" sent a helper, who had, in circles."""
    prefix = make(tmp_path, "noeos")

    class NoEos:
        eod, vocab_size = None, 300

    with pytest.raises(DatasetError, match=r"EoD id is None: the training tokenizer has no "
                                           r"end-of-document \(eos\) token; .*tokenizer_config"):
        check_dataset(prefix, NoEos())


@pytest.mark.parametrize("sidecar", [True, False], ids=["ours", "megatron-tool"])
def test_ids_outside_the_vocabulary_are_refused(tmp_path, sidecar):
    prefix = make(tmp_path, "vocab", sidecar=sidecar)

    class SmallVocab:  # EoD 256 as the data's, but only 200 ids
        eod, vocab_size = 256, 200

    with pytest.raises(DatasetError, match="outside the training tokenizer's vocabulary"):
        check_dataset(prefix, SmallVocab())


def test_eod_only_data_is_refused(tmp_path):
    prefix = raw(tmp_path, "eods", [[256], [256, 256]])
    with pytest.raises(DatasetError, match="every token is the EoD id 256"):
        check_dataset(prefix, ByteTokenizer())
    prefix = make(tmp_path, "eods_ours", texts=["a"])
    meta = json.load(open(prefix + ".json"))
    meta["non_eod_tokens"] = 0
    json.dump(meta, open(prefix + ".json", "w"))
    with pytest.raises(DatasetError, match="every token is the EoD id 256"):
        check_dataset(prefix, ByteTokenizer())


def test_the_scan_is_bounded_on_large_files(tmp_path):
    """Without metadata a file larger than the scan budget is sampled, not read whole: an
    out-of-vocabulary id in a sampled stretch is still found."""
    docs = [[1] * 1000 for _ in range(200)]
    docs[0][0] = 999  # the first stretch is always sampled
    prefix = raw(tmp_path, "big", docs)

    class Tok:
        eod, vocab_size = 0, 500

    with pytest.raises(DatasetError, match="token id 999"):
        check_dataset(prefix, Tok(), scan_tokens=6400)


@pytest.mark.parametrize("sidecar", [True, False], ids=["ours", "megatron-tool"])
def test_data_without_any_eod_is_refused_where_the_run_resets_at_eods(tmp_path, sidecar):
    """Made without --append-eod: under --reset-attention-mask every row would be one
    document. Without the EoD flags such data is fine."""
    src = tmp_path / "plain.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    preprocess_jsonl(str(src), str(tmp_path / "plain"), ByteTokenizer(), append_eod=False,
                     log=lambda m: 0)
    prefix = str(tmp_path / "plain_text_document")
    if not sidecar:
        os.remove(prefix + ".json")
    check_dataset(prefix, ByteTokenizer())
    with pytest.raises(DatasetError, match="holds no EoD id 256 \\(made without --append-eod"
                                           "\\?\\), so --reset-attention-mask --eod-mask-loss "
                                           "would find no document boundary"):
        check_dataset(prefix, ByteTokenizer(),
                      reset_flags="--reset-attention-mask --eod-mask-loss")
    check_dataset(make(tmp_path, "with_eods", sidecar=sidecar), ByteTokenizer(),
                  reset_flags="--reset-attention-mask")


def _bpe(folder, corpus):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=270, special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus] * 50, trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    from megatron_eod.data.tokenizers import build_tokenizer

    return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(folder))


def test_a_tokenizer_with_the_same_eod_and_vocab_size_but_other_merges_is_refused(tmp_path):
    """Llama-2's and Mistral's tokenizers share eos 2 of 32000: data made with one and trained
    with the other passed the EoD and vocabulary checks. The ids of a probe text tell them
    apart; the same tokenizer read from another folder passes."""
    made = _bpe(tmp_path / "a", "the quick brown fox jumps over the lazy dog " * 9)
    other = _bpe(tmp_path / "b", "naive cafe tokens per second, def tokenize(text) " * 9)
    copy = _bpe(tmp_path / "copy", "the quick brown fox jumps over the lazy dog " * 9)
    assert (made.eod, made.vocab_size) == (other.eod, other.vocab_size)
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    preprocess_jsonl(str(src), str(tmp_path / "c"), made, append_eod=True, log=lambda m: 0)
    prefix = str(tmp_path / "c_text_document")
    check_dataset(prefix, copy)
    with pytest.raises(DatasetError, match="made with a tokenizer that splits text otherwise "
                                           "than the training one"):
        check_dataset(prefix, other)


def test_the_probe_digest_ignores_the_special_ids_a_wrapper_adds():
    """Megatron-LM's Llama2Tokenizer and transformers' tokenizers put BOS before any text,
    ours do not: the same tokenizer through either trainer gives the same digest."""
    from megatron_eod.data.sidecar import probe_digest

    class WithBos(ByteTokenizer):
        bos_id = 300

        def tokenize(self, text):
            return [self.bos_id] + super().tokenize(text) + [self.eod]

    assert probe_digest(WithBos()) == probe_digest(ByteTokenizer()) is not None


def _index(prefix, lengths, documents, code=8, itemsize=2, pointers=None):
    """A .idx written field by field (and a sparse .bin of the size it points at)."""
    lengths = numpy.asarray(lengths, numpy.int32)
    if pointers is None:
        pointers = numpy.concatenate([[0], numpy.cumsum(lengths[:-1], dtype=numpy.int64)])
        pointers = pointers * itemsize
    documents = numpy.asarray(documents, numpy.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + numpy.uint64(1).tobytes() + bytes([code]))
        f.write(numpy.uint64(len(lengths)).tobytes() + numpy.uint64(len(documents)).tobytes())
        for table in (lengths, numpy.asarray(pointers, numpy.int64), documents):
            table.tofile(f)
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0)
    return prefix


@pytest.mark.parametrize("at", [0, 63, 64, 65, 127, 128, 999])
def test_a_damaged_table_entry_is_found_at_any_chunk_edge(tmp_path, monkeypatch, at):
    """The index tables are checked 64 entries at a time here (4M in a run): an entry broken
    on either side of a chunk's edge, or at either end, is still found."""
    from megatron_eod.data import checks

    monkeypatch.setattr(checks, "_CHUNK", 64)
    rng = numpy.random.default_rng(at)
    lengths = rng.integers(0, 9, 1000)
    documents = numpy.concatenate([[0], numpy.sort(rng.integers(0, 1001, 400)), [1000]])
    prefix = _index(str(tmp_path / "good"), lengths, documents)
    assert checks.check_files(prefix)[1:3] == (401, int(lengths.sum()))
    pointers = numpy.concatenate([[0], numpy.cumsum(lengths[:-1])]) * 2
    for moved in (slice(at, at + 1), slice(at, None)):  # one offset; or all from it on,
        broken = pointers.copy()  # which breaks only the step into `at` (a chunk's edge)
        broken[moved] += 2
        _index(str(tmp_path / "ptr"), lengths, documents, pointers=broken)
        with pytest.raises(DatasetError, match="offsets do not follow the sequence lengths"):
            checks.check_files(str(tmp_path / "ptr"))
    negative = lengths.copy()
    negative[at] = -1
    with pytest.raises(DatasetError, match="offsets do not follow|bytes, but"):
        checks.check_files(_index(str(tmp_path / "neg"), negative, documents,
                                  pointers=numpy.concatenate([[0], numpy.cumsum(
                                      lengths[:-1])]) * 2))
    backwards = numpy.arange(1001)
    backwards[min(at, 998) + 1] -= 2  # a document table entry below the one before it
    with pytest.raises(DatasetError, match="document table does not cover"):
        checks.check_files(_index(str(tmp_path / "docs"), lengths, backwards))


def test_the_index_checks_hold_a_chunk_of_the_tables_not_the_tables(tmp_path, monkeypatch):
    """A billion-document index is ~20 GB of tables, checked on every rank of a node at start-up:
    the checks walk memory-mapped tables a chunk at a time (before: read whole, with
    temporaries; 50M documents: 1.76 GB allocated and 5.7 s, after: 68 MB and 0.5 s)."""
    import tracemalloc

    from megatron_eod.data import checks

    monkeypatch.setattr(checks, "_CHUNK", 1 << 14)
    n = 1 << 21  # 40 MB of tables
    prefix = _index(str(tmp_path / "big"), numpy.full(n, 3), numpy.arange(n + 1))
    tracemalloc.start()
    try:
        assert checks.check_files(prefix)[1:3] == (n, 3 * n)
        assert len(checks.document_ends(prefix)) == 1000
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2 ** 20:.1f} MiB allocated for 40 MiB of tables"
