"""A Megatron indexed dataset's `.bin` and `.idx`, written in bounded memory.

One job: write what megatron-core's `IndexedDatasetBuilder` writes, byte for byte (tests check
it), without its index in Python lists. megatron-core's builder keeps every sequence length
and document boundary as a Python int until `finalize` (measured: about 90 bytes a document
preprocessing, 120 merging, so 100 GB for a dataset of a billion documents). Here the
sequence lengths go straight into the `.idx` (after room for its header), the document
boundaries into one scratch file beside it, both in blocks of `_BLOCK` entries; `finalize`
appends the sequence pointers, computed block by block from the lengths written, and the
boundaries, then fills in the header. Memory stays a few MB whatever the dataset's size; the
scratch file takes 8 bytes a document of disk until `finalize`.

    writer = IndexWriter(bin_tmp, idx_tmp, numpy.uint16)
    writer.add_document(tokens, [len(tokens)])    # megatron-core's add_document
    writer.add_documents(tokens, [[3], [2, 4]])   # several, their tokens in one array
    writer.add_index("other_prefix")              # megatron-core's add_index (a whole dataset)
    writer.finalize()                             # the .idx complete; scratch removed
    writer.close()                                # on failure: files closed, scratch removed

The `.idx` layout (megatron-core's MMapIndexedDataset, version 1): the header
b"MMIDIDX\\x00\\x00", version 1 (<Q), the token dtype's code (<B), the sequence count (<Q),
the document count (<Q; document boundaries, the leading 0 included), then the sequence
lengths (int32), the sequences' byte offsets in the `.bin` (int64) and the document
boundaries (int64, as sequence indices).

What it does not do: no sequence modes (multimodal datasets: merge refuses them), no reading.
"""

from __future__ import annotations

import os
import shutil
import struct
from typing import Sequence

import numpy

from megatron_eod.megatron.imports import import_megatron

__all__ = ["IndexWriter", "SCRATCH_SUFFIXES"]

_HEADER = b"MMIDIDX\x00\x00"
_COUNTS_AT = len(_HEADER) + 8 + 1  # the sequence and document counts' place
_LENGTHS_AT = _COUNTS_AT + 16      # where the sequence lengths start
_BLOCK = 1 << 16  # entries a buffer holds before it is written out
SCRATCH_SUFFIXES = (".documents",)  # after the .idx path


class _Column:
    """Integers of one dtype appended to a file: a Python list of up to _BLOCK entries (cheap
    to append to), written out as one array when full."""

    def __init__(self, file, dtype):
        self.file, self.dtype = file, numpy.dtype(dtype)
        self.pending = []
        self.count = 0

    def extend(self, values) -> None:
        self.pending.extend(values)
        if len(self.pending) >= _BLOCK:
            self.flush()

    def append(self, value: int) -> None:
        self.pending.append(value)
        if len(self.pending) >= _BLOCK:
            self.flush()

    def extend_array(self, values: numpy.ndarray) -> None:
        """Many at once (a block of another dataset's index): written as they are."""
        self.flush()
        self.file.write(numpy.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.count += values.size

    def flush(self) -> None:
        if self.pending:
            self.file.write(numpy.array(self.pending, dtype=self.dtype).tobytes())
            self.count += len(self.pending)
            self.pending = []

    def total(self) -> int:
        return self.count + len(self.pending)


class IndexWriter:
    def __init__(self, bin_path: str, idx_path: str, dtype):
        self.indexed = import_megatron("megatron.core.datasets.indexed_dataset")
        self.dtype = numpy.dtype(dtype)
        self.code = self.indexed.DType.code_from_dtype(self.dtype.type)
        self.idx_path, self.scratch_path = idx_path, idx_path + SCRATCH_SUFFIXES[0]
        self.files = []  # closed by close(), whatever happened
        self.finished = False
        self.data = self._open(bin_path, "wb")
        self.idx = self._open(idx_path, "w+b")
        self.idx.write(bytes(_LENGTHS_AT))  # the header, filled in by finalize
        self.lengths = _Column(self.idx, numpy.int32)
        self.documents = _Column(self._open(self.scratch_path, "w+b"), numpy.int64)
        self.documents.append(0)

    def _open(self, path, mode):
        try:
            self.files.append(open(path, mode))
        except BaseException:
            self.close()
            raise
        return self.files[-1]

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """One document of `len(lengths)` sequences whose tokens, in order, are `tokens`."""
        self.data.write(numpy.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        self.lengths.extend(lengths)
        self.documents.append(self.lengths.total())

    def add_documents(self, tokens, lengths: Sequence[Sequence[int]]) -> None:
        """Several documents, `lengths[i]` the sequence lengths of the i-th; `tokens` all their
        tokens in order (as many as the lengths add up to)."""
        tokens = numpy.asarray(tokens, dtype=self.dtype)
        total = sum(map(sum, lengths))
        if total != tokens.size:
            raise ValueError(f"{tokens.size} tokens for documents of {total}")
        self.data.write(tokens.tobytes(order="C"))
        for one in lengths:
            self.lengths.extend(one)
            self.documents.append(self.lengths.total())

    def add_index(self, prefix: str) -> None:
        """Every document of the dataset `prefix` (its `.bin` copied, its index appended)."""
        # its .idx memory-mapped; its .bin not opened as one (an empty part has an empty .bin)
        part = self.indexed.IndexedDataset(prefix, multimodal=False, mmap=False)
        if numpy.dtype(part.index.dtype) != self.dtype:
            raise ValueError(f"{prefix} holds {numpy.dtype(part.index.dtype).name} tokens, "
                             f"this dataset {self.dtype.name}")
        offset = self.lengths.total()
        lengths, boundaries = part.sequence_lengths, part.document_indices
        for start in range(0, len(lengths), _BLOCK):
            self.lengths.extend_array(lengths[start:start + _BLOCK])
        for start in range(1, len(boundaries), _BLOCK):
            self.documents.extend_array(boundaries[start:start + _BLOCK] + offset)
        del part, lengths, boundaries
        with open(prefix + ".bin", "rb") as source:
            shutil.copyfileobj(source, self.data, 16 << 20)

    def finalize(self) -> None:
        """Complete the `.idx` and close everything; the scratch file is removed. Once."""
        if self.finished:
            raise ValueError(f"{self.idx_path} is already finalized")
        self.data.flush()
        self.lengths.flush()
        self.documents.flush()
        sequences, documents = self.lengths.count, self.documents.count
        # the pointers, after the lengths: read back a block, write its pointers at the end
        read_at, write_at, pointer = _LENGTHS_AT, _LENGTHS_AT + 4 * sequences, 0
        while read_at < _LENGTHS_AT + 4 * sequences:
            self.idx.seek(read_at)
            sizes = numpy.frombuffer(self.idx.read(min(_BLOCK * 4, _LENGTHS_AT + 4 * sequences
                                                       - read_at)), dtype=numpy.int32)
            read_at += 4 * sizes.size
            sizes = sizes.astype(numpy.int64) * self.dtype.itemsize
            ends = numpy.cumsum(sizes) + pointer
            self.idx.seek(write_at)
            write_at += self.idx.write((ends - sizes).tobytes())
            pointer = int(ends[-1])
        self.idx.seek(write_at)
        scratch = self.documents.file
        scratch.seek(0)
        shutil.copyfileobj(scratch, self.idx, _BLOCK * 8)
        self.idx.seek(0)
        self.idx.write(_HEADER + struct.pack("<Q", 1) + struct.pack("<B", self.code)
                       + struct.pack("<Q", sequences) + struct.pack("<Q", documents))
        self.finished = True
        self.close()

    def close(self) -> None:
        """Close the files and remove the scratch one, whatever fails on the way (after
        finalize, or on failure: the caller then removes the .bin and .idx)."""
        files, self.files = self.files, []
        error = None
        for f in files:
            try:
                f.close()  # a full disk fails here too, as the buffer is written out
            except OSError as failed:
                error = error or failed
        if os.path.exists(self.scratch_path):
            os.remove(self.scratch_path)
        if error is not None and self.finished:
            raise error
