"""The files of a Megatron-LM checkpoint, read without loading it: what the start-up checks of
--load (checkpoint_preflight.py) need to know of a folder.

    DIR/latest_checkpointed_iteration.txt      the newest complete iteration (written last)
    DIR/iter_0000010/                          --ckpt-format torch_dist (default):
        common.pt, metadata.json, *.distcp     megatron.core.dist_checkpointing
    DIR/iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt   --ckpt-format torch (legacy):
                                               one file per TP/PP rank, and with the
                                               distributed optimizer DISTRIB_OPTIM_FILE beside

One job: name the tracker's iteration (and write one atomically: `write_tracker`), a folder's
format, and whether a folder holds a whole checkpoint. A save killed midway leaves the tracker
on the previous checkpoint and a folder that is not whole (`is_whole`); Megatron-LM's next save
of that iteration writes over it.

What it does not do: no saving or loading (Megatron-LM's), no reading of tensors.
"""

from __future__ import annotations

import os
import socket
from typing import Optional

from megatron_eod.megatron.imports import import_megatron

__all__ = ["CheckpointError", "DISTRIB_OPTIM_FILE", "DamagedTracker", "TRACKER",
           "checkpoint_folder", "checkpoint_format", "is_whole", "iterations_under",
           "read_tracker", "write_tracker"]

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(ValueError):
    """--load (or --pretrained-checkpoint) names a checkpoint this run cannot load; the
    message names the flag and what to change, on every rank (checkpoint_preflight gathers
    what one rank finds)."""


class DamagedTracker(CheckpointError):
    """The tracker holds no iteration (empty, or cut short: Megatron-LM writes it in place, so a
    kill while it writes leaves it so); `text` is what it holds."""

    def __init__(self, message, text):
        super().__init__(message)
        self.text = text


_LEGACY_FILE = "model_optim_rng.pt"
# The distributed optimizer's state in a --ckpt-format torch checkpoint: one file per (TP, PP)
# rank beside _LEGACY_FILE, gathered to and written by DP x CP rank 0 (Megatron-LM's name).
DISTRIB_OPTIM_FILE = "distrib_optim.pt"


def _ps():
    return import_megatron("megatron.core.parallel_state")


def _iter_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def _legacy_file(folder):
    """This rank's file of a --ckpt-format torch checkpoint (Megatron-LM's names)."""
    ps = _ps()
    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    return os.path.join(folder, name, _LEGACY_FILE)


def read_tracker(root, flag="--load"):
    """The iteration (an int, or "release") `root`'s tracker names; None without a tracker.
    A tracker that cannot be read or holds no iteration is a CheckpointError naming `flag`."""
    path = os.path.join(root, TRACKER)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise CheckpointError(f"{flag} {root}: {path} cannot be read "
                              f"({error.strerror or error})") from None
    text = raw.decode("utf-8", "replace").strip()
    if text == "release":
        return "release"
    try:
        return int(text)
    except ValueError:
        raise DamagedTracker(f"{flag} {root}: {path} holds {text[:40]!r}, not an iteration (a "
                             f"save killed while writing it, or a copy cut short): write the "
                             f"iteration to resume into it", text) from None


def write_tracker(root, iteration) -> None:
    """`root`'s tracker naming `iteration`, replaced atomically: a temporary file beside it,
    flushed to disk, renamed over it (a reader sees the old tracker or the new one, never a
    part), and the folder's entry flushed."""
    path = os.path.join(root, TRACKER)
    temporary = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"  # ranks of several
    # nodes may each rewrite it (checkpoint_preflight): a name of each's own
    try:
        with open(temporary, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.remove(temporary)
    folder = os.open(root, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def checkpoint_folder(root, iteration) -> str:
    """The folder of `iteration` (an int, or "release") under `root`."""
    return os.path.join(root, "release") if iteration == "release" else _iter_dir(root,
                                                                                 iteration)


def checkpoint_format(folder) -> Optional[str]:
    """"torch_dist" (metadata.json), "torch" (mp_rank_* files) or None (no complete
    checkpoint) of an iteration's folder."""
    if os.path.isfile(os.path.join(folder, "metadata.json")):
        return "torch_dist"
    if os.path.isdir(folder) and any(name.startswith("mp_rank_") for name in os.listdir(folder)):
        return "torch"
    return None


def iterations_under(root) -> list:
    """The iterations of the iteration folders (iter_NNNNNNN) under `root`, oldest first."""
    return sorted(int(name[len("iter_"):]) for name in os.listdir(root)
                  if name.startswith("iter_") and name[len("iter_"):].isdigit())


def is_whole(folder) -> bool:
    """Whether an iteration folder holds a whole checkpoint, as far as its files say without
    reading them: torch_dist writes metadata.json last; a torch-format save writes, per
    mp_rank_* folder, the distributed optimizer's DISTRIB_OPTIM_FILE (where it has one) and
    then the model file (Megatron-LM's order). A save killed midway leaves a folder without the
    model file (or with a `.tmp`), or with the optimizer's in some folders only; a model
    file without any optimizer's is a save without one (--no-save-optim): whole."""
    kind = checkpoint_format(folder)
    if kind != "torch":
        return kind is not None
    ranks = [os.path.join(folder, name) for name in os.listdir(folder)
             if name.startswith("mp_rank_")]

    def written(name):
        return [os.path.isfile(os.path.join(rank, name)) and
                os.path.getsize(os.path.join(rank, name)) > 0 for rank in ranks]

    optimizer = written(DISTRIB_OPTIM_FILE)
    return all(written(_LEGACY_FILE)) and (all(optimizer) or not any(optimizer))
