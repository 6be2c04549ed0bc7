"""Start-up checks of a Megatron indexed dataset against itself and the training tokenizer.

One job: before the first step, refuse a dataset that would fail late or train wrongly, with a
`DatasetError` naming the file and the rule:
* the `.idx` is one (magic, version, a known dtype code, a size that fits its counts), its
  document and sequence tables are consistent, and the `.bin` holds exactly the bytes the
  index points at (a truncated or swapped `.bin`/`.idx` pair);
* with the metadata file preprocessing writes (sidecar.py): the pair is the one it describes
  (dtype, documents, tokens, bytes); the training tokenizer has its EoD id, gives its probe
  text the same ids, and has a vocabulary that covers its largest token id; it holds non-EoD
  tokens;
* without one (Megatron's own tool): a bounded scan (at most `scan_tokens`, spread over the
  file; the whole file when smaller) for token ids outside the vocabulary, and, when the scan
  covered everything, for a dataset of EoD tokens only. Results are cached per file state.
* a dataset with no tokens is refused.

What it does not do: no repair, no reading of whole large files (the scan is bounded).
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Tuple

import numpy

from megatron_eod.data.sidecar import probe_digest, read_sidecar, sidecar_path

__all__ = ["DatasetError", "SCAN_TOKENS", "check_dataset", "check_files", "sequence_count",
           "largest_token", "document_ends"]

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = len(_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequences, documents
_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
           6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
_SCANS: Dict[Tuple[str, int, float, int], Tuple[int, int, bool]] = {}


class DatasetError(ValueError):
    """A dataset that cannot be trained on as given; the message names the file and rule."""


SCAN_TOKENS = 1 << 24


def check_dataset(prefix: str, tokenizer, scan_tokens: Optional[int] = None,
                  eod_flags: Optional[Callable[[int], Optional[str]]] = None,
                  reset_flags: str = "") -> None:
    """Raise DatasetError unless `prefix`.bin/.idx is whole and fits `tokenizer`. Without
    metadata, at most `scan_tokens` (default SCAN_TOKENS; 0: no scan) tokens are read.
    `eod_flags(eod)`, where given, names the training flags that give the tokenizer that EoD
    id (for an EoD mismatch's message). `reset_flags`: the EoD flags the run passes (e.g.
    "--reset-attention-mask"), which data without any EoD would make do nothing."""
    scan_tokens = SCAN_TOKENS if scan_tokens is None else scan_tokens
    bin_ = prefix + ".bin"
    dtype, _, tokens, meta = check_files(prefix)
    if tokens == 0:
        raise DatasetError(f"{prefix}: the dataset has no tokens")
    if meta is not None:
        _check_against_tokenizer(prefix, meta, tokenizer, eod_flags)
        if reset_flags and meta.get("non_eod_tokens") == tokens:
            raise DatasetError(_no_eod(prefix, tokenizer.eod, reset_flags))
        return
    if scan_tokens <= 0:
        return
    largest, non_eod, whole = _scan(bin_, dtype, tokens, tokenizer.eod, scan_tokens)
    if reset_flags and whole and non_eod == tokens:
        raise DatasetError(_no_eod(prefix, tokenizer.eod, reset_flags))
    if largest >= tokenizer.vocab_size:
        raise DatasetError(f"{bin_}: token id {largest} is outside the training tokenizer's "
                           f"vocabulary ({tokenizer.vocab_size}); the data was made with "
                           f"another tokenizer or --vocab-size")
    if whole and non_eod == 0:
        raise DatasetError(f"{bin_}: every token is the EoD id {tokenizer.eod}: nothing to "
                           f"learn (wrong --tokenizer-type or data)")


def check_files(prefix: str):
    """-> (token dtype, documents, tokens, metadata or None) of `prefix`.bin/.idx, checking the
    pair against itself and against its metadata file where there is one (DatasetError)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    dtype, lengths, pointers, documents = _read_index(idx)
    try:
        size = os.path.getsize(bin_)
    except OSError as err:
        raise DatasetError(f"{bin_}: cannot be read ({err.strerror})") from None
    itemsize = numpy.dtype(dtype).itemsize
    expected = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
    if size != expected:
        raise DatasetError(f"{bin_}: {size} bytes, but {idx} points at {expected} ({len(lengths)}"
                           f" sequences of {numpy.dtype(dtype).name}); the pair is truncated or "
                           f"from different runs: re-run tools/preprocess_data.py")
    tokens = int(lengths.sum(dtype=numpy.int64))
    try:
        meta = read_sidecar(prefix)
    except ValueError as err:  # unreadable, or another tool's file of that name
        raise DatasetError(str(err)) from None
    held = (numpy.dtype(dtype).name, len(documents) - 1, tokens, size)
    if meta is not None:
        recorded = tuple(meta.get(k) for k in ("dtype", "documents", "tokens", "bin_bytes"))
        if recorded != held:
            raise DatasetError(f"{prefix}.bin/.idx hold {held[1]} documents, {tokens} {held[0]} "
                               f"tokens, {size} bytes, but {sidecar_path(prefix)} describes "
                               f"{recorded[1]}, {recorded[2]} {recorded[0]}, {recorded[3]}: the "
                               f"files are not the ones preprocessing wrote (re-run "
                               f"tools/preprocess_data.py)")
    return dtype, held[1], tokens, meta


def _no_eod(prefix, eod, reset_flags) -> str:
    return (f"{prefix}: the data holds no EoD id {eod} (made without --append-eod?), so "
            f"{reset_flags} would find no document boundary: every row would train as one "
            f"document. Re-run tools/preprocess_data.py with --append-eod, or drop "
            f"{reset_flags}")


def sequence_count(prefix: str) -> int:
    """The sequences `prefix`.idx holds (its header only; check_dataset checked the rest)."""
    with open(prefix + ".idx", "rb") as f:
        head = f.read(_HEADER)
    return int(numpy.frombuffer(head, numpy.uint64, 1, 18)[0])


def largest_token(prefix: str, eod: int, scan_tokens: int = SCAN_TOKENS) -> int:
    """The largest token id of `prefix` (a dataset check_files passed) in a bounded scan (the
    whole file when smaller); -1 without tokens. Reads the index's header and last entries."""
    dtype, lengths, pointers, _ = _open_index(prefix + ".idx")
    if not len(lengths):
        return -1
    tokens = int(pointers[-1]) // numpy.dtype(dtype).itemsize + int(lengths[-1])
    return _scan(prefix + ".bin", dtype, tokens, eod, scan_tokens)[0] if tokens else -1


def document_ends(prefix: str, limit: int = 1000) -> numpy.ndarray:
    """The last token of the non-empty ones among up to `limit` documents of `prefix` (a
    dataset check_files passed), spread evenly; reads ~3 `limit` index entries."""
    dtype, lengths, pointers, documents = _open_index(prefix + ".idx")
    count = len(documents) - 1
    picks = numpy.unique(numpy.linspace(0, count - 1, min(count, limit)).astype(numpy.int64))
    first, after = numpy.asarray(documents[picks]), numpy.asarray(documents[picks + 1])
    last = (after - 1)[after > first]  # each picked document's last sequence
    last = last[numpy.asarray(lengths[last]) > 0]
    if not len(last):
        return numpy.zeros(0, dtype=dtype)
    at = numpy.asarray(pointers[last]) // numpy.dtype(dtype).itemsize + lengths[last] - 1
    data = numpy.memmap(prefix + ".bin", dtype=dtype, mode="r")
    ends = numpy.array(data[at])
    del data
    return ends


# Index entries per step of the checks below: memory stays ~100 MB however large the index
# (a billion documents: ~20 GB of tables, on every rank of a node at once).
_CHUNK = 1 << 22


def _table(idx, dtype, count, offset):
    """A memory-mapped table of the index (read as the checks walk it, never all at once)."""
    if count == 0:
        return numpy.zeros(0, dtype)
    return numpy.memmap(idx, dtype, mode="r", offset=offset, shape=(count,))


def _offsets_follow_lengths(lengths, pointers, itemsize) -> bool:
    """pointers[0] == 0, lengths >= 0, pointers[i + 1] - pointers[i] == lengths[i] * itemsize,
    a chunk at a time."""
    if len(lengths) and pointers[0] != 0:
        return False
    for start in range(0, len(lengths), _CHUNK):
        stop = min(start + _CHUNK, len(lengths))
        chunk = numpy.asarray(lengths[start:stop])
        steps = numpy.diff(numpy.asarray(pointers[start:stop + 1]))
        if (chunk < 0).any() or (steps != chunk[:len(steps)].astype(numpy.int64) * itemsize
                                 ).any():
            return False
    return True


def _ascending(table) -> bool:
    """No entry below the one before it, a chunk at a time."""
    return all((numpy.diff(numpy.asarray(table[start:start + _CHUNK + 1])) >= 0).all()
               for start in range(0, len(table), _CHUNK))


def _read_index(idx: str):
    """_open_index, then its tables walked (a chunk at a time) for consistency."""
    dtype, lengths, pointers, documents = _open_index(idx)
    if not _offsets_follow_lengths(lengths, pointers, numpy.dtype(dtype).itemsize):
        raise DatasetError(f"{idx}: sequence offsets do not follow the sequence lengths; the "
                           f"index is damaged")
    if (len(documents) == 0 or documents[0] != 0 or documents[-1] != len(lengths)
            or not _ascending(documents)):
        raise DatasetError(f"{idx}: the document table does not cover the {len(lengths)} "
                           f"sequences; the index is damaged")
    return dtype, lengths, pointers, documents


def _open_index(idx: str):
    """(dtype, lengths, pointers, documents) of `idx`, its header and size checked, the
    tables memory-mapped."""
    try:
        with open(idx, "rb") as f:
            head = f.read(_HEADER)
    except OSError as err:
        raise DatasetError(f"{idx}: cannot be read ({err.strerror})") from None
    if len(head) < _HEADER or head[:len(_MAGIC)] != _MAGIC:
        raise DatasetError(f"{idx}: not a Megatron indexed dataset index (bad header)")
    version, code, sequences, docs = (
        int(numpy.frombuffer(head, numpy.uint64, 1, 9)[0]), head[17],
        int(numpy.frombuffer(head, numpy.uint64, 1, 18)[0]),
        int(numpy.frombuffer(head, numpy.uint64, 1, 26)[0]))
    if version != 1:
        raise DatasetError(f"{idx}: index version {version}, expected 1")
    if code not in _DTYPES:
        raise DatasetError(f"{idx}: unknown token dtype code {code} (valid: "
                           f"{sorted(_DTYPES)}); the index is damaged")
    size = os.path.getsize(idx)
    expected = _HEADER + 12 * sequences + 8 * docs
    if size == expected + sequences and sequences:
        raise DatasetError(f"{idx}: a multimodal dataset (a mode per sequence), not GPT "
                           f"pretraining data")
    if size != expected:
        raise DatasetError(f"{idx}: {size} bytes, but its header ({sequences} sequences, "
                           f"{docs - 1 if docs else 0} documents) needs {expected}; the index "
                           f"is damaged")
    lengths = _table(idx, numpy.int32, sequences, _HEADER)
    pointers = _table(idx, numpy.int64, sequences, _HEADER + 4 * sequences)
    documents = _table(idx, numpy.int64, docs, _HEADER + 12 * sequences)
    return _DTYPES[code], lengths, pointers, documents


# A training tokenizer without an end-of-document token: Megatron-LM's HuggingFaceTokenizer
# takes the eos from a directory's tokenizer_config.json (a bare tokenizer.json has none).
NO_EOS = ("the training tokenizer has no end-of-document (eos) token; for --tokenizer-type "
          "HuggingFaceTokenizer give --tokenizer-model a directory whose tokenizer_config.json "
          "names its eos_token")


def _check_against_tokenizer(prefix, meta, tokenizer, eod_flags):
    where = sidecar_path(prefix)
    made = meta.get("tokenizer", {})
    if made.get("eod") != tokenizer.eod:
        flags = eod_flags(made["eod"]) if eod_flags and isinstance(made.get("eod"), int) else None
        raise DatasetError(f"{where}: the data was made with EoD id {made.get('eod')} "
                           f"({made.get('class')}, vocab {made.get('vocab_size')}), the training "
                           f"tokenizer's EoD id is {tokenizer.eod}: " + (
                               f"train with {flags}" if flags else
                               NO_EOS if tokenizer.eod is None else
                               "pass the tokenizer flags the data was made with"))
    made_probe, probe = made.get("probe_digest"), probe_digest(tokenizer)
    if made_probe is not None and probe is not None and made_probe != probe:
        raise DatasetError(f"{where}: the data was made with a tokenizer that splits text "
                           f"otherwise than the training one ({made.get('class')}, vocab "
                           f"{made.get('vocab_size')}; the same EoD id, other vocabulary or "
                           f"merges): pass the tokenizer the data was made with. (Only if it is "
                           f"that tokenizer and merely its library changed: delete "
                           f"\"probe_digest\" from {where}.)")
    if meta.get("max_token_id", -1) >= tokenizer.vocab_size:
        raise DatasetError(f"{where}: the data holds token id {meta['max_token_id']}, outside "
                           f"the training tokenizer's vocabulary ({tokenizer.vocab_size})")
    if meta.get("non_eod_tokens") == 0:
        raise DatasetError(f"{prefix}: every token is the EoD id {tokenizer.eod}: nothing to "
                           f"learn")


def _scan(bin_, dtype, tokens, eod, scan_tokens):
    """(largest id, non-EoD tokens seen, whether the whole file was read), cached."""
    stat = os.stat(bin_)
    key = (os.path.abspath(bin_), stat.st_size, stat.st_mtime, eod)
    if key not in _SCANS:
        data = numpy.memmap(bin_, dtype=dtype, mode="r", shape=(tokens,))
        if tokens <= scan_tokens:
            parts, whole = [data], True
        else:
            chunk = scan_tokens // 64
            starts = numpy.linspace(0, tokens - chunk, 64).astype(numpy.int64)
            parts, whole = [data[s:s + chunk] for s in starts], False
        largest = max(int(p.max()) for p in parts)
        non_eod = sum(int(numpy.count_nonzero(p != eod)) for p in parts)
        _SCANS[key] = (largest, non_eod, whole)
        del data
    return _SCANS[key]
