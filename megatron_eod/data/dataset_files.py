"""A dataset's files and their safe replacement, for the tools that write datasets.

One job: the paths of `{base}.bin/.idx/.json` and of their `.tmp` files, which a writer fills
first; `install` renames a finished set into place (metadata, `.bin`, `.idx` last: a failed or
killed run leaves the previous dataset whole, and a kill between the renames leaves a pair the
start-up checks refuse by name), `discard` removes a failed run's `.tmp` files;
`make_output_folder` makes the folder they go in. Used by preprocess.py and merge.py.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

from megatron_eod.data.sidecar import sidecar_path, write_sidecar

__all__ = ["TMP", "dataset_files", "temporary_files", "scratch_files", "install", "discard",
           "make_output_folder", "blocking_path"]

TMP = ".tmp"


def dataset_files(base: str) -> Tuple[str, str, str]:
    """(.bin, .idx, metadata) of the dataset `base`."""
    return base + ".bin", base + ".idx", sidecar_path(base)


def temporary_files(base: str) -> Tuple[str, str, str]:
    """Where a writer puts each of dataset_files(base) until `install`."""
    return tuple(path + TMP for path in dataset_files(base))


def scratch_files(base: str) -> Tuple[str, ...]:
    """The index writer's scratch files beside the `.idx` temporary (index_writer.py)."""
    from megatron_eod.data.index_writer import SCRATCH_SUFFIXES

    idx = temporary_files(base)[1]
    return tuple(idx + suffix for suffix in SCRATCH_SUFFIXES)


def install(base: str, metadata: Optional[dict]) -> None:
    """Put the written `.bin/.idx` temporaries of `base` into place, with `metadata` written
    beside them; None: the dataset has none (and a previous one, which would describe other
    files, is removed)."""
    bin_, idx, meta = dataset_files(base)
    if metadata is not None:
        os.replace(write_sidecar(base, metadata, suffix=TMP), meta)
    elif os.path.exists(meta):
        os.remove(meta)
    os.replace(bin_ + TMP, bin_)
    os.replace(idx + TMP, idx)


def discard(base: str) -> None:
    """Remove the temporaries of `base` that exist (a failed or killed run's)."""
    for path in (*temporary_files(base), *scratch_files(base)):
        if os.path.exists(path):
            os.remove(path)


def make_output_folder(output_prefix: str) -> None:
    """Make the folder `output_prefix`'s files go in; an OSError naming --output-prefix and why
    it cannot be made (a regular file on the path, no permission), not a bare errno."""
    folder = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        blocker = blocking_path(folder)
        why = (f"{blocker} is {'a link to nowhere' if os.path.islink(blocker) else 'a file'}, "
               f"not a folder" if blocker else err.strerror or str(err))
        raise OSError(f"--output-prefix {output_prefix}: cannot make its folder {folder} "
                      f"({why})") from None


def blocking_path(folder: str) -> Optional[str]:
    """The path on the way to `folder` that is there but is not a folder (a regular file, a
    link to nowhere), where making `folder` fails; None where there is none."""
    path = folder
    while os.path.dirname(path) != path:
        if os.path.lexists(path) and not os.path.isdir(path):
            return path
        path = os.path.dirname(path)
    return None
