"""The metadata file written beside each dataset: which tokenizer made it, and what it holds.

One job: `{prefix}.json` next to `{prefix}.bin/.idx` records the tokenizer (class, vocab size,
EoD id, pad id) and the dataset (token dtype, documents, tokens, non-EoD tokens, largest
token id, .bin bytes),
so that training can refuse a tokenizer that does not match the data (checks.py) and a
.bin/.idx pair that is not the one preprocessing wrote. Written atomically (a temporary file,
then a rename). Megatron's own tool writes none: then the checks fall back to scanning.

What it does not do: no checks (checks.py), no writing of the dataset (preprocess.py).
"""

from __future__ import annotations

import json
import os
from typing import Optional

__all__ = ["FORMAT", "sidecar_path", "tokenizer_identity", "write_sidecar", "read_sidecar"]

FORMAT = "megatron-eod-dataset-1"


def sidecar_path(prefix: str) -> str:
    return prefix + ".json"


def tokenizer_identity(tokenizer) -> dict:
    """What must match between the tokenizer that wrote a dataset and the one training on it."""
    identifiers = getattr(tokenizer, "unique_identifiers", None) or {}
    pad = getattr(tokenizer, "pad", None)
    return {"class": identifiers.get("class", type(tokenizer).__name__),
            "vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod),
            "pad": None if pad is None else int(pad)}


def write_sidecar(prefix: str, info: dict, suffix: str = "") -> str:
    """Write `{prefix}.json{suffix}` (the caller renames a suffixed one into place)."""
    path = sidecar_path(prefix) + suffix
    with open(path, "w") as f:
        json.dump({"format": FORMAT, **info}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return path


def read_sidecar(prefix: str) -> Optional[dict]:
    """The dataset's metadata, or None where there is none (e.g. Megatron's own tool made it);
    ValueError naming the file when it exists but cannot be read."""
    path = sidecar_path(prefix)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable dataset metadata ({err}); re-run "
                         f"tools/preprocess_data.py or delete it") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(f"{path}: not a megatron-eod dataset metadata file (format "
                         f"{info.get('format') if isinstance(info, dict) else None!r})")
    return info
