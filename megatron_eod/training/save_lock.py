"""One job at a time in a --save folder: `hold_save_folder(folder, error_type)`.

Two jobs writing one --save (a job submitted twice, a relaunch while the first still runs)
took turns over its checkpoints: both saved the same iterations into the same folders, each
save first clearing what the other wrote, and one stopped with a FileNotFoundError traceback
when the other removed its tracker's `.tmp` (a helper's soak, 2026-11-28; the other trained
on). Now rank 0 holds a lock file in the folder, LOCK, for as long as the job runs: where it
runs (host, boot, process id namespace), its process (id and start time), the folder's
identity, the Slurm job id, and a heartbeat counter a daemon thread raises every BEAT_S
seconds (counted, not timed: hosts' clocks may differ), rewriting the file in place. A job
finding another's lock there:

* the same process (Megatron-LM's in-process restart) or the same Slurm job (torchrun
  restarted its workers): takes it over;
* written where this job runs (same host, boot and process id namespace): the process
  decides at once (gone, a zombie, or its id reused by a later process: dead), and a lock
  naming another folder than this one (the folder was copied with it) is not this folder's;
* elsewhere: alive while the file's bytes change; unchanged for STALE_BEATS beats (a relaunch
  after a kill pays that, ~25 s; a lock left half-written, e.g. by a full disk, never
  changes either), taken over.

Alive, every rank stops with one line naming the job and the lock file. A clean end removes
the lock; a killed job leaves it, for the next job to take over as above.

What it does not do: no lock while the job runs between two checks (two jobs starting in the
same instant may both take it; the later write wins, and the other's heartbeat then says so
once, and both go on); no lock for --load alone (reading does not conflict).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Optional

import torch.distributed as dist

from megatron_eod.training.every_rank import gathered

__all__ = ["LOCK", "hold_save_folder", "release_save_folder", "written_folder"]

LOCK = ".megatron_eod_job.json"
BEAT_S = 10.0
STALE_BEATS = 2.5

_HELD = {}  # folder -> (token, stop event, the beat's guard, heartbeat thread)


def _bytes(path) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _parsed(raw) -> dict:
    try:
        info = json.loads(raw)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _write(path, info) -> None:
    """A new lock: written aside, then renamed into place (never seen half-written)."""
    tmp = f"{path}.{info['token']}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def _rewrite(path, info) -> None:
    """A heartbeat: the same file rewritten in place, its old bytes kept until the new ones
    are written over them. One inode for the job's life: another host's open sees each beat
    (NFS's close-to-open), where a rename's new file could hide behind that host's cached
    name lookup and look silent."""
    data = json.dumps(info).encode()
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))


def _boot() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _where() -> str:
    """Where a process id names one process: host, boot and process id namespace."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "?"
    return f"{socket.gethostname()} {_boot()} {namespace}"


def _process(pid) -> Optional[tuple]:
    """(state, start time) of a process of this namespace from /proc, or None where it does
    not exist; ("?", None) where /proc cannot say (then it is taken as alive)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, IndexError):
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return None
        except (OSError, ValueError, TypeError, OverflowError):
            pass
        return "?", None


def _folder_id(folder) -> str:
    st = os.stat(folder)
    return f"{st.st_dev}:{st.st_ino}"


def _job_id() -> Optional[str]:
    return os.environ.get("SLURM_JOB_ID") or None


def _other_job_alive(path, raw, folder) -> bool:
    """Whether the job that wrote the lock `raw` (its bytes) holds it."""
    other = _parsed(raw)
    here = other.get("where") == _where()
    if here and other.get("pid") == os.getpid():
        return False  # this process: an in-process restart
    if other.get("job") and other.get("job") == _job_id():
        return False  # this job: torchrun restarted its workers
    if here:
        if other.get("folder") != _folder_id(folder):
            return False  # the lock of the folder this one was copied from
        process = _process(other.get("pid"))
        return process is not None and process[0] != "Z" and (
            process[1] is None or other.get("started") in (None, process[1]))
    deadline = time.monotonic() + STALE_BEATS * BEAT_S
    while time.monotonic() < deadline:
        time.sleep(min(BEAT_S / 4, max(deadline - time.monotonic(), 0)))
        now = _bytes(path)
        if now is None:
            return False  # it ended and removed its lock
        if now != raw:
            return True  # beating, or another job took it
    return False


def _beat(path, info, stop, guard) -> None:
    while not stop.wait(BEAT_S):
        with guard:
            if stop.is_set():
                return
            try:
                now = _parsed(_bytes(path) or b"")
                if now and now.get("token") != info["token"]:
                    print(f" --save {os.path.dirname(path)}: another job (host "
                          f"{now.get('host')}, process {now.get('pid')}) took over {LOCK} "
                          f"there: two jobs are writing this folder", flush=True)
                    return
                info["beat"] += 1
                _rewrite(path, info)
            except OSError:
                pass  # a file system hiccup: the next beat tries again


def _acquire(folder) -> Optional[str]:
    """Rank 0: None once the lock is held, or why not."""
    path = os.path.join(folder, LOCK)
    try:
        os.makedirs(folder, exist_ok=True)
        raw = _bytes(path)
        if raw is not None and _other_job_alive(path, raw, folder):
            other = _parsed(raw)
            who = (f"host {other.get('host')}, process {other.get('pid')}"
                   f"{', Slurm job ' + str(other['job']) if other.get('job') else ''}"
                   if other else f"its lock cannot be read: {raw[:60]!r}")
            return (f"--save {folder} is in use by another job ({who}): two jobs would "
                    f"overwrite each other's checkpoints. Stop that job, or give another "
                    f"--save; if it is gone, delete {path}")
        release_save_folder(folder)  # an in-process restart's own heartbeat
        process = _process(os.getpid())
        info = {"host": socket.gethostname(), "where": _where(), "pid": os.getpid(),
                "started": process[1] if process else None, "folder": _folder_id(folder),
                "job": _job_id(), "token": uuid.uuid4().hex, "beat": 0}
        _write(path, info)
    except OSError as error:
        return f"--save {folder}: cannot hold {LOCK} there ({error.strerror or error})"
    stop, guard = threading.Event(), threading.Lock()
    thread = threading.Thread(target=_beat, args=(path, dict(info), stop, guard), daemon=True,
                              name="megatron-eod-save-lock")
    thread.start()
    _HELD[folder] = (info["token"], stop, guard, thread)
    return None


def written_folder(args) -> Optional[str]:
    """The --save a run writes: none under --skip-train (an evaluation of a running job's
    checkpoints that kept --save in its script writes nothing there)."""
    return None if getattr(args, "skip_train", False) else getattr(args, "save", None)


def hold_save_folder(folder: Optional[str], error_type) -> None:
    """Collective: rank 0 takes --save's lock; `error_type` on every rank where another job
    holds it. No folder (no --save): nothing."""
    if not folder:
        return
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    said = _acquire(folder) if rank0 else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        said = gathered(said)[0]
    if said:
        raise error_type(said)


def release_save_folder(folder: Optional[str] = None) -> None:
    """Stop the heartbeat (waiting for a beat in flight) and remove the lock where this job
    still holds it (every folder when none is named). Only rank 0 holds one."""
    for held in [folder] if folder else list(_HELD):
        token, stop, guard, thread = _HELD.pop(held, (None, None, None, None))
        if stop is None:
            continue
        with guard:
            stop.set()
        thread.join()
        path = os.path.join(held, LOCK)
        if _parsed(_bytes(path) or b"").get("token") == token:
            try:
                os.remove(path)
            except OSError:
                pass
