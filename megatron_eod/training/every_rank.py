"""One collective the start-up checks share: every rank's answer, on every rank.

    gathered(item) -> [rank 0's item, rank 1's, ...]   (all_gather_object over the default
                                                         group: every rank calls it)

Used where each rank checks something of its own (its flags, its copy of a dataset or a
checkpoint, what it sees of a shared folder) and every rank must raise the same error.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["gathered"]


def gathered(item) -> list:
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, item)
    return found
