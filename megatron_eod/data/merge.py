"""Several indexed datasets -> one, as Megatron's `tools/merge_datasets.py`, checked, with metadata.

One job: concatenate the documents of datasets preprocessed apart (shards made by separate
jobs) into one `.bin/.idx` (index_writer.py: the bytes of megatron-core's
`IndexedDatasetBuilder.add_index`, in memory that does not grow with the parts), in the
order given (a directory's datasets sorted by name, as Megatron's tool). Merging the outputs of
shards gives the bytes preprocessing their concatenation gives, metadata file included.

Added to Megatron's tool, which asserts only equal dtypes:
- each part is checked first (checks.check_files: a truncated `.bin`, a damaged `.idx`, a pair
  its metadata does not describe) and named when it fails;
- parts whose metadata names another tokenizer, or another token dtype, are refused by name
  (their ids would mean different text in one dataset); a part without metadata merged with
  parts that have it is checked against their tokenizer (ids past its vocabulary; documents
  not ending with its EoD id where theirs do); parts that all lack one are checked against each
  other (documents not ending with the id that ends every checked document of the first part
  whose documents all end alike);
- the merged dataset gets a metadata file (sums, largest id) when every part has one; where
  some part has none (Megatron's own tool made it), it gets none, the start-up checks scan it,
  and the log says so;
- a prefix named twice, a `.bin` without its `.idx`, and an output whose files a directory
  input would hold (a re-run would merge the merged dataset into itself) are refused;
- safe replacement (dataset_files.py), as preprocess.py: `.tmp` files renamed into place only
  after success.

What it does not do: no re-tokenizing, no multimodal datasets (sequence modes), no shuffling.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy

from megatron_eod.data.checks import DatasetError, check_files, document_ends, largest_token
from megatron_eod.data.dataset_files import (discard, install, make_output_folder,
                                              temporary_files)
from megatron_eod.data.index_writer import IndexWriter

__all__ = ["MergeError", "MergeStats", "find_parts", "merge_datasets"]

_SUMMED = ("documents", "tokens", "non_eod_tokens")


class MergeError(ValueError):
    """A part or an argument that cannot be merged; the message names it and the rule."""


@dataclass
class MergeStats:
    parts: List[str] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    without_metadata: List[str] = field(default_factory=list)  # parts that have none


def _prefix_of(value: str) -> str:
    root, ext = os.path.splitext(value)
    return root if ext in (".bin", ".idx") else value


def find_parts(values: Sequence[str]) -> List[str]:
    """Dataset prefixes from `--input` values, in order: a directory stands for its datasets
    (every `.bin`/`.idx` pair in it, sorted by name), any other value for one dataset (its
    prefix, or its `.bin` or `.idx` path)."""
    parts, seen = [], {}
    for value in values:
        if os.path.isdir(value):
            names = sorted(os.listdir(value))
            found = sorted({_prefix_of(n) for n in names if n.endswith((".bin", ".idx"))})
            if not found:
                raise MergeError(f"--input {value}: the directory holds no .bin/.idx dataset")
            prefixes = [os.path.join(value, p) for p in found]
        else:
            prefixes = [_prefix_of(value)]
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise MergeError(f"--input {value}: {prefix + ext} does not exist"
                                     + (" (a dataset is a .bin/.idx pair)"
                                        if os.path.exists(prefix) else ""))
            info = os.stat(prefix + ".idx")  # the file, however it is named (links too)
            key = info.st_dev, info.st_ino
            if key in seen:
                first_value, first = seen[key]
                what = (f"the dataset {prefix} is named twice" if first == prefix else
                        f"{first} and {prefix} are the same dataset")
                raise MergeError(f"--input: {what} (by {first_value!r} and {value!r}); its "
                                 f"documents would be merged twice")
            seen[key] = value, prefix
            parts.append(prefix)
    if not parts:
        raise MergeError("--input: name at least one dataset or directory of datasets")
    return parts


def _check_output(values: Sequence[str], parts: Sequence[str], output_prefix: str) -> None:
    out_dir = os.path.realpath(os.path.dirname(os.path.abspath(output_prefix)))
    for value in values:
        if os.path.isdir(value) and os.path.realpath(value) == out_dir:
            raise MergeError(f"--output-prefix {output_prefix} is in --input {value}: a re-run "
                             f"would merge the merged dataset into itself; write it elsewhere")
    target = output_prefix + ".idx"
    for part in parts:
        if os.path.exists(target) and os.path.samefile(part + ".idx", target):
            raise MergeError(f"--output-prefix {output_prefix} is one of the datasets to merge")


def _tokenizer_difference(a: dict, b: dict) -> Optional[str]:
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in keys) or None


def _check_without_metadata(parts: Sequence[str], reference: str, meta: dict) -> None:
    """Parts without a metadata file (Megatron's own tool made them), merged with parts that
    have one, against the tokenizer that names: a token id past its vocabulary (a bounded
    scan), or documents that do not end with its EoD id where `reference`'s do (made with
    another tokenizer, or without --append-eod), are refused by name."""
    made = meta.get("tokenizer", {})
    vocab, eod = made.get("vocab_size"), made.get("eod")
    if not isinstance(vocab, int) or not isinstance(eod, int):
        return
    tokenizer = f"{made.get('class')} (vocab {vocab}, EoD {eod}) that {reference} was made with"
    for part in parts:
        largest = largest_token(part, eod)
        if largest >= vocab:
            raise MergeError(f"{part} (no metadata file) holds token id {largest}, outside the "
                             f"vocabulary of the {tokenizer}: made with another tokenizer; "
                             f"merge datasets of one tokenizer")
    _check_document_ends(parts, reference, eod, f"EoD id {eod}", f"({tokenizer})")


def _check_ends_alike(parts: Sequence[str]) -> None:
    """Parts that all lack a metadata file, against each other: the first part whose checked
    documents all end with one id (its EoD id, made with --append-eod; or a text's common
    last token, made without) is the reference; another part whose documents all end with
    another id, or mostly not with this one, is refused."""
    ends = {part: document_ends(part) for part in parts}
    uniform = [part for part in parts if len(ends[part]) and (ends[part] == ends[part][0]).all()]
    if not uniform:
        return
    reference = uniform[0]
    eod = int(ends[reference][0])
    for part in uniform[1:]:
        if int(ends[part][0]) != eod:
            raise MergeError(f"{part} (no metadata file): all {len(ends[part])} documents "
                             f"checked end with token id {ends[part][0]}, where all "
                             f"{len(ends[reference])} checked of {reference} end with token id "
                             f"{eod} (no part has a metadata file): with --append-eod every "
                             f"document ends with the tokenizer's EoD id, so they were made with "
                             f"other tokenizers, or one without --append-eod (its documents "
                             f"would run together under EoD reset); merge datasets made alike")
    _check_document_ends(parts, reference, eod, f"token id {eod}",
                         "(its EoD id, it seems; no part has a metadata file)")


def _check_document_ends(parts, reference: str, eod: int, named: str, why: str) -> None:
    """Refuse a part fewer than half of whose checked documents end with `eod` where every
    checked document of `reference` does. Half: with the same tokenizer and --append-eod every
    document ends with its EoD id; with another, only those whose last token happens to have
    that id (a common token of it)."""
    reference_ends = document_ends(reference)
    if not len(reference_ends) or not (reference_ends == eod).all():
        return
    for part in parts:
        ends = document_ends(part)
        ending = int((ends == eod).sum())
        if 2 * ending < len(ends):
            raise MergeError(f"{part} (no metadata file): {ending} of the {len(ends)} documents "
                             f"checked end with {named}, where all {len(reference_ends)} "
                             f"checked of {reference} do {why}: made with another tokenizer, "
                             f"or without --append-eod (its documents would run together "
                             f"under EoD reset); merge datasets made alike")


def merge_datasets(inputs: Sequence[str], output_prefix: str, log=None) -> MergeStats:
    """Merge the datasets `inputs` names (find_parts) into `output_prefix`.bin/.idx/.json."""
    log = log or (lambda msg: None)
    parts = find_parts(list(inputs))
    _check_output(inputs, parts, output_prefix)
    discard(output_prefix)  # a killed run's leftovers, whatever happens next
    facts = []
    for part in parts:
        try:
            facts.append((part, *check_files(part)))
        except DatasetError as err:
            raise MergeError(f"cannot merge {part}: {err}") from None
    first, dtype = facts[0][:2]
    metas = [(part, meta) for part, _, _, _, meta in facts if meta is not None]
    for part, part_dtype, _, _, _ in facts:
        if part_dtype != dtype:
            raise MergeError(f"{part} holds {numpy.dtype(part_dtype).name} tokens, {first} "
                             f"{numpy.dtype(dtype).name}: they were made with tokenizers of "
                             f"different vocabulary sizes; merge datasets of one tokenizer")
    for part, meta in metas[1:]:
        differ = _tokenizer_difference(metas[0][1].get("tokenizer", {}),
                                       meta.get("tokenizer", {}))
        if differ:
            raise MergeError(f"{part} was made with another tokenizer than {metas[0][0]} "
                             f"({differ}, per their metadata files); merge datasets of one "
                             f"tokenizer")
    stats = MergeStats(parts=list(parts), documents=sum(f[2] for f in facts),
                       tokens=sum(f[3] for f in facts),
                       without_metadata=[part for part, _, _, _, meta in facts if meta is None])
    if metas and stats.without_metadata:
        _check_without_metadata(stats.without_metadata, *metas[0])
    elif not metas:
        _check_ends_alike(parts)
    temps = temporary_files(output_prefix)
    make_output_folder(output_prefix)
    builder = None
    try:
        builder = IndexWriter(temps[0], temps[1], dtype)
        for i, part in enumerate(parts):
            builder.add_index(part)
            log(f"merged {part} ({i + 1} of {len(parts)})")
        builder.finalize()
        metadata = None if stats.without_metadata else {
            "tokenizer": metas[0][1].get("tokenizer"), "dtype": numpy.dtype(dtype).name,
            "max_token_id": max(m.get("max_token_id", -1) for _, m in metas),
            "bin_bytes": os.path.getsize(temps[0]),
            **{key: sum(m[key] for _, m in metas) for key in _SUMMED
               if all(isinstance(m.get(key), int) for _, m in metas)}}
        install(output_prefix, metadata)
    except BaseException:
        if builder is not None:
            builder.close()
        discard(output_prefix)
        raise
    return stats
