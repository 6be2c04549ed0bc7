"""The metadata file written beside each dataset: which tokenizer made it, and what it holds.

One job: `{prefix}.json` next to `{prefix}.bin/.idx` records the tokenizer (class, vocab size,
EoD id, pad id, a digest of the ids it gives a fixed probe text) and the dataset (token dtype,
documents, tokens, non-EoD tokens, largest token id, .bin bytes), so that training can refuse
a tokenizer that does not match the data (checks.py) and a .bin/.idx pair that is not the one
preprocessing wrote. Written atomically (a temporary file, then a rename). Megatron's own tool
writes none: then the checks fall back to scanning.

What it does not do: no checks (checks.py), no writing of the dataset (preprocess.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy

__all__ = ["FORMAT", "PROBE", "probe_digest", "sidecar_path", "tokenizer_identity",
           "write_sidecar", "read_sidecar"]

FORMAT = "megatron-eod-dataset-1"


def sidecar_path(prefix: str) -> str:
    return prefix + ".json"


# Text whose ids tell tokenizers apart that share a class, an EoD id and a vocabulary size
# (Llama-2's and Mistral's: eos 2 of 32000) but not their vocabulary or merges.
PROBE = ("The quick brown fox jumps over the lazy dog. def tokenize(text): return [ord(c) for "
         "c in text]  # 0123456789 -- naive, cafe, Zurich; 2,048 tokens/s at 3.5e-4 lr!")


def probe_digest(tokenizer) -> Optional[str]:
    """A digest of the ids `tokenizer` gives PROBE (None where it takes no plain text, e.g.
    NullTokenizer): the same tokenizer read from another path gives the same one."""
    try:
        ids = [int(i) for i in tokenizer.tokenize(PROBE)]
    except Exception:  # a tokenizer that takes no plain text
        return None
    # Special ids some wrappers add around any text (Megatron-LM's Llama2Tokenizer and
    # transformers' tokenizers add BOS; ours do not) are not the text's tokenization.
    specials = set()
    for name in ("bos", "bos_id", "eos", "eos_id", "eod", "pad", "cls", "sep"):
        try:
            value = getattr(tokenizer, name)
        except Exception:  # Megatron-LM's tokenizers raise for ids they lack
            continue
        if isinstance(value, (int, numpy.integer)) and not isinstance(value, bool):
            specials.add(int(value))
    while ids and ids[0] in specials:
        ids.pop(0)
    while ids and ids[-1] in specials:
        ids.pop()
    return hashlib.md5(",".join(map(str, ids)).encode(), usedforsecurity=False).hexdigest()


def tokenizer_identity(tokenizer) -> dict:
    """What must match between the tokenizer that wrote a dataset and the one training on it."""
    identifiers = getattr(tokenizer, "unique_identifiers", None) or {}
    pad = getattr(tokenizer, "pad", None)
    return {"class": identifiers.get("class", type(tokenizer).__name__),
            "vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod),
            "pad": None if pad is None else int(pad), "probe_digest": probe_digest(tokenizer)}


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
