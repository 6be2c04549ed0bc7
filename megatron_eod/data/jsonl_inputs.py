"""Where preprocessing reads its jsonl from: files, glob patterns, compressed files, stdin.

One job: turn the `--input` values into an ordered list of sources and each source into
line-aligned chunks of about `chunk_bytes` for the tokenizing workers.

- A value is a path, a glob pattern (Megatron's tool takes `--input 'data/*.jsonl'`; matches
  are sorted, so the order does not depend on the file system; directories among them are
  passed over), or `-` for standard input. A path that exists is read as named, glob
  characters or not. Values keep their order. A pattern that matches no file, a directory, a
  missing or unreadable file, a file given twice (by a glob and a path, a link, `-` and
  /dev/stdin: it would be trained on twice as often, silently), and one of the run's own
  output files are errors naming the `--input` value.
- gzip, bzip2, xz and zstd data (zstd through the `zstandard` package) are read whatever the
  file's name says, told by their first bytes, through decompress.py (every stream, damage
  detected); a `.gz`/`.bz2`/`.xz`/`.zst` name over other data is an error.
- A UTF-8 byte order mark at a source's start is skipped (json would reject line 1). Each
  source's lines are its own: one without a final newline does not run into the next.
- A plain regular file is cut into byte ranges that each worker reads itself; anything else
  (compressed, a pipe, stdin) is read in the parent and its chunks' bytes are handed over.
  `bounded_ordered_map` keeps at most `ahead` chunks in flight, so a stream of any size is
  read in bounded memory (`multiprocessing.Pool.imap` would read it all ahead).

What it does not do: no tokenizing or writing (preprocess.py).
"""

from __future__ import annotations

import collections
import glob
import os
import stat
import sys
from typing import Callable, Iterable, Iterator, List, Sequence, Tuple

from megatron_eod.data.decompress import EXTENSIONS, Decompressed, DecompressError, codec_of

__all__ = ["InputError", "STDIN", "resolve_inputs", "source_chunks", "source_name",
           "bounded_ordered_map"]

STDIN = "-"
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as Windows tools write: skipped at a start
_MAGIC_BYTES = 6  # enough of a file's start to tell its compression


class InputError(ValueError):
    """An `--input` value that names no readable jsonl source; the message names it."""


def source_name(path: str) -> str:
    return "<stdin>" if path == STDIN else path


def _identity(path: str, where: str):
    """The file behind `path` (device, inode), so that links and /dev/stdin are told apart
    from other files; InputError where it cannot be read."""
    if path == STDIN:
        if sys.stdin is None or getattr(sys.stdin, "buffer", None) is None:
            raise InputError("--input -: standard input is closed")
        try:
            info = os.fstat(sys.stdin.buffer.fileno())
        except (OSError, ValueError):  # not a real file (e.g. replaced in a test)
            return STDIN
        return info.st_dev, info.st_ino
    try:
        info = os.stat(path)
    except OSError as err:
        why = err.strerror if os.path.lexists(path) else "no such file"
        raise InputError(f"{where}: {why}") from None
    if stat.S_ISDIR(info.st_mode):
        raise InputError(f"{where} is a directory; name its files (e.g. --input "
                         f"'{os.path.join(path, '*.jsonl')}')")
    if stat.S_ISREG(info.st_mode):  # (a pipe is not opened here: that would wait for a writer)
        try:
            open(path, "rb").close()
        except OSError as err:
            raise InputError(f"{where}: cannot be read ({err.strerror})") from None
    return info.st_dev, info.st_ino


def resolve_inputs(values: Sequence[str] | str, outputs: Sequence[str] = ()) -> List[str]:
    """The sources `--input` names, in order: patterns expanded (sorted), each checked.
    `outputs`: the run's own files, which no input may be."""
    values = [values] if isinstance(values, str) else list(values)
    if not values:
        raise InputError("--input: give at least one jsonl file, glob pattern or - (stdin)")
    own = {}
    for path in outputs:
        if os.path.exists(path):
            info = os.stat(path)
            own[info.st_dev, info.st_ino] = path
    sources, seen = [], {}
    for value in values:
        if value != STDIN and glob.has_magic(value) and not os.path.exists(value):
            matches = [m for m in sorted(glob.glob(value, recursive=True))
                       if not os.path.isdir(m)]  # a pattern stands for files ('data/**')
            if not matches:
                raise InputError(f"--input {value!r} matches no file")
        else:
            matches = [value]
        for path in matches:
            where = f"--input {source_name(path)}" if path == value else \
                f"--input {value!r}: {path}"
            key = _identity(path, where)
            if key in own:
                raise InputError(f"{where} is this run's own output ({own[key]}): name the "
                                 f"jsonl inputs only, or write the output elsewhere")
            if key in seen:
                first_value, first_path = seen[key]
                what = (f"{source_name(path)} is given twice" if first_path == path
                        else f"{source_name(first_path)} and {path} are the same file")
                by = ("" if first_value == value == path else f" (by {value!r})"
                      if first_value == value else f" (by {first_value!r} and {value!r})")
                raise InputError(f"--input: {what}{by}; its documents would be written twice")
            seen[key] = value, path
            sources.append(path)
    return sources


def _range_chunks(path: str, size: int, start: int,
                  chunk_bytes: int) -> Iterator[Tuple[str, int, int]]:
    """~chunk_bytes byte ranges of a regular file from `start`, ending on line boundaries."""
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + chunk_bytes, size))
            f.readline()  # move on to the end of the line the cut fell in
            end = min(f.tell(), size)
            yield path, start, end
            start = end


def _reader(read: Callable[[int], bytes], name: str) -> Callable[[int], bytes]:
    def checked(size: int) -> bytes:
        try:
            return read(size)
        except DecompressError as err:
            raise InputError(str(err)) from None
        except OSError as err:
            raise InputError(f"{name}: cannot be read to its end ({err})") from None
    return checked


def _stream_chunks(read: Callable[[int], bytes], chunk_bytes: int) -> Iterator[bytes]:
    """~chunk_bytes pieces of a stream, each ending at a line's end (the last may not); the
    time is linear in the data, however long its lines."""
    head = b""
    while len(head) < len(_BOM):
        more = read(len(_BOM) - len(head))
        if not more:
            break
        head += more
    pieces = [] if head == _BOM or not head else [head]
    while True:
        block = read(chunk_bytes)
        if not block:
            if pieces:
                yield b"".join(pieces)
            return
        cut = block.rfind(b"\n") + 1
        if cut:
            pieces.append(block[:cut])
            yield b"".join(pieces)
            pieces = [block[cut:]] if cut < len(block) else []
        else:
            pieces.append(block)


class _Prefixed:
    """A binary stream whose first bytes were read already (to tell its compression)."""

    def __init__(self, head: bytes, stream):
        self._head, self._stream = head, stream

    def read(self, size: int = -1) -> bytes:
        if not self._head:
            return self._stream.read(size)
        if size < 0:
            block, self._head = self._head + self._stream.read(), b""
        else:
            block, self._head = self._head[:size], self._head[size:]
        return block


def _open(path: str):
    """(binary file, a stream of its data, codec or None, its first bytes, whether workers can
    read ranges of it) of a source."""
    name = source_name(path)
    f = sys.stdin.buffer if path == STDIN else open(path, "rb")
    regular = path != STDIN and stat.S_ISREG(os.fstat(f.fileno()).st_mode)
    if regular:
        head, stream = f.peek(_MAGIC_BYTES)[:_MAGIC_BYTES], f
    else:  # a pipe: read (read() waits for all 6 bytes, or the end) and put back in front
        head = f.read(_MAGIC_BYTES)
        stream = _Prefixed(head, f)
    codec = codec_of(head)
    named = EXTENSIONS.get(os.path.splitext(path)[1].lower())
    if named and codec != named:
        if path != STDIN:
            f.close()
        if not head:
            raise InputError(f"{name}: holds no {named} data (empty); the file is damaged or "
                             f"cut short")
        found = f"{codec} data" if codec else f"not (it starts with {head!r})"
        raise InputError(f"{name}: named as {named} data, but it is {found}; rename it or "
                         f"compress it again")
    return f, stream, codec, head, regular and codec is None


def source_chunks(sources: Sequence[str], chunk_bytes: int) -> Iterator[Tuple[int, object]]:
    """(source index, task) for each chunk of each source, in order. A task is (path, start,
    end) for a worker to read, or the chunk's bytes."""
    for index, path in enumerate(sources):
        name = source_name(path)
        f, stream, codec, head, ranges = _open(path)
        try:
            if ranges:
                size = os.fstat(f.fileno()).st_size
                f.close()
                chunks = _range_chunks(path, size, len(_BOM) if head.startswith(_BOM) else 0,
                                       chunk_bytes)
            else:
                read = Decompressed(stream, codec, name).read if codec else stream.read
                chunks = _stream_chunks(_reader(read, name), chunk_bytes)
            for task in chunks:
                yield index, task
        except DecompressError as err:  # (zstandard missing)
            raise InputError(str(err)) from None
        finally:
            if path != STDIN:
                f.close()


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
