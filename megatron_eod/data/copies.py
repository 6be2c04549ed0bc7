"""Whether every rank reads the same copy of a dataset.

One job: `fingerprint(prefix)` describes the `.bin` and `.idx` a rank sees (their sizes and a
digest of 17 blocks of 4 KiB each, spread evenly from the first byte to the last: the whole
file up to 68 KiB), `difference(reference, other, names)` says what differs between two
fingerprints or is None, and `summary` digests a list of them, for a cheap first comparison.
Ranks that draw the same samples (a context-parallel group, split over nodes) must read the
same bytes: a node holding its own copy of another version, or a preallocated copy whose tail
was never written (a transfer to a node's disk that stopped), gives them other tokens, so the
CP ranks plan different layouts, and their exchanges hang or mismatch. (A copy whose files are
cut short is refused on its own rank already: data/checks.py.)

Cheap on purpose: ~140 KiB read per dataset and rank, from files every rank opens anyway.
What it does not do: read whole files (bytes differing only between the sampled blocks go
unseen), or compare metadata files (data/checks.py checks each against its own pair).
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional, Tuple

from megatron_eod.data.checks import DatasetError

__all__ = ["fingerprint", "summary", "difference"]

BLOCK = 4096
BLOCKS = 17


def _file_fingerprint(path: str) -> Tuple[int, str]:
    """(size, digest of BLOCKS blocks of BLOCK bytes at evenly spaced offsets)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        last = max(size - BLOCK, 0)
        for i in range(BLOCKS):
            digest.update(os.pread(f.fileno(), BLOCK, last * i // (BLOCKS - 1)))
    return size, digest.hexdigest()


def fingerprint(prefix: str) -> dict:
    """{".bin": (size, digest), ".idx": (size, digest)} of `prefix`'s files on this rank; a
    file it cannot read is a DatasetError naming it (the caller gathers errors from every
    rank: an OSError on one would leave the others waiting)."""
    try:
        return {ext: _file_fingerprint(prefix + ext) for ext in (".bin", ".idx")}
    except OSError as err:
        raise DatasetError(f"{err.filename or prefix}: cannot be read ({err.strerror or err})"
                           ) from None


def summary(fingerprints) -> Optional[str]:
    """A short digest of a list of fingerprints (None for None), for ranks to compare first."""
    if fingerprints is None:
        return None
    return hashlib.blake2b(repr(fingerprints).encode(), digest_size=16).hexdigest()


def difference(reference: dict, other: dict, names=("one", "the other")) -> Optional[str]:
    """What differs between two fingerprints of a dataset, in words using `names` for where
    each was taken (e.g. ("rank 0 (node-a)", "rank 8 (node-b)")), or None."""
    for ext in (".bin", ".idx"):
        (size, digest), (other_size, other_digest) = reference[ext], other[ext]
        if size != other_size:
            return f"its {ext} is {size} bytes on {names[0]}, {other_size} on {names[1]}"
        if digest != other_digest:
            compared = ("compared whole" if size <= BLOCK * BLOCKS else
                        f"{BLOCKS} blocks of {BLOCK // 1024} KiB compared")
            return (f"its {ext} is {size} bytes on both, with other bytes ({compared})")
    return None
