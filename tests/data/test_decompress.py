"""decompress.py on its own: bounded memory however the data compresses, pzstd's skippable
frames, a read of any size, and the codec told from a pipe that gives a byte at a time."""

import gzip
import io
import os
import sys

import pytest

from megatron_eod.data.decompress import Decompressed, DecompressError, codec_of
from megatron_eod.data.preprocess import output_paths, preprocess_jsonl
from megatron_eod.data.tokenizers import ByteTokenizer

zstandard = pytest.importorskip("zstandard")


def read_all(reader, size=1 << 20):
    out, peak = [], 0
    while True:
        block = reader.read(size)
        assert len(block) <= size
        peak = max(peak, len(reader._out))
        if not block:
            return b"".join(out), peak
        out.append(block)


def test_zstd_memory_stays_bounded_after_incompressible_data():
    # Random bytes grow the pieces fed to zstd; 100 MB of zeros then come out of very few
    # compressed bytes. Before, one step expanded a 64 KiB piece at once (here: all of it).
    data = os.urandom(300_000) + bytes(100_000_000)
    packed = zstandard.ZstdCompressor().compress(data)
    out, peak = read_all(Decompressed(io.BytesIO(packed), "zstd", "bomb"))
    assert out == data
    assert peak < 40 << 20, peak  # ~32 MiB at most a step, plus the 1 MiB asked for


def test_pzstd_skippable_frames_are_zstd():
    text = b'{"text": "hello"}\n'
    frame = zstandard.ZstdCompressor().compress(text)
    skippable = b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd"
    data = skippable + frame + skippable + frame
    assert codec_of(data[:6]) == "zstd"
    assert read_all(Decompressed(io.BytesIO(data), "zstd", "p"))[0] == text * 2


def test_any_read_size_and_negative_reads_everything():
    data = b"".join(b"line %d\n" % i for i in range(5000))
    for size in (1, 7, 4096, -1):
        packed = io.BytesIO(gzip.compress(data[:20000]) + gzip.compress(data[20000:]))
        assert read_all(Decompressed(packed, "gzip", "g"), size if size > 0 else 1 << 30)[0] \
            == data
    assert Decompressed(io.BytesIO(gzip.compress(data)), "gzip", "g").read() == data
    with pytest.raises(DecompressError, match=r"g: its last gzip stream is cut short"):
        Decompressed(io.BytesIO(gzip.compress(data)[:-9]), "gzip", "g").read()


class _OneByteAtATime(io.RawIOBase):
    """A pipe whose writer sends one byte, then the rest later: its first raw read is 1 byte."""

    def __init__(self, data):
        self._data, self._calls = data, 0

    def readable(self):
        return True

    def readinto(self, buffer):
        self._calls += 1
        n = 1 if self._calls == 1 else min(len(buffer), len(self._data))
        buffer[:n], self._data = self._data[:n], self._data[n:]
        return n


def test_compressed_stdin_is_told_however_its_first_bytes_arrive(tmp_path, monkeypatch):
    lines = b"".join(b'{"text": "document %d"}\n' % i for i in range(300))
    (tmp_path / "plain.jsonl").write_bytes(lines)
    tok = ByteTokenizer()
    preprocess_jsonl(str(tmp_path / "plain.jsonl"), str(tmp_path / "ref"), tok, log=lambda m: 0)
    pipe = io.BufferedReader(_OneByteAtATime(gzip.compress(lines)))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(pipe))
    preprocess_jsonl("-", str(tmp_path / "o"), tok, log=lambda m: 0)
    for ours, ref in zip(output_paths(str(tmp_path / "o"), "text"),
                         output_paths(str(tmp_path / "ref"), "text")):
        assert open(ours, "rb").read() == open(ref, "rb").read()
