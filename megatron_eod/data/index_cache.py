"""Start-up check that megatron-core's cached sample indices belong to the data on disk.

One job: GPTDataset caches each dataset's document, sample and shuffle indices (under
--data-cache-path, else `{prefix}/cache/GPTDataset_indices`) under a key made of the prefix and
the settings, not of the data: a dataset re-made into the same prefix is read through the old
indices (other samples than the data holds, or `buffer is smaller than requested size` hours
in). Beside each cache this keeps a stamp of the dataset the cache is for (the .bin and .idx
sizes, a digest of the .idx's first and last MiB) and refuses a cache whose dataset changed
since, naming the folder. A cache from before the stamp is trusted, and stamped.

What it does not do: no removal (another run may be reading that cache), no object storage.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from megatron_eod.data.checks import DatasetError

__all__ = ["check_index_cache", "cache_folder"]

_EDGE = 1 << 20  # bytes of the .idx digested at each end


def cache_folder(prefix: str, data_cache_path: Optional[str]) -> str:
    """Where megatron-core's GPTDataset keeps the indices of `prefix`."""
    return data_cache_path or os.path.join(prefix, "cache", "GPTDataset_indices")


def _identity(prefix: str) -> dict:
    idx = prefix + ".idx"
    size = os.path.getsize(idx)
    digest = hashlib.md5(usedforsecurity=False)
    with open(idx, "rb") as f:
        digest.update(f.read(_EDGE))
        f.seek(max(0, size - _EDGE))
        digest.update(f.read(_EDGE))
    return {"bin_bytes": os.path.getsize(prefix + ".bin"), "idx_bytes": size,
            "idx_digest": digest.hexdigest()}


def check_index_cache(prefix: str, data_cache_path: Optional[str]) -> None:
    """DatasetError if the cache of `prefix` was stamped for other .bin/.idx files; stamp it
    where it has no stamp (a folder that cannot be written is left alone)."""
    folder = cache_folder(prefix, data_cache_path)
    key = hashlib.md5(os.path.abspath(prefix).encode(), usedforsecurity=False).hexdigest()[:16]
    stamp = os.path.join(folder, f"megatron-eod-dataset-{key}.json")
    now = _identity(prefix)
    try:
        with open(stamp) as f:
            was = json.load(f)
    except (OSError, ValueError):
        was = None
    if was is None:
        try:
            os.makedirs(folder, exist_ok=True)
            with open(stamp + f".{os.getpid()}", "w") as f:
                json.dump({"prefix": os.path.abspath(prefix), **now}, f)
            os.replace(stamp + f".{os.getpid()}", stamp)
        except OSError:
            pass
        return
    if {k: was.get(k) for k in now} != now:
        raise DatasetError(
            f"{folder}: megatron-core's cached sample indices there were built from another "
            f"{prefix}.bin/.idx ({was.get('bin_bytes')} and {was.get('idx_bytes')} bytes, now "
            f"{now['bin_bytes']} and {now['idx_bytes']}): the dataset was re-made since, and "
            f"they would index it wrongly; remove {folder}, or pass another --data-cache-path")
