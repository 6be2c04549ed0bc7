"""Around Megatron-LM's save: the tracker written atomically, the room checked before each save,
a failed save one line with its unfinished folder removed.

One job: `hook_save_checkpoint(training)` (idempotent), run.py's, wraps the `save_checkpoint`
Megatron-LM's training loop calls (through `save_checkpoint_and_time`, or directly for the save
at the end of training before 0.18), so that
- Megatron-LM's write of the tracker, an `open(tracker, 'w')` in its checkpointing module (a
  kill at that instant left it empty, and the next launch refused), goes through
  checkpoint_files.write_tracker: a temporary file, fsync, rename. Everything else is
  Megatron-LM's and megatron-core's, in their format;
- before each save, on every rank (one gathered check):
  - at this process's first save, rank 0 removes the iteration folders under --save newer
    than the tracker's that hold no whole checkpoint (a save that failed, or was killed: on a
    full disk they hold the room the relaunch needs; save_lock.py keeps other jobs out, and
    nothing of this process is in flight yet);
  - the room at --save is compared with the checkpoint's size: the last checkpoint's (its
    folder, what each save adds: Megatron-LM keeps them all), or before one exists an
    estimate, a lower bound (each parameter once, in its dtype, plus, where the optimizer is
    saved, Adam's two fp32 moments and, for bf16/fp16 or the distributed optimizer, the fp32
    main copy: the tiny GPT's 1.7 MiB for 2.1 MiB written). Short of it, every
    rank stops with one line naming --save, the free and the needed space, and the fix
    (CheckpointError: exit 2), instead of a half-written folder;
- a save that raises anyway (the disk filled during it; a lost mount; a package megatron-core's
  save imports; megatron-core gathers every rank's write errors into torch's
  CheckpointException, raised on every rank): the unfinished folder is removed, and one line
  on each rank names --save, the error, the room there and the last checkpoint, which the
  tracker still names (Megatron-LM writes it after every rank's files). Other errors keep
  their traceback.

What it does not do: nothing for object storage (a --save with "://": Megatron-LM's own), no
room check of non-persistent or local (NVMe) checkpoints; the estimate leaves out what is not
a parameter or Adam's state (RNG states, the data iterators', a few KB).
"""

from __future__ import annotations

import importlib
import os
import shutil

import torch.distributed as dist

from megatron_eod.training.checkpoint_files import (TRACKER, CheckpointError, checkpoint_folder,
                                                 is_whole, iterations_under, read_tracker,
                                                 write_tracker)
from megatron_eod.training.every_rank import gathered
from megatron_eod.training.faults import collective_fault

__all__ = ["hook_save_checkpoint"]


def hook_save_checkpoint(training) -> None:
    checkpointing = importlib.import_module("megatron.training.checkpointing")
    _tracker_written_atomically(checkpointing)
    original = training.save_checkpoint  # what save_checkpoint_and_time calls, and before
    if getattr(original, "_eod_save", False):  # 0.18 the save at the end of training
        return
    first = {"save": True}

    def save_checkpoint(*args, **kwargs):
        save = importlib.import_module("megatron.training").get_args().save
        iteration = args[0] if args else kwargs.get("iteration")
        non_persistent = kwargs.get("non_persistent_ckpt")  # Megatron-LM passes it by name
        if not save or "://" in save or non_persistent:  # the latter: another folder, its
            return original(*args, **kwargs)  # own (--non-persistent-ckpt-type)
        model = args[1] if len(args) > 1 else kwargs.get("model")
        room = _check_room(save, iteration, model, remove_leftovers=first["save"])
        first["save"] = False
        try:
            return original(*args, **kwargs)
        except BaseException as error:  # torch's CheckpointException is one
            if not isinstance(error, _save_errors()) or collective_fault(error):
                raise
            _remove_unfinished(save, iteration)
            raise _failed_save(save, iteration, error, room) from None

    save_checkpoint._eod_save = True
    training.save_checkpoint = save_checkpoint


# --- the tracker -------------------------------------------------------------------------------

class _AtomicTracker:
    """What Megatron-LM writes into the tracker, written by write_tracker when it closes."""

    def __init__(self, root):
        self.root, self.text = root, []

    def write(self, text):
        self.text.append(text)

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        if kind is None:
            write_tracker(self.root, "".join(self.text).strip())


def _atomic_open(original):
    def open_tracker(path, mode="r", *args, **kwargs):
        path_text = str(path)
        if mode == "w" and os.path.basename(path_text) == TRACKER and "://" not in path_text:
            return _AtomicTracker(os.path.dirname(path_text))
        return original(path, mode, *args, **kwargs)

    open_tracker._eod = True
    return open_tracker


class _StorageWithAtomicTracker:
    """megatron-core >= 0.18's `maybe_msc` (os and open, local or object storage) with its
    open of the tracker for writing atomic."""

    def __init__(self, storage):
        self._storage = storage
        self.open = _atomic_open(storage.open)

    def __getattr__(self, name):
        return getattr(self._storage, name)


def _tracker_written_atomically(checkpointing) -> None:
    """Megatron-LM's checkpointing writes the tracker through `maybe_msc.open` (>= 0.18) or
    `open_file` (0.16, 0.17), both names of its module."""
    storage = getattr(checkpointing, "maybe_msc", None)
    if storage is not None and not isinstance(storage, _StorageWithAtomicTracker):
        checkpointing.maybe_msc = _StorageWithAtomicTracker(storage)
    opener = getattr(checkpointing, "open_file", None)
    if opener is not None and not getattr(opener, "_eod", False):
        checkpointing.open_file = _atomic_open(opener)


# --- room before a save ------------------------------------------------------------------------

def _size(count) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def _folder_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(where, name))
               for where, _, names in os.walk(folder) for name in names
               if os.path.isfile(os.path.join(where, name)))


def _last_complete(save):
    try:
        last = read_tracker(save, "--save")
    except CheckpointError:
        return None
    return last if last is not None and is_whole(checkpoint_folder(save, last)) else None


def _estimate(model) -> int:
    """This rank's share of a first checkpoint's bytes (a lower bound), counted on the ranks of
    data-parallel (with context-parallel) rank 0 only: the others hold copies."""
    mpu = importlib.import_module("megatron.core.parallel_state")
    if mpu.get_data_parallel_rank(with_context_parallel=True) != 0:
        return 0
    args = importlib.import_module("megatron.training").get_args()
    params = [p for chunk in (model if isinstance(model, (list, tuple)) else [model])
              for p in chunk.parameters()]
    count = sum(p.numel() for p in params)
    weights = sum(p.numel() * p.element_size() for p in params)
    if getattr(args, "no_save_optim", False):
        return weights
    moments = 8 if getattr(args, "optimizer", "adam") == "adam" else 4
    main = 4 if any(getattr(args, name, False) for name in
                    ("bf16", "fp16", "use_distributed_optimizer")) else 0  # saved fp32 copies
    return weights + count * (moments + main)


def _remove_leftovers(save) -> list:
    """Rank 0: the iteration folders newer than the tracker's holding no whole checkpoint,
    removed; their names."""
    if not os.path.isdir(save):
        return []
    last = _last_complete(save)
    removed = []
    for iteration in iterations_under(save):
        folder = checkpoint_folder(save, iteration)
        if (last is None or iteration > last) and not is_whole(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(os.path.basename(folder))
    return removed


def _check_room(save, iteration, model, remove_leftovers) -> str:
    """Raises the CheckpointError where --save has no room; else returns the room, said."""
    rank = dist.get_rank()
    removed = _remove_leftovers(save) if rank == 0 and remove_leftovers else []
    if removed:
        print(f"megatron-eod: --save {save}: removed {', '.join(removed)}, left unfinished by an "
              f"earlier save", flush=True)
    estimate = _estimate(model)
    found = {"estimate": estimate}
    if rank == 0:
        last = _last_complete(save)
        found["last"] = (last, _folder_bytes(checkpoint_folder(save, last))) if last else None
        try:
            found["free"] = shutil.disk_usage(save if os.path.isdir(save) else
                                              os.path.dirname(os.path.abspath(save))).free
        except OSError:
            found["free"] = None
    every = gathered(found)
    free, last = every[0].get("free"), every[0].get("last")
    needed = last[1] if last else sum(item["estimate"] for item in every)
    basis = (f"the size of the last checkpoint, iteration {last[0]}" if last else
             "an estimate of the first checkpoint: the parameters and the optimizer's state")
    if free is None:
        return ""
    if free >= needed:
        return f"{_size(free)} was free there before it, {_size(needed)} needed ({basis})"
    raise CheckpointError(
        f"--save {save}: no room for the checkpoint of iteration {iteration}: {_size(free)} "
        f"free there, {_size(needed)} needed ({basis}); free space there (remove older "
        f"iteration folders, the tracker names the newest) or give another --save, then resume")


# --- a save that raised ------------------------------------------------------------------------

def _save_errors() -> tuple:
    """What a failed write raises: OSError (a full disk, a lost mount), ImportError (a
    package the save needs), RuntimeError (torch.save's writer: "unexpected pos"), torch's
    CheckpointException (every rank's write errors, gathered) and megatron-core's
    CheckpointingException."""
    api = importlib.import_module("torch.distributed.checkpoint.api")
    core = importlib.import_module("megatron.core.dist_checkpointing.core")
    return (OSError, ImportError, RuntimeError, api.CheckpointException,
            core.CheckpointingException)

def _cause(error) -> str:
    """What a save's error says; for torch's CheckpointException, the first failing rank's
    (megatron-core logs the OSError under it only), or that another rank's write failed."""
    if type(error).__name__ == "CheckpointException":
        failures = getattr(error, "failures", None) or {}
        if not failures:
            return "torch's CheckpointException: another rank's write failed"
        rank, failure = sorted(failures.items())[0]
        failure = failure[0] if isinstance(failure, tuple) else failure
        error = failure
    said = getattr(error, "strerror", None) or " ".join(str(error).split())
    return f"{type(error).__name__}: {said}"[:400]


def _remove_unfinished(save, iteration) -> None:
    if not isinstance(iteration, int) or _last_complete(save) == iteration:
        return
    folder = checkpoint_folder(save, iteration)
    if os.path.isdir(folder) and not is_whole(folder):
        shutil.rmtree(folder, ignore_errors=True)


def _failed_save(save, iteration, error, room) -> CheckpointError:
    """The line, said after the unfinished folder is removed: the room before the save (what
    is free now is not what the save met)."""
    said = [room] if room else []
    last = _last_complete(save)
    if last is not None:
        said.append(f"the last checkpoint (iteration {last}, which the tracker still names) "
                    f"takes {_size(_folder_bytes(checkpoint_folder(save, last)))}")
    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    return CheckpointError(
        f"--save {save}: rank {rank}: the checkpoint of iteration {iteration} could not be "
        f"written ({_cause(error)}){'; ' + ', '.join(said) if said else ''}; its unfinished "
        f"folder is removed: free space there or give another --save, then resume")
