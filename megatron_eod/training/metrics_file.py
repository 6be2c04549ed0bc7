"""--metrics-file, ready before the first iteration: one job, `check_metrics_file(args)`.

The last rank writes it (the rank holding the loss, in both trainers), first after the model
is built and the first iteration ran. A folder that does not exist (a run folder the launch
script names but never made) stopped that rank alone with a FileNotFoundError traceback; the
others then waited in their next collective. Now, at start-up, the last rank makes the folder
(as --save's is made) and opens the file for appending, and what it finds reaches every rank,
which stops with the same line. A collective: every rank calls it.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from megatron_eod.training.every_rank import gathered

__all__ = ["check_metrics_file"]


def _ready(path):
    """None, or why `path` cannot be appended to."""
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as error:
        return (f"--metrics-file {path}: cannot be written ({error.strerror or error}"
                f"{': ' + error.filename if error.filename else ''})")
    return None


def check_metrics_file(args, error_type) -> None:
    """Raise `error_type` on every rank where the last rank cannot append to --metrics-file."""
    path = getattr(args, "metrics_file", None)  # may be given to the last rank only
    world = dist.get_world_size() if dist.is_initialized() else 1
    last = not dist.is_initialized() or dist.get_rank() == world - 1
    said = _ready(path) if last and path else None
    if world > 1:  # every rank, flag or not (same_flags lets it differ by rank)
        said = gathered(said)[-1]
    if said:
        raise error_type(said)
