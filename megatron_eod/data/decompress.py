"""Compressed input, read whole or not at all: gzip, bzip2, xz and zstd, stream after stream.

One job: `Decompressed(file, codec, name).read(n)` gives the bytes of every stream of a
compressed file in turn (gzip members, bzip2 and xz streams, zstd frames: what `cat a.gz b.gz`
and parallel compressors make), at most n at a time, in bounded memory, and raises
`DecompressError` where the data is damaged, cut short or empty. `codec_of` tells the codec
from a file's first bytes, so a misnamed file is still read right.

Why not the standard library's file objects: `BZ2File` and `LZMAFile` end silently at a later
stream they cannot decode (its documents lost without a word), `GzipFile` reads an empty file
as empty data, and zstandard's stream reader ends a cut-short frame silently. Zero bytes
between and after gzip members and xz streams are padding, passed over (gzip itself stops
at zeros between members; Python's gzip module reads on, as here).

What it does not do: no choice of sources and no line splitting (jsonl_inputs.py).
"""

from __future__ import annotations

import bz2
import lzma
import sys
import zlib
from typing import Optional

__all__ = ["DecompressError", "Decompressed", "EXTENSIONS", "codec_of"]

EXTENSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}
_MAGIC = {"gzip": b"\x1f\x8b", "bzip2": b"BZh", "xz": b"\xfd7zXZ\x00",
          "zstd": b"\x28\xb5\x2f\xfd"}
_PADDED = ("gzip", "xz")  # formats whose streams may be followed by zero bytes
_OUT = 1 << 20  # the most bytes one decompression step gives
_IN = 1 << 16  # the most compressed bytes a step reads
# zstd's decompressor takes no output bound, so its input is fed in small pieces: from 64
# bytes, doubled while a step gives far less than _OUT, halved while it gives more, never over
# 1 KiB (a 4-byte zstd block can stand for 128 KiB: a step gives at most ~32 MiB).
_ZSTD_LEAST, _ZSTD_MOST = 64, 1 << 10


class DecompressError(ValueError):
    """Compressed data that cannot be read to its end; the message says why."""


def codec_of(head: bytes) -> Optional[str]:
    """The codec whose magic number `head` (a file's first bytes) starts with, else None."""
    if len(head) >= 4 and 0x50 <= head[0] <= 0x5F and head[1:4] == b"\x2a\x4d\x18":
        return "zstd"  # a skippable frame first, as pzstd writes
    return next((codec for codec, magic in _MAGIC.items() if head.startswith(magic)), None)


class _Zlib:
    """zlib's gzip decompressor with the bz2/lzma decompressors' interface."""

    def __init__(self):
        self._d, self._tail = zlib.decompressobj(wbits=31), b""

    def decompress(self, data: bytes, max_length: int) -> bytes:
        out = self._d.decompress(self._tail + data if self._tail else data, max_length)
        self._tail = self._d.unconsumed_tail
        return out

    needs_input = property(lambda self: not self._tail)
    eof = property(lambda self: self._d.eof)
    unused_data = property(lambda self: self._d.unused_data)


class _Zstd:
    """zstandard's decompressor with the bz2/lzma decompressors' interface (its output is not
    bounded: the caller feeds it small pieces)."""

    def __init__(self):
        try:
            import zstandard
        except ImportError:
            raise DecompressError("reading zstd data needs the zstandard package (pip install "
                                  "zstandard), or decompress it first (zstd -d)") from None
        self._d = zstandard.ZstdDecompressor().decompressobj()

    def decompress(self, data: bytes, max_length: int) -> bytes:
        return self._d.decompress(data) if data else b""

    needs_input = True
    eof = property(lambda self: self._d.eof)
    unused_data = property(lambda self: self._d.unused_data)


_NEW = {"gzip": _Zlib, "bzip2": bz2.BZ2Decompressor,
        "xz": lambda: lzma.LZMADecompressor(format=lzma.FORMAT_XZ), "zstd": _Zstd}


class Decompressed:
    """The decompressed bytes of the binary file object `file` (its remaining data), `codec`
    one of EXTENSIONS' values; errors are DecompressError naming `name`."""

    def __init__(self, file, codec: str, name: str):
        self._file, self._codec, self._name = file, codec, name
        self._step_in = _ZSTD_LEAST if codec == "zstd" else _IN
        try:
            self._d = _NEW[codec]()
        except DecompressError as err:  # zstandard is missing
            raise DecompressError(f"{name}: {err}") from None
        self._input, self._out = b"", bytearray()
        self._in_stream, self._streams, self._done = False, 0, False

    def read(self, size: int = -1) -> bytes:
        """At most `size` bytes (all that is left for a negative size); b"" only at the end."""
        size = sys.maxsize if size < 0 else size
        try:
            while len(self._out) < size and not self._done:
                self._step()
        except DecompressError:
            raise
        except Exception as err:  # zlib.error, OSError, LZMAError, ZstdError, EOFError
            raise DecompressError(f"{self._name}: {self._codec} data cannot be read to its end "
                                  f"({type(err).__name__}: {err}); the file is damaged or cut "
                                  f"short") from None
        block = bytes(self._out[:size])
        del self._out[:size]
        return block

    def _step(self) -> None:
        data = b""
        if self._d.needs_input:
            data, self._input = self._input or self._file.read(self._step_in), b""
            if not data:
                self._end()
                return
            if not self._in_stream and self._streams and self._codec in _PADDED:
                data = data.lstrip(b"\0")  # padding after a stream
                if not data:
                    return
            self._in_stream = True
        made = len(self._out)
        self._out += self._d.decompress(data, _OUT)
        made = len(self._out) - made
        if self._codec == "zstd" and data:
            if made > _OUT:
                self._step_in = max(_ZSTD_LEAST, self._step_in // 2)
            elif made < _OUT // 4:
                self._step_in = min(_ZSTD_MOST, self._step_in * 2)
        if self._d.eof:  # a stream ended: what is left of the input starts the next
            self._streams += 1
            self._in_stream = False
            self._input, self._d = self._d.unused_data, _NEW[self._codec]()

    def _end(self) -> None:
        if self._in_stream:
            flushed = self._d.decompress(b"", _OUT)  # output the decompressor still holds
            if flushed:
                self._out += flushed
                return
            raise DecompressError(f"{self._name}: its last {self._codec} stream is cut short; "
                                  f"the file is damaged or cut short")
        if not self._streams:
            raise DecompressError(f"{self._name}: holds no {self._codec} data (empty); the "
                                  f"file is damaged or cut short")
        self._done = True
