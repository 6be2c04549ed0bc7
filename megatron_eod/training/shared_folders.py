"""Whether every node sees the folders the ranks share: --save and the sample-index cache.

One job: `check_shared_folders(folders, error)`, a collective of the default group, raises
`error` on every rank when a file rank 0 writes into one of `folders` cannot be seen by some
rank on another host, naming the folder, the flag, both ranks and hosts. It runs only where
the ranks span more than one host (one gather of host names); on one host it returns at once.

Why: Megatron-LM's trainer failed late and unclearly where a folder the ranks share was node-local
(a helper's two-node runs):
- `--save` on node-local disks: every save said it was done, but each node held only its own
  ranks' shards (rank 0's node the tracker and metadata): no node could resume, found only at
  the next --load, hours later;
- the sample-index cache (`--data-cache-path`, else beside each dataset) on node-local disks:
  megatron-core builds the indices on rank 0 and the other ranks read them from the cache:
  the ranks of the other nodes stopped with a FileNotFoundError traceback at start-up.

How: rank 0 makes each folder (as the save or megatron-core would) and writes a probe file
with a random name into it; the ranks look for it (a new name: no file system has a cached
answer for it; a few tries over ~2 s for the slower ones), the answers are gathered, rank 0
removes the probes. A folder rank 0 cannot write is left to the save or to megatron-core,
which name it.

What it does not do: no check of the data files themselves (data/copies.py compares every
rank's copy), no check on one host.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import Optional, Sequence, Tuple

import torch.distributed as dist

from megatron_eod.training.every_rank import gathered

__all__ = ["check_shared_folders", "save_folder"]

_TRIES = 5
_PAUSE_S = 0.5



def _write_probe(folder: str) -> Optional[str]:
    """Rank 0: the probe's path, or None where it cannot write there."""
    path = os.path.join(folder, f".megatron_eod_shared_{secrets.token_hex(8)}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            f.write("a file every rank should see\n")
    except OSError:
        return None
    return path


def _sees(path: str) -> bool:
    for attempt in range(_TRIES):
        if os.path.exists(path):
            return True
        if attempt + 1 < _TRIES:
            time.sleep(_PAUSE_S)
    return False


def check_shared_folders(folders: Sequence[Tuple[str, str, bool]], error) -> None:
    """`folders`: (what it is, in the user's words (e.g. "--save ckpt (...)"), its path,
    whether this rank reads or writes it: a bool, or a callable asked only where the ranks
    span several hosts); raises `error(message)` on every rank where one is not
    shared. A collective: every rank calls it with the same folders."""
    if not (dist.is_initialized() and dist.get_world_size() > 1 and folders):
        return
    host = socket.gethostname()
    hosts = gathered(host)
    if len(set(hosts)) == 1:
        return
    probes = [[_write_probe(path) for _, path, _ in folders] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(probes, src=0)
    unseen = next((i for i, ((_, _, uses), probe) in enumerate(zip(folders, probes[0]))
                   if probe is not None and (uses() if callable(uses) else uses)
                   and not _sees(probe)), None)
    seen = gathered(unseen)
    if dist.get_rank() == 0:
        for probe in probes[0]:
            if probe is not None:
                try:
                    os.remove(probe)
                except OSError:
                    pass
    rank = next((r for r, missing in enumerate(seen) if missing is not None), None)
    if rank is None:
        return
    what, path, _ = folders[seen[rank]]
    others = sum(missing is not None for missing in seen)
    raise error(f"{what} is not shared between the nodes: rank {rank} ({hosts[rank]}) does not "
                f"see the file rank 0 ({hosts[0]}) wrote into {path} ({others} of {len(seen)} "
                f"ranks do not); give a folder every node shares (a shared file system)")


def save_folder(args) -> list:
    """--save as check_shared_folders takes it (none without --save)."""
    if not getattr(args, "save", None):
        return []
    return [(f"--save {args.save} (every rank writes its part of each checkpoint there, rank "
             f"0 the tracker)", args.save, True)]
