"""A Megatron indexed dataset's `.bin` and `.idx`, written in bounded memory.

One job: write what megatron-core's `IndexedDatasetBuilder` writes, byte for byte (tests check
it), without its index in Python lists. megatron-core's builder keeps every sequence length
and document boundary as a Python int until `finalize` (measured: about 90 bytes a document
preprocessing, 120 merging, so 100 GB for a dataset of a billion documents); here they go to
two scratch files beside the output as they come, in blocks of `_BLOCK` entries, and
`finalize` streams them into the `.idx` with the sequence pointers computed block by block.
Memory stays a few tens of MB whatever the dataset's size.

    writer = IndexWriter(bin_tmp, idx_tmp, numpy.uint16)
    writer.add_document(tokens, [len(tokens)])    # megatron-core's add_document
    writer.add_index("other_prefix")              # megatron-core's add_index (a whole dataset)
    writer.finalize()                             # the .idx; scratch files removed
    writer.close()                                # on failure: files closed, scratch removed

The `.idx` layout (megatron-core's MMapIndexedDataset, version 1): the header
b"MMIDIDX\\x00\\x00", version 1 (<Q), the token dtype's code (<B), the sequence count (<Q),
the document count (<Q; document boundaries, including the leading 0), then the sequence
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
_BLOCK = 1 << 20  # entries a scratch buffer holds before it is written out
SCRATCH_SUFFIXES = (".lengths", ".documents")  # after the .idx path


class _Column:
    """A growing column of one dtype: a buffer of _BLOCK entries, spilled to a file."""

    def __init__(self, path: str, dtype):
        self.path, self.dtype = path, numpy.dtype(dtype)
        self.file = open(path, "wb")
        self.buffer = numpy.empty(_BLOCK, dtype=self.dtype)
        self.used = 0
        self.count = 0

    def extend(self, values) -> None:
        values = numpy.asarray(values, dtype=self.dtype).reshape(-1)
        while values.size:
            take = min(values.size, _BLOCK - self.used)
            self.buffer[self.used:self.used + take] = values[:take]
            self.used += take
            self.count += take
            values = values[take:]
            if self.used == _BLOCK:
                self.flush()

    def append(self, value: int) -> None:
        if self.used == _BLOCK:
            self.flush()
        self.buffer[self.used] = value
        self.used += 1
        self.count += 1

    def flush(self) -> None:
        self.file.write(self.buffer[:self.used].tobytes())
        self.used = 0

    def blocks(self):
        """The whole column, block by block (after the last flush)."""
        self.flush()
        self.file.close()
        with open(self.path, "rb") as f:
            while True:
                raw = f.read(_BLOCK * self.dtype.itemsize)
                if not raw:
                    return
                yield numpy.frombuffer(raw, dtype=self.dtype)

    def discard(self) -> None:
        self.file.close()
        if os.path.exists(self.path):
            os.remove(self.path)


class IndexWriter:
    def __init__(self, bin_path: str, idx_path: str, dtype):
        indexed = import_megatron("megatron.core.datasets.indexed_dataset")
        self.dtype = numpy.dtype(dtype)
        self.code = indexed.DType.code_from_dtype(self.dtype.type)
        self.idx_path = idx_path
        self.data = open(bin_path, "wb")
        self.lengths = _Column(idx_path + SCRATCH_SUFFIXES[0], numpy.int32)
        self.documents = _Column(idx_path + SCRATCH_SUFFIXES[1], numpy.int64)
        self.documents.append(0)

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """One document of `len(lengths)` sequences whose tokens, in order, are `tokens`."""
        self.data.write(numpy.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        self.lengths.extend(lengths)
        self.documents.append(self.lengths.count)

    def add_index(self, prefix: str) -> None:
        """Every document of the dataset `prefix` (its `.bin` copied, its index appended)."""
        indexed = import_megatron("megatron.core.datasets.indexed_dataset")
        # its .idx memory-mapped; its .bin not opened as one (an empty part has an empty .bin)
        part = indexed.IndexedDataset(prefix, multimodal=False, mmap=False)
        if numpy.dtype(part.index.dtype) != self.dtype:
            raise ValueError(f"{prefix} holds {numpy.dtype(part.index.dtype).name} tokens, "
                             f"this dataset {self.dtype.name}")
        offset = self.lengths.count
        lengths, boundaries = part.sequence_lengths, part.document_indices
        for start in range(0, len(lengths), _BLOCK):
            self.lengths.extend(lengths[start:start + _BLOCK])
        for start in range(1, len(boundaries), _BLOCK):
            self.documents.extend(boundaries[start:start + _BLOCK] + offset)
        del part, lengths, boundaries
        with open(prefix + ".bin", "rb") as source:
            shutil.copyfileobj(source, self.data, 16 << 20)

    def finalize(self) -> None:
        """Write the `.idx` and close everything; the scratch files are removed."""
        self.data.close()
        with open(self.idx_path, "wb") as idx:
            idx.write(_HEADER)
            idx.write(struct.pack("<Q", 1))
            idx.write(struct.pack("<B", self.code))
            idx.write(struct.pack("<Q", self.lengths.count))
            idx.write(struct.pack("<Q", self.documents.count))
            lengths_path = self.lengths.path
            for block in self.lengths.blocks():
                idx.write(block.tobytes())
            pointer = 0  # the byte offset of the next sequence in the .bin
            with open(lengths_path, "rb") as f:
                while True:
                    raw = f.read(_BLOCK * 4)
                    if not raw:
                        break
                    sizes = numpy.frombuffer(raw, dtype=numpy.int32).astype(numpy.int64)
                    sizes *= self.dtype.itemsize
                    ends = numpy.cumsum(sizes) + pointer
                    idx.write((ends - sizes).tobytes())
                    pointer = int(ends[-1])
            for block in self.documents.blocks():
                idx.write(block.tobytes())
        self.close()

    def close(self) -> None:
        """Close the files and remove the scratch ones (after finalize, or on failure)."""
        self.data.close()
        self.lengths.discard()
        self.documents.discard()
