"""Where preprocessing reads its jsonl from: files, glob patterns, compressed files, stdin.

One job: turn the `--input` values into an ordered list of sources and each source into
line-aligned chunks of about `chunk_bytes` for the tokenizing workers.

- A value is a path, a glob pattern (Megatron's tool takes `--input 'data/*.jsonl'`; matches
  are sorted, so the order does not depend on the file system), or `-` for standard input.
  A path that exists is read as named, glob characters or not. Values keep their order; a
  pattern that matches nothing, a directory, a missing file, a file given twice (it would be
  trained on twice as often, silently) and a second `-` are errors naming the `--input` value.
- `.gz`, `.bz2` and `.xz` files are read through the standard library, `.zst` through the
  `zstandard` package where it is installed (`pip install zstandard`; else an error saying so).
- A UTF-8 byte order mark at a source's start is skipped (json would reject line 1).
- A plain regular file is cut into byte ranges that each worker reads itself; anything else
  (compressed, a pipe, stdin) is read in the parent and its chunks' bytes are handed over.
  `bounded_ordered_map` keeps at most `ahead` chunks in flight, so a stream of any size is
  read in bounded memory (`multiprocessing.Pool.imap` would read it all ahead).

What it does not do: no tokenizing or writing (preprocess.py).
"""

from __future__ import annotations

import bz2
import collections
import glob
import gzip
import lzma
import os
import sys
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

__all__ = ["InputError", "STDIN", "resolve_inputs", "source_chunks", "bounded_ordered_map"]

STDIN = "-"
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as Windows tools write: skipped at a start


class InputError(ValueError):
    """An `--input` value that names no readable jsonl source; the message names it."""


class _ZstdStream:
    """A .zst file's decompressed bytes, frame after frame, with `read(n)`; a file whose last
    frame is cut short is an error (zstandard's stream reader ends such a file silently)."""

    def __init__(self, path: str):
        try:
            import zstandard
        except ImportError:
            raise InputError(f"{path}: reading .zst files needs the zstandard package (pip "
                             f"install zstandard), or decompress it first (zstd -d)") from None
        self._path, self._file = path, open(path, "rb")
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame, self._in_frame, self._out = self._decompressor.decompressobj(), False, b""

    def read(self, size: int) -> bytes:
        while len(self._out) < size:
            data = self._file.read(1 << 20)
            if not data:
                if self._in_frame:
                    raise EOFError("the last zstd frame is cut short")
                break
            while data:
                self._out += self._frame.decompress(data)
                self._in_frame = not self._frame.eof
                if self._frame.eof:  # the next frame starts in what is left
                    data, self._frame = self._frame.unused_data, self._decompressor.decompressobj()
                else:
                    data = b""
        block, self._out = self._out[:size], self._out[size:]
        return block

    def close(self) -> None:
        self._file.close()


_DECOMPRESSORS = {".gz": gzip.GzipFile, ".bz2": bz2.BZ2File, ".xz": lzma.LZMAFile,
                  ".zst": _ZstdStream}  # each opens a path for reading: path -> stream


def _compression(path: str) -> Optional[str]:
    ext = os.path.splitext(path)[1].lower()
    return ext if ext in _DECOMPRESSORS else None


def resolve_inputs(values: Sequence[str] | str) -> List[str]:
    """The sources `--input` names, in order: patterns expanded (sorted), each checked."""
    values = [values] if isinstance(values, str) else list(values)
    if not values:
        raise InputError("--input: give at least one jsonl file, glob pattern or - (stdin)")
    sources, seen = [], {}
    for value in values:
        if value == STDIN:
            if STDIN in seen:
                raise InputError("--input: - (standard input) is given twice")
            matches = [STDIN]
        elif glob.has_magic(value) and not os.path.exists(value):  # a name like 'a[1]'
            matches = sorted(glob.glob(value, recursive=True))
            if not matches:
                raise InputError(f"--input {value!r} matches no file")
        else:
            matches = [value]
        for path in matches:
            where = f"--input {path}" if path == value else f"--input {value!r}: {path}"
            if path != STDIN and not os.path.exists(path):
                raise InputError(f"{where}: no such file")
            if path != STDIN and os.path.isdir(path):
                raise InputError(f"{where} is a directory; name its files (e.g. --input "
                                 f"'{os.path.join(path, '*.jsonl')}')")
            key = path if path == STDIN else os.path.realpath(path)
            if key in seen:
                first_value, first_path = seen[key]
                what = (f"{path} is given twice" if first_path == path
                        else f"{first_path} and {path} are the same file")
                by = ("" if first_value == value == path else f" (by {value!r})"
                      if first_value == value else f" (by {first_value!r} and {value!r})")
                raise InputError(f"--input: {what}{by}; its documents would be written twice")
            seen[key] = value, path
            sources.append(path)
    return sources


def _is_range_readable(path: str) -> bool:
    """Workers can read byte ranges of it themselves: an uncompressed regular file."""
    return path != STDIN and _compression(path) is None and os.path.isfile(path)


def _open_stream(path: str):
    if path == STDIN:
        return sys.stdin.buffer
    ext = _compression(path)
    return _DECOMPRESSORS[ext](path) if ext else open(path, "rb")


def _range_chunks(path: str, chunk_bytes: int) -> Iterator[Tuple[str, int, int]]:
    """~chunk_bytes byte ranges of a regular file that end on line boundaries."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        start = len(_BOM) if f.read(len(_BOM)) == _BOM else 0
        while start < size:
            f.seek(min(start + chunk_bytes, size))
            f.readline()  # move on to the end of the line the cut fell in
            end = min(f.tell(), size)
            yield path, start, end
            start = end


def _stream_chunks(path: str, chunk_bytes: int) -> Iterator[bytes]:
    """~chunk_bytes pieces of a stream, each ending at a line's end (the last may not)."""
    name = "standard input" if path == STDIN else path
    stream = _open_stream(path)
    held, first = b"", True
    try:
        while True:
            try:
                block = stream.read(chunk_bytes)
            except Exception as err:  # zlib.error, EOFError, LZMAError, ZstdError, OSError
                raise InputError(f"{name}: cannot be read to its end ({type(err).__name__}: "
                                 f"{err}); the file is damaged or cut short") from None
            if not block:
                if held:
                    yield held
                return
            held += block
            if first and len(held) >= len(_BOM):
                held, first = held[len(_BOM):] if held.startswith(_BOM) else held, False
            cut = held.rfind(b"\n") + 1
            if cut:
                yield held[:cut]
                held = held[cut:]
    finally:
        if path != STDIN:
            stream.close()


def source_chunks(sources: Sequence[str], chunk_bytes: int) -> Iterator[Tuple[int, object]]:
    """(source index, task) for each chunk of each source, in order. A task is (path, start,
    end) for a worker to read, or the chunk's bytes."""
    for index, path in enumerate(sources):
        chunks = (_range_chunks if _is_range_readable(path) else _stream_chunks)(path,
                                                                                chunk_bytes)
        for task in chunks:
            yield index, task


def bounded_ordered_map(fn: Callable, items: Iterable[Tuple[int, object]], pool=None,
                        ahead: int = 1) -> Iterator[Tuple[int, object]]:
    """(tag, fn(task)) for each (tag, task) of `items`, in order, with at most `ahead` tasks
    submitted to `pool` and not yet taken (none without a pool: fn runs here, lazily)."""
    if pool is None:
        for tag, task in items:
            yield tag, fn(task)
        return
    pending = collections.deque()
    for tag, task in items:
        pending.append((tag, pool.apply_async(fn, (task,))))
        if len(pending) >= ahead:
            tag_done, result = pending.popleft()
            yield tag_done, result.get()
    while pending:
        tag_done, result = pending.popleft()
        yield tag_done, result.get()
