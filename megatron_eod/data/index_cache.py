"""Start-up check that megatron-core's cached sample indices belong to the data on disk.

One job: GPTDataset caches each dataset's document, sample and shuffle indices (under
--data-cache-path, else `{prefix}/cache/GPTDataset_indices`) under a key made of the prefix and
the settings, not of the data: a dataset re-made into the same prefix is read through the old
indices (other samples than the data holds, or `buffer is smaller than requested size` hours
in). Beside each cache this keeps a stamp of the dataset the cache is for (the .bin and .idx
sizes, a digest of the .idx's first and last 64 KiB) and refuses cached indices of a dataset that
changed since, naming their files. A stamp with no indices of its dataset left behind it (the
run stopped before building them, or they were deleted) is renewed; a cache from before the
stamp is trusted, and stamped.

What it does not do: no removal (another run may be reading that cache), no object storage.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import List, Optional

from megatron_eod.data.checks import DatasetError
from megatron_eod.data.dataset_files import blocking_path

__all__ = ["check_index_cache", "cache_folder"]

_EDGE = 1 << 16  # bytes of the .idx digested at each end (rank 0, every prefix of a blend)


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


def _cached_entries(folder: str, prefix: str) -> List[str]:
    """megatron-core's cache entries in `folder` built from `prefix` (as the run passes it, as
    megatron-core keys them): the `<hash>-<Class>-<split>` bases of their description files,
    blended ones (which nest their datasets' descriptions) included."""
    needle = f'"dataset_path": {json.dumps(prefix)}'
    entries = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return entries
    for name in names:
        if name.endswith("-description.txt"):
            try:
                with open(os.path.join(folder, name)) as f:
                    found = needle in f.read()
            except OSError:
                continue
            if found:
                entries.append(name[:-len("-description.txt")])
    return entries


def check_index_cache(prefix: str, data_cache_path: Optional[str]) -> None:
    """DatasetError if megatron-core holds cached indices of `prefix` stamped for other
    .bin/.idx files; otherwise (re)stamp the cache for the data on disk (a folder that cannot
    be written is left alone); DatasetError naming --data-cache-path where a file stands in
    the folder's way."""
    folder = cache_folder(prefix, data_cache_path)
    key = hashlib.md5(prefix.encode(), usedforsecurity=False).hexdigest()[:16]
    stamp = os.path.join(folder, f"megatron-eod-dataset-{key}.json")
    now = _identity(prefix)
    try:
        with open(stamp) as f:
            was = json.load(f)
    except (OSError, ValueError):
        was = None
    if was is not None and {k: was.get(k) for k in now} == now:
        return
    stale = _cached_entries(folder, prefix) if was is not None else []
    if stale:
        shown = ", ".join(f"{base}-*" for base in stale[:4]) + (
            f" and {len(stale) - 4} more" if len(stale) > 4 else "")
        raise DatasetError(
            f"{folder}: megatron-core's cached sample indices of {prefix} there were built "
            f"from another {prefix}.bin/.idx ({was.get('bin_bytes')} and "
            f"{was.get('idx_bytes')} bytes, now {now['bin_bytes']} and {now['idx_bytes']}): "
            f"the dataset was re-made since, and they would index it wrongly; delete their "
            f"files ({shown}), or the whole folder (megatron-core builds again the indices it "
            f"needs: rm -r {folder}), or pass another --data-cache-path")
    try:
        os.makedirs(folder, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # megatron-core's makedirs fails too
        blocker = blocking_path(folder) or folder
        given = (f"--data-cache-path {data_cache_path}" if data_cache_path else
                 f"megatron-core's index cache of {prefix} ({folder})")
        what = "a link to nowhere" if os.path.islink(blocker) else "a file"
        raise DatasetError(f"{given}: {blocker} is {what}, where megatron-core makes its cache "
                           f"folder: pass a folder (or a path that does not exist yet) as "
                           f"--data-cache-path") from None
    except OSError:
        return  # not writable here: megatron-core reads what it finds, or says so
    try:  # no stamp, or one with no cached indices left behind it: stamp the data on disk
        with open(stamp + f".{os.getpid()}", "w") as f:
            json.dump({"prefix": prefix, **now}, f)
        os.replace(stamp + f".{os.getpid()}", stamp)
    except OSError:
        pass
