"""Before a checkpoint is read: which one --load names, the same on every rank, and whole.

One job: `find_checkpoint(args)`, a collective of the default group called by every rank
before any checkpoint file is read for loading, returns the checkpoint to
load (`Found`) or None for a fresh start, or raises the same CheckpointError on every rank,
naming the flag, the file and the rule. What it refuses, where Megatron-LM's trainer failed
deep inside torch or megatron-core (a traceback on every rank, some ranks waiting in a
collective the others never joined, or exit status 0):

- a tracker that cannot be read; one that holds no iteration (a save killed while Megatron-LM
  wrote it in place) where no complete checkpoint is there (where one is, the newest is
  resumed from, the tracker rewritten to name it, and rank 0 says so in one line);
- a `--load` that is a file, a folder this user cannot read, or an iteration folder itself
  (its parent named);
- a `--load` holding complete iteration folders but no tracker (deleted by a clean-up, lost
  with a copy): a fresh start there trains from scratch and overwrites them (Megatron-LM
  starts fresh); the newest is named;
- ranks reading different trackers (node-local copies, one stale): resumed at different
  iterations, they trained on mismatched states until a collective failed;
- an iteration folder holding no checkpoint (the complete ones named);
- a torch_dist checkpoint whose metadata.json, common.pt or .metadata cannot be read, or
  whose shard files are missing or shorter than the data its index lists (rank 0 reads the
  index and stats the shards);
- a torch-format file of this rank (or the distributed optimizer's beside it) empty or cut
  short (its zip directory is read; Megatron-LM's trainer exited 0 there);
- a resume (not --finetune, not --no-load-optim) of a checkpoint saved without its optimizer
  state (--no-save-optim), which Megatron-LM loads as far as it can (a traceback, or Adam
  restarted silently).

Each rank's finding is gathered (one all_gather_object of a few bytes a rank), so every rank
raises the first, naming that rank where only some found it.

What it does not do: no checksums of the shards (neither format keeps them: flipped bytes
inside a shard load as they are; common.pt's zip CRCs are checked), no object storage
(msc://, s3://) or non-persistent checkpoints (Megatron-LM's own load reads those).
"""

from __future__ import annotations

import json
import os
import re
import socket
import zipfile
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401 (FileSystemReader reads the shards' index)

from megatron_eod.megatron.imports import import_megatron
from megatron_eod.training.checkpoint_files import (DISTRIB_OPTIM_FILE, TRACKER, CheckpointError,
                                                 DamagedTracker, _legacy_file,
                                                 checkpoint_folder, checkpoint_format, is_whole,
                                                 iterations_under, read_tracker, write_tracker)
from megatron_eod.training.every_rank import gathered

__all__ = ["Found", "check_optimizer_saved", "find_checkpoint"]

_ITERATION_FOLDER = re.compile(r"(iter_\d{7}|release)$")
_ZIP = b"PK\x03\x04"  # torch.save's format; older checkpoints may be plain pickles


@dataclass(frozen=True)
class Found:
    flag: str  # "--load" or "--pretrained-checkpoint"
    root: str
    iteration: object  # an int, or "release"
    finetune: bool  # weights only, from iteration 0
    folder: str
    format: str  # "torch_dist", "torch", or "other" (torch_dcp, fsdp_dtensor)


def _complete_iterations(root):
    """The iterations under `root` whose folders hold a whole checkpoint (`is_whole`),
    oldest first."""
    return [i for i in iterations_under(root) if is_whole(checkpoint_folder(root, i))]


def _check_root(root, flag) -> bool:
    """Whether `root` exists (a fresh start where it does not, as Megatron-LM); a CheckpointError
    where it cannot be a checkpoint folder."""
    if not os.path.lexists(root):
        return False
    if os.path.islink(root) and not os.path.exists(root):
        raise CheckpointError(f"{flag} {root} is a link to {os.readlink(root)}, which does not "
                              f"exist (a file system not mounted on this node?)")
    if not os.path.isdir(root):
        raise CheckpointError(f"{flag} {root} is a file, not a checkpoint folder (the folder "
                              f"--save wrote, holding {TRACKER})")
    if not os.access(root, os.R_OK | os.X_OK):
        raise CheckpointError(f"{flag} {root}: this user cannot read the folder")
    name = os.path.basename(os.path.normpath(root))
    if _ITERATION_FOLDER.match(name) and checkpoint_format(root) is not None:
        raise CheckpointError(f"{flag} {root} is one iteration's folder: give the folder "
                              f"holding it and {TRACKER}, "
                              f"{os.path.dirname(os.path.normpath(root))}")
    return True


def _found(flag, root, iteration, finetune, named_by=TRACKER) -> Found:
    folder = checkpoint_folder(root, iteration)
    kind = checkpoint_format(folder)
    if kind is None and os.path.isfile(os.path.join(folder, ".metadata")):
        if os.path.isfile(os.path.join(folder, "common.pt")):
            raise CheckpointError(f"{flag} {root}: {folder} is a torch_dist checkpoint without "
                                  f"its metadata.json (written last: a save killed at its end, "
                                  f"or a copy that lost it)")
        kind = "other"  # torch_dcp or fsdp_dtensor: Megatron-LM reads them itself
    if kind is None:
        complete = [i for i in _complete_iterations(root) if i != iteration]
        older = (f"; complete there: iteration {', '.join(map(str, complete[-3:]))} (write one "
                 f"into {TRACKER} to resume from it)" if complete else "")
        raise CheckpointError(f"{flag} {root}: {named_by} names iteration {iteration} but "
                              f"{folder} holds no complete checkpoint (no metadata.json, no "
                              f"mp_rank_*){older}")
    return Found(flag, root, iteration, finetune or iteration == "release", folder, kind)


def _locate(args) -> Optional[Found]:
    """This rank's view: --load (at Megatron-LM's --ckpt-step where given), or
    --pretrained-checkpoint where --load has none (then as --finetune), or None."""
    try:
        return _located(args)
    except OSError as error:  # an iteration folder this user cannot list, ...
        raise CheckpointError(f"--load {getattr(args, 'load', None)}: {error.filename} cannot "
                              f"be read ({error.strerror or error})") from None


def _read_or_repair_tracker(load):
    """read_tracker's iteration; for a tracker holding none, the newest complete checkpoint's,
    the tracker rewritten (atomically) to name it: Megatron-LM's own load reads the tracker,
    and exits on one holding no iteration, --ckpt-step or not. Every rank that finds it so
    writes the same; find_checkpoint's gather follows, before any rank's load reads it."""
    try:
        return read_tracker(load, "--load")
    except DamagedTracker as damaged:
        complete = _complete_iterations(load)
        if not complete:
            raise
        newest = complete[-1]
        try:
            write_tracker(load, newest)
        except OSError as error:
            raise CheckpointError(f"{damaged} (rewriting it to name the newest complete "
                                  f"checkpoint, iteration {newest}, failed: "
                                  f"{error.strerror or error})") from None
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f" --load {load}: {TRACKER} held {damaged.text[:40]!r}, not an iteration (a "
                  f"save killed while writing it): resuming from the newest complete "
                  f"checkpoint, iteration {newest}, and the tracker now names it", flush=True)
        return newest


def _say_partial(load, iterations) -> None:
    """Rank 0: that the iteration folders under --load, none whole and none recorded in the
    tracker, are what saves killed before their end left (the first save's, typically: the
    tracker is written after every rank's files), so that the run starts from scratch, as
    Megatron-LM's does, and its saves replace them."""
    if iterations and (not dist.is_initialized() or dist.get_rank() == 0):
        names = ", ".join(os.path.basename(checkpoint_folder(load, i)) for i in iterations[-3:])
        print(f" --load {load}: no {TRACKER} and no whole checkpoint ({names}: left by a save "
              f"stopped before its end, which the save of that iteration replaces): training "
              f"from scratch", flush=True)


def _located(args) -> Optional[Found]:
    load = getattr(args, "load", None)
    finetune = bool(getattr(args, "finetune", False))
    if load and _check_root(load, "--load"):
        step = getattr(args, "ckpt_step", None)
        if step is not None:  # Megatron-LM's: this iteration, whatever the tracker says
            return _found("--load", load, step, finetune, f"--ckpt-step {step}")
        iteration = _read_or_repair_tracker(load)
        if iteration is not None:
            return _found("--load", load, iteration, finetune)
        complete = _complete_iterations(load)
        if complete:
            raise CheckpointError(
                f"--load {load} holds checkpoints (the newest: iteration {complete[-1]}) but no "
                f"{TRACKER}: a fresh start would train from scratch and overwrite them. Write "
                f"the iteration to resume into it (echo {complete[-1]} > "
                f"{os.path.join(load, TRACKER)}), or give another --load")
        _say_partial(load, iterations_under(load))
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained:
        iteration = (read_tracker(pretrained, "--pretrained-checkpoint")
                     if _check_root(pretrained, "--pretrained-checkpoint") else None)
        if iteration is None:
            raise CheckpointError(f"--pretrained-checkpoint {pretrained}: no {TRACKER} there")
        return _found("--pretrained-checkpoint", pretrained, iteration, True)
    return None


def _check_zip(path, what, crc=False, required=True) -> None:
    """A file torch.save wrote: present (where `required`), not empty, and, in its zip format,
    with a readable directory (a file cut short has none) and, with `crc`, every member's
    CRC checked (reads the whole file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_ZIP))
    except FileNotFoundError:
        if required:
            raise CheckpointError(f"{path} is missing ({what})") from None
        return
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read ({error.strerror or error})") from None
    if not head:
        raise CheckpointError(f"{path} is empty ({what})")
    if head != _ZIP:
        return  # an older pickle format: read as it is
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip() if crc else None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise CheckpointError(f"{path} is damaged or cut short ({what}: {error})") from None
    if bad is not None:
        raise CheckpointError(f"{path} is damaged: its part {bad} fails its CRC check ({what})")


def _check_torch_dist(found: Found) -> dict:
    """Rank 0: the folder's index files and shard sizes; -> its common state (common.pt, or
    inside the shards from megatron-core 0.17)."""
    folder = found.folder
    path = os.path.join(folder, "metadata.json")
    try:
        with open(path) as f:
            if not isinstance(json.load(f), dict):
                raise ValueError("not a JSON object")
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} cannot be read as the checkpoint's JSON metadata "
                              f"({getattr(error, 'strerror', None) or error})") from None
    path = os.path.join(folder, "common.pt")  # megatron-core <= 0.16; later, in the shards
    if os.path.lexists(path):
        _check_zip(path, "the checkpoint's args, iteration and schedule", crc=True)
    try:
        reader = torch.distributed.checkpoint.FileSystemReader(folder)
        storage = reader.read_metadata().storage_data
    except Exception as error:  # noqa: BLE001 (missing, cut short, unpicklable: all one line)
        raise CheckpointError(f"{os.path.join(folder, '.metadata')} (the index of the "
                              f"checkpoint's shards) is missing or damaged "
                              f"({type(error).__name__}: {error})") from None
    ends = {}
    for info in (storage or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(folder, name)
        try:
            size = os.stat(path).st_size
        except OSError as error:
            raise CheckpointError(f"{path} is missing or cannot be read ({error.strerror}; one of "
                                  f"the {len(ends)} shard files the checkpoint lists; a "
                                  f"checkpoint saved to node-local disks holds on each node its "
                                  f"own ranks' shards only)") from None
        if size < end:
            raise CheckpointError(f"{path} is cut short: {size} bytes, where the checkpoint lists "
                                  f"data up to byte {end}")
        if not os.access(path, os.R_OK):
            raise CheckpointError(f"{path} cannot be read by this user (its permissions)")
    dcp = import_megatron("megatron.core.dist_checkpointing")
    try:
        common = dcp.load_common_state_dict(folder)
    except Exception as error:  # noqa: BLE001 (whatever it meets, one line on every rank)
        raise CheckpointError(f"{folder}: its common state (args, iteration, schedule) cannot "
                              f"be read ({type(error).__name__}: {error})") from None
    return common if isinstance(common, dict) else {}


def check_optimizer_saved(args, found: Found, has_state: bool) -> None:
    """A resume (not --finetune, not --no-load-optim) of a checkpoint without its optimizer
    state is refused: it restarted the optimizer and the LR schedule silently."""
    if found.finetune or getattr(args, "no_load_optim", False) or has_state:
        return
    raise CheckpointError(
        f"{found.flag} {found.root}: iteration {found.iteration} was saved without its "
        f"optimizer state (--no-save-optim), and resuming it would restart the optimizer and "
        f"the learning-rate schedule: pass --no-load-optim to resume its weights with a fresh "
        f"optimizer and schedule, or --finetune to start from iteration 0")


class _Shared(CheckpointError):
    """Found by rank 0 in the files every rank reads: said without a rank."""


def _check_files(args, found: Found) -> None:
    try:
        if found.format == "torch_dist" and (not dist.is_initialized() or dist.get_rank() == 0):
            common = _check_torch_dist(found)
        elif found.format == "torch":
            path = _legacy_file(found.folder)
            _check_zip(path, "this rank's part of the checkpoint", required=False)
            if not (found.finetune or getattr(args, "no_load_optim", False)):
                _check_zip(os.path.join(os.path.dirname(path), DISTRIB_OPTIM_FILE),
                           "the distributed optimizer's state", required=False)
            return
        else:
            return
    except CheckpointError as error:
        raise (_Shared if found.format == "torch_dist" else CheckpointError)(
            f"{found.flag} {found.root}: {error}") from None
    try:
        check_optimizer_saved(args, found, "opt_param_scheduler" in common)
    except CheckpointError as error:
        raise _Shared(str(error)) from None



def _raise_first(seen) -> None:
    """`seen`: each rank's (error or None, host, shared); raise the first error, naming its
    rank where not every rank found the same (unless `shared`: rank 0's look at the files
    every rank reads)."""
    errors = [(rank, said, host, shared) for rank, (said, host, shared) in enumerate(seen)
              if said]
    if errors:
        rank, error, host, shared = errors[0]
        if not shared and (len(errors) < len(seen) or any(e[1] != error for e in errors)):
            error = f"rank {rank} ({host}): {error}"
        raise CheckpointError(error)


def _where(view) -> str:
    return "no checkpoint" if view is None else f"iteration {view[1]} of {view[0]}"


def find_checkpoint(args) -> Optional[Found]:
    """The checkpoint every rank loads, or None (a fresh start); raises the same
    CheckpointError on every rank. Collective."""
    error, found, shared = None, None, False
    try:
        found = _locate(args)
        if found is None and getattr(args, "exit_on_missing_checkpoint", False):
            raise CheckpointError(
                f"--load {args.load or args.pretrained_checkpoint} holds no checkpoint (no "
                f"{TRACKER}) and --exit-on-missing-checkpoint is set: stopping instead of "
                f"training from scratch")
        if found is not None:
            _check_files(args, found)
    except CheckpointError as said:
        error, shared = str(said), isinstance(said, _Shared)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if error:
            raise CheckpointError(error)
        return found
    view = None if found is None else (found.root, found.iteration)
    seen = gathered((error, view, socket.gethostname(), shared))
    _raise_first([(said, host, flag) for said, _, host, flag in seen])
    reference = seen[0][1]
    other = next((rank for rank, (_, v, _, _) in enumerate(seen) if v != reference), None)
    if other is None:
        return found
    raise CheckpointError(
        f"--load: the ranks read different checkpoints: rank 0 "
        f"({seen[0][2]}) {_where(reference)}, rank {other} ({seen[other][2]}) "
        f"{_where(seen[other][1])} ({sum(v != reference for _, v, _, _ in seen)} of {len(seen)} "
        f"ranks differ from rank 0). Every rank must read the same checkpoint: a shared file "
        f"system, or node-local copies kept in step")
