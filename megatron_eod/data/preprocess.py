"""jsonl -> Megatron indexed dataset (`{prefix}_{key}_document.bin/.idx`), as Megatron's tool.

One job: read jsonl (one document a line) from one or more sources, tokenize the
`--json-keys` fields, optionally append the EoD id, and write one indexed dataset per key
in megatron-core's format (index_writer.py: the bytes of its `IndexedDatasetBuilder`, in
memory that does not grow with the corpus), so that `IndexedDataset` / `GPTDataset` read it
back unchanged. The sources (files in the order given, glob patterns, gzip/bzip2/xz/zstd
files, stdin) and their chunking are jsonl_inputs.py's; their documents are written in that
order, as one dataset.

Semantics kept from Megatron's `tools/preprocess_data.py`: a field may be a string or a list of
strings; empty documents are written as documents with no sequences and get no EoD; the token
dtype is megatron-core's optimal one for the vocab size. Changed: a list's strings are one
sequence (Megatron's tool writes one sequence per string, which GPTDataset shuffles apart as
if each were a document), and a text that tokenizes to the EoD id (the special token written
out in it, e.g. by a tokenizer that parses specials) is a bad line: it would cut its document
under EoD reset.
Added: every bad line (not UTF-8, malformed JSON, not an object, a missing key, a field that is
not text, text the tokenizer rejects) is an error naming `file:line`, or, with
`skip_bad_lines`, is skipped and counted; blank lines are counted and skipped; any number of
workers writes the same bytes as one, and several inputs the same bytes as their
concatenation (each input's lines its own). Safe replacement: everything is written to `.tmp` files
beside the outputs and renamed into place only after success (metadata, `.bin`, `.idx` last),
so a failed or killed run leaves the previous dataset whole. Each dataset gets a metadata
file (`{prefix}.json`, sidecar.py): the tokenizer's class, vocab size, EoD and pad ids, and
the dataset's dtype, documents, tokens, non-EoD tokens and .bin size.

What it does not do: no sentence splitting (`--split-sentences`): with EoD reset a document
is the unit, and sentences written as sequences would be shuffled apart. Megatron's
`--partitions` (its way to read several files in parallel) is not needed: the workers read
every input's chunks in parallel already.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy

from megatron_eod.data.dataset_files import (dataset_files, discard, install, make_output_folder,
                                              scratch_files, temporary_files)
from megatron_eod.data.index_writer import IndexWriter
from megatron_eod.data.jsonl_inputs import (InputError, bounded_ordered_map, resolve_inputs,
                                             source_chunks, source_name)
from megatron_eod.data.sidecar import tokenizer_identity

__all__ = ["PreprocessError", "PreprocessStats", "preprocess_jsonl", "output_paths"]

_CHUNK_BYTES = 1 << 20  # bytes of jsonl per worker task: amortises IPC, bounds memory
_ENCODER = None  # the per-process encoder; set in the parent and inherited by forked workers


class PreprocessError(ValueError):
    """A bad input line or argument; the message names the file and line or the flag."""


@dataclass
class PreprocessStats:
    documents: int = 0
    empty_documents: int = 0
    tokens: int = 0
    bytes_read: int = 0
    blank_lines: int = 0
    skipped_lines: int = 0
    first_skipped: Optional[str] = None
    seconds: float = 0.0
    outputs: Dict[str, str] = field(default_factory=dict)
    inputs: List[str] = field(default_factory=list)  # the sources read, in order

    def rates(self) -> Tuple[float, float, float]:
        """(documents/s, tokens/s, MB/s) so far."""
        t = max(self.seconds, 1e-9)
        return self.documents / t, self.tokens / t, self.bytes_read / t / 1e6


class _Encoder:
    def __init__(self, tokenizer, json_keys: Sequence[str], append_eod: bool, dtype):
        self.tokenizer, self.json_keys, self.append_eod, self.dtype = (
            tokenizer, tuple(json_keys), append_eod, dtype)
        # A tokenizer may offer `tokenize_array` (ids as a numpy array): the byte tokenizer
        # does, and it is ~2x faster than building the array from a list of ints.
        fast = getattr(tokenizer, "tokenize_array", None)
        self._to_array = fast or (lambda text: numpy.asarray(tokenizer.tokenize(text), dtype))
        self._eod = numpy.array([tokenizer.eod], dtype=dtype)

    def encode(self, raw: bytes):
        """-> ("blank", None) | ("bad", reason) | ("ok", {key: (ids, lengths)})."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            return "bad", f"not valid UTF-8 (byte {err.start} of the line)"
        if not text.strip():
            return "blank", None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            return "bad", f"malformed JSON ({err.msg} at column {err.colno})"
        if not isinstance(record, dict):
            return "bad", f"a line must be a JSON object, got {type(record).__name__}"
        out = {}
        for key in self.json_keys:
            if key not in record:
                return "bad", f"missing key {key!r} (--json-keys {' '.join(self.json_keys)})"
            value = record[key]
            sentences = [value] if isinstance(value, str) else value
            if not isinstance(sentences, list) or not all(isinstance(x, str) for x in sentences):
                return "bad", f"key {key!r} must hold a string or a list of strings"
            pieces: List[numpy.ndarray] = []
            for sentence in sentences:
                try:
                    piece = self._to_array(sentence)
                except UnicodeEncodeError as err:
                    return "bad", f"key {key!r} holds text that is not valid Unicode ({err.reason})"
                except ValueError as err:
                    return "bad", f"key {key!r}: {err}"
                # The EoD id must not come out of a document's text: it would cut the
                # document. (Not the pad id: GPTDataset only masks its loss, and some configs
                # name an ordinary token.)
                if (piece == self.tokenizer.eod).any():
                    return "bad", (f"key {key!r}: the text tokenizes to the tokenizer's EoD id "
                                   f"{self.tokenizer.eod} (it holds that special token as "
                                   f"text); with EoD reset it would cut the document there: "
                                   f"remove it from the text")
                if piece.size:
                    pieces.append(piece)
            if pieces and self.append_eod:
                pieces.append(self._eod)
            ids = (numpy.concatenate(pieces) if len(pieces) > 1 else pieces[0] if pieces
                   else self._eod[:0])
            # One sequence per document: GPTDataset shuffles sequences as documents, so a
            # list's strings written apart (as Megatron's tool does) would be scattered.
            out[key] = (ids.astype(self.dtype, copy=False), [int(ids.size)] if ids.size else [])
        return "ok", out


def _encode_chunk(task):
    """Encode the lines of a chunk: bytes [start, end) of a file for a (path, start, end) task
    (read here), else the task's bytes; one pickled array per key comes back.

    Workers read a file's chunks themselves and return each key's ids of the whole chunk as one
    array, so the parent moves no raw text of plain files and no thousands of small arrays.
    -> (n_lines, [(line_in_chunk, n_bytes, status, reason | {key: lengths})], {key: ids})
    """
    if isinstance(task, bytes):
        data = task
    else:
        path, start, end = task
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
    lines = data.splitlines(keepends=True)
    records, pieces = [], {key: [] for key in _ENCODER.json_keys}
    for i, raw in enumerate(lines):
        status, payload = _ENCODER.encode(raw)
        if status == "ok":
            for key, (ids, _) in payload.items():
                pieces[key].append(ids)
            payload = {key: lengths for key, (_, lengths) in payload.items()}
        records.append((i, len(raw), status, payload))
    dtype = _ENCODER.dtype
    packed = {key: numpy.concatenate(p) if p else numpy.zeros(0, dtype)
              for key, p in pieces.items()}
    return len(lines), records, packed


def _base(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"  # Megatron's tool's name for one json key


def output_paths(output_prefix: str, key: str) -> Tuple[str, str]:
    """The (.bin, .idx) paths Megatron's tool uses for one json key."""
    return dataset_files(_base(output_prefix, key))[:2]


def _check_args(json_keys, workers, log_interval) -> None:
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise PreprocessError(f"--json-keys must name distinct keys, got {list(json_keys)}")
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    if log_interval < 1:
        raise PreprocessError(f"--log-interval must be >= 1, got {log_interval}")


def preprocess_jsonl(input_path: Union[str, Sequence[str]], output_prefix: str, tokenizer,
                     json_keys: Sequence[str] = ("text",), append_eod: bool = False,
                     workers: int = 1, log_interval: int = 1000, skip_bad_lines: bool = False,
                     log=None) -> PreprocessStats:
    """Tokenize `input_path` (a source or a list of them: paths, glob patterns, "-" for stdin)
    into indexed datasets; returns the run's statistics."""
    try:
        sources = resolve_inputs(input_path, _own_files(output_prefix, json_keys))
        return _preprocess(sources, output_prefix, tokenizer, json_keys,
                           append_eod, workers, log_interval, skip_bad_lines, log)
    except InputError as err:
        raise PreprocessError(str(err)) from None


def _own_files(output_prefix: str, json_keys: Sequence[str]) -> List[str]:
    """Every file a run writes (and its .tmp), which no input may be."""
    bases = [_base(output_prefix, key) for key in json_keys]
    return [path for base in bases
            for path in (*dataset_files(base), *temporary_files(base), *scratch_files(base))]


def _preprocess(sources, output_prefix, tokenizer, json_keys, append_eod, workers, log_interval,
                skip_bad_lines, log) -> PreprocessStats:
    from megatron_eod.megatron.imports import import_megatron

    DType = import_megatron("megatron.core.datasets.indexed_dataset").DType
    global _ENCODER
    _check_args(json_keys, workers, log_interval)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    _ENCODER = _Encoder(tokenizer, json_keys, append_eod, dtype)
    stats = PreprocessStats(inputs=list(sources))
    make_output_folder(output_prefix)
    bases = {key: _base(output_prefix, key) for key in json_keys}
    for base in bases.values():
        discard(base)  # a killed run's leftovers
    temps = {key: temporary_files(base) for key, base in bases.items()}
    builders = {}
    counts = {key: [0, 0, -1] for key in json_keys}  # tokens, EoD tokens, largest id
    eod = getattr(tokenizer, "eod", None)
    pool = None
    start = time.perf_counter()
    try:
        for key in json_keys:
            builders[key] = IndexWriter(temps[key][0], temps[key][1], dtype)
        if workers > 1:
            pool = multiprocessing.get_context("fork").Pool(workers)
        # A few chunks a worker in flight: enough to keep them busy, and a stream read in the
        # parent (compressed, stdin) is never held whole.
        results = bounded_ordered_map(_encode_chunk, source_chunks(sources, _CHUNK_BYTES),
                                      pool, ahead=3 * workers)
        source = None
        for index, (n_lines, records, packed) in results:
            if index != source:  # a new input: its line numbers start at 1
                source, first_line = index, 1
                name = source_name(sources[index])
                if len(sources) > 1:
                    log(f"reading {name} ({index + 1} of {len(sources)} inputs)")
            documents = {key: [] for key in json_keys}  # each good line's sequence lengths
            for key, ids in packed.items():
                counts[key][0] += int(ids.size)
                counts[key][1] += int(numpy.count_nonzero(ids == eod)) if eod is not None else 0
                if ids.size:
                    counts[key][2] = max(counts[key][2], int(ids.max()))
            for i, n_bytes, status, payload in records:
                stats.bytes_read += n_bytes
                if status == "blank":
                    stats.blank_lines += 1
                    continue
                if status == "bad":
                    where = f"{name}:{first_line + i}: {payload}"
                    if not skip_bad_lines:
                        raise PreprocessError(where + " (or pass --skip-bad-lines)")
                    stats.skipped_lines += 1
                    stats.first_skipped = stats.first_skipped or where
                    continue
                doc_tokens = 0
                for key, lengths in payload.items():
                    documents[key].append(lengths)
                    doc_tokens += sum(lengths)
                stats.tokens += doc_tokens
                stats.documents += 1
                stats.empty_documents += int(doc_tokens == 0)
                if stats.documents % log_interval == 0:
                    stats.seconds = time.perf_counter() - start
                    d, t, mb = stats.rates()
                    log(f"processed {stats.documents} documents "
                        f"({d:.0f} docs/s, {t:.0f} tokens/s, {mb:.2f} MB/s)")
            for key in json_keys:  # the chunk's tokens: its good lines', in order
                builders[key].add_documents(packed[key], documents[key])
            first_line += n_lines
        for builder in builders.values():
            builder.finalize()
        for key, base in bases.items():  # only now replace what was there
            tokens, eods, largest = counts[key]
            install(base, {
                "tokenizer": tokenizer_identity(tokenizer),
                "dtype": numpy.dtype(dtype).name, "documents": stats.documents,
                "tokens": tokens, "non_eod_tokens": tokens - eods, "max_token_id": largest,
                "bin_bytes": os.path.getsize(temps[key][0])})
            stats.outputs[key] = base
    except BaseException:
        for builder in builders.values():
            builder.close()  # (errors closing a failed run's files are not news)
        for base in bases.values():
            discard(base)
        raise
    finally:
        if pool is not None:  # (and let go of it: a failed run's traceback keeps this frame)
            pool.terminate()
            pool.join()
            pool = results = None
        _ENCODER = None
    stats.seconds = time.perf_counter() - start
    return stats

