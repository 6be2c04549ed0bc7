"""data/index_writer.py writes megatron-core's IndexedDatasetBuilder's files byte for byte
(documents of one or several sequences, empty ones, whole datasets added, block boundaries
crossed), and its memory does not grow with the dataset (megatron-core's builder keeps ~90
bytes a document in Python lists)."""

import os
import random
import tracemalloc

import numpy
import pytest

from megatron_eod.data import index_writer
from megatron_eod.data.index_writer import SCRATCH_SUFFIXES, IndexWriter
from megatron_eod.megatron.imports import import_megatron

indexed = import_megatron("megatron.core.datasets.indexed_dataset")


def _documents(seed, count, vocab):
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        lengths = [rng.choice([0, 1, 2, rng.randint(3, 40)])
                   for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))]
        docs.append((numpy.array([rng.randrange(vocab) for _ in range(sum(lengths))]), lengths))
    return docs


def _write(kind, prefix, dtype, docs=(), parts=()):
    if kind == "megatron":
        builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for tokens, lengths in docs:
            builder.add_document(tokens, lengths)
        for part in parts:
            builder.add_index(part)
        builder.finalize(prefix + ".idx")
    else:
        writer = IndexWriter(prefix + ".bin", prefix + ".idx", dtype)
        for tokens, lengths in docs:
            writer.add_document(tokens, lengths)
        for part in parts:
            writer.add_index(part)
        writer.finalize()
    return [open(prefix + suffix, "rb").read() for suffix in (".bin", ".idx")]


@pytest.mark.parametrize("block", [3, 1 << 20])
@pytest.mark.parametrize("dtype,vocab", [(numpy.uint16, 50_000), (numpy.int32, 200_000)])
@pytest.mark.parametrize("seed", range(3))
def test_the_files_of_megatron_cores_builder(tmp_path, monkeypatch, block, dtype, vocab, seed):
    monkeypatch.setattr(index_writer, "_BLOCK", block)
    docs = _documents(seed, [0, 1, 50][seed], vocab)
    ours = _write("ours", str(tmp_path / "ours"), dtype, docs)
    theirs = _write("megatron", str(tmp_path / "theirs"), dtype, docs)
    assert ours == theirs
    assert sorted(os.listdir(tmp_path)) == ["ours.bin", "ours.idx", "theirs.bin", "theirs.idx"]


@pytest.mark.parametrize("block", [2, 1 << 20])
def test_whole_datasets_added_as_megatron_cores_add_index(tmp_path, monkeypatch, block):
    """Parts of one-sequence and several-sequence documents, and an empty part, after a few
    documents of the writer's own."""
    monkeypatch.setattr(index_writer, "_BLOCK", block)
    parts = []
    for i, count in enumerate([7, 0, 20]):
        parts.append(str(tmp_path / f"part{i}"))
        _write("megatron", parts[-1], numpy.uint16, _documents(10 + i, count, 1000))
    own = _documents(99, 5, 1000)
    ours = _write("ours", str(tmp_path / "ours"), numpy.uint16, own, parts)
    theirs = _write("megatron", str(tmp_path / "theirs"), numpy.uint16, own, parts)
    assert ours == theirs
    dataset = indexed.IndexedDataset(str(tmp_path / "ours"))
    assert len(dataset.document_indices) == 1 + 5 + 7 + 0 + 20


def test_memory_does_not_grow_with_the_documents(tmp_path, monkeypatch):
    monkeypatch.setattr(index_writer, "_BLOCK", 4096)
    tokens = numpy.arange(3)

    def peak(count):
        tracemalloc.start()
        writer = IndexWriter(str(tmp_path / "d.bin"), str(tmp_path / "d.idx"), numpy.uint16)
        for _ in range(count):
            writer.add_document(tokens, [3])
        writer.finalize()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    small, large = peak(20_000), peak(200_000)
    assert large < small + 64 * 1024, (small, large)  # megatron-core's builder: +18 MB
    assert os.path.getsize(tmp_path / "d.idx") == 34 + 200_000 * (4 + 8) + 200_001 * 8


def test_a_failed_write_leaves_no_scratch_files(tmp_path):
    """close() after a failure: files closed, the scratch file removed (the .bin and .idx are
    the caller's .tmp files, which dataset_files.discard removes with any scratch left by a
    killed run)."""
    from megatron_eod.data.dataset_files import discard, scratch_files, temporary_files

    base = str(tmp_path / "d")
    bin_, idx, _ = temporary_files(base)
    writer = IndexWriter(bin_, idx, numpy.uint16)
    writer.add_document(numpy.arange(4), [4])
    assert [os.path.exists(p) for p in scratch_files(base)] == [True] * len(SCRATCH_SUFFIXES)
    writer.close()
    assert sorted(os.listdir(tmp_path)) == ["d.bin.tmp", "d.idx.tmp"]
    leftover = IndexWriter(bin_, idx, numpy.uint16)  # as a killed run leaves them
    for f in leftover.files:
        f.close()
    discard(base)
    assert os.listdir(tmp_path) == []


class _FullDisk:
    """A file whose buffered bytes cannot be written out: closing it fails (ENOSPC)."""

    def __init__(self, f):
        self.f = f

    def __getattr__(self, name):
        return getattr(self.f, name)

    def close(self):
        self.f.close()
        raise OSError(28, "No space left on device")


def test_a_full_disk_still_removes_the_scratch_file(tmp_path):
    """On a full disk closing the .bin fails too: the scratch file must go all the same, and
    the error of a finished write is not swallowed."""
    writer = IndexWriter(str(tmp_path / "d.bin"), str(tmp_path / "d.idx"), numpy.uint16)
    writer.files[0] = _FullDisk(writer.files[0])
    writer.close()  # a failed run's clean-up: the run's own error is the news
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]
    writer = IndexWriter(str(tmp_path / "e.bin"), str(tmp_path / "e.idx"), numpy.uint16)
    writer.files[1] = _FullDisk(writer.files[1])
    with pytest.raises(OSError, match="No space left"):
        writer.finalize()
    assert not os.path.exists(writer.scratch_path)


def test_finalize_is_once_and_several_documents_at_a_time(tmp_path):
    docs = _documents(5, 30, 1000)
    writer = IndexWriter(str(tmp_path / "d.bin"), str(tmp_path / "d.idx"), numpy.uint16)
    writer.add_documents(numpy.concatenate([t for t, _ in docs]), [lengths for _, lengths in docs])
    writer.finalize()
    with pytest.raises(ValueError, match="already finalized"):
        writer.finalize()
    ours = [open(str(tmp_path / "d") + s, "rb").read() for s in (".bin", ".idx")]
    assert ours == _write("megatron", str(tmp_path / "theirs"), numpy.uint16, docs)
    with pytest.raises(ValueError, match="3 tokens for documents of 4"):
        IndexWriter(str(tmp_path / "e.bin"), str(tmp_path / "e.idx"),
                    numpy.uint16).add_documents(numpy.arange(3), [[1], [3]])
