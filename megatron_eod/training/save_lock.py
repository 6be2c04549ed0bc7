"""One job at a time in a --save folder: `hold_save_folder(folder, error_type)`, both trainers.

Two jobs writing one --save (a job submitted twice, a relaunch while the first still runs)
took turns over its checkpoints: both saved the same iterations into the same folders, each
save first clearing what the other wrote, and one stopped with a FileNotFoundError traceback
when the other removed its tracker's `.tmp` (a helper's soak, 2026-11-28; the other trained
on). Now rank 0 holds a lock file in the folder, LOCK, for as long as the job runs: its host,
process id (and process id namespace), Slurm job id and a heartbeat counter a daemon thread
raises every BEAT_S seconds (counted, not timed: hosts' clocks may differ), rewriting the file
in place. A job finding another's lock there:

* the same process (Megatron-LM's in-process restart) or the same Slurm job (torchrun
  restarted its workers): takes it over;
* a process on this host, in this process id namespace: alive or not decides at once (in
  another one, a container sharing the host's name, as on another host);
* a process on another host: alive while its heartbeat moves; waits up to STALE_BEATS beats
  for it (a relaunch after a kill pays that, ~25 s), then takes it over.

Alive, every rank stops with one line naming the job and the lock file. A clean end removes
the lock; a killed job leaves it, for the next job to take over as above.

What it does not do: no lock while the job runs between two checks (two jobs starting in the
same instant may both take it; the later write wins, and the other's heartbeat then says so
once); no lock for --load alone (reading does not conflict).
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

_HELD = {}  # folder -> (token, stop event)


_TORN = {"token": None}  # read while being rewritten: there, and changing


def _read(path) -> Optional[dict]:
    """The lock's content; None where there is none; _TORN where it is being rewritten."""
    try:
        with open(path) as f:
            info = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return _TORN
    return info if isinstance(info, dict) else _TORN


def _write(path, info) -> None:
    """A new lock: written aside, then renamed into place (never seen half-written)."""
    tmp = f"{path}.{info['token']}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def _rewrite(path, info) -> None:
    """A heartbeat: the same file rewritten in place. One inode for the job's life: another
    host's open sees each beat (NFS's close-to-open), where a rename's new file could hide
    behind that host's cached name lookup and look silent."""
    with open(path, "r+") as f:
        f.truncate(0)
        json.dump(info, f)


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # someone else's process: alive
    return True


def _job_id() -> Optional[str]:
    return os.environ.get("SLURM_JOB_ID") or None


def _where() -> str:
    """This host and process id namespace: where a process id means one process."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "?"
    return f"{socket.gethostname()} {namespace}"


def _other_job_alive(path, other) -> bool:
    here = other.get("where") == _where()
    if here and other.get("pid") == os.getpid():
        return False  # this process: an in-process restart
    if other.get("job") and other.get("job") == _job_id():
        return False  # this job: torchrun restarted its workers
    if here:
        return _pid_alive(other.get("pid"))
    deadline = time.monotonic() + STALE_BEATS * BEAT_S
    while time.monotonic() < deadline:
        time.sleep(min(BEAT_S / 4, max(deadline - time.monotonic(), 0)))
        now = _read(path)
        if now is None:
            return False  # it ended and removed its lock
        if now is _TORN or now.get("token") != other.get("token") or \
                now.get("beat") != other.get("beat"):
            return True  # beating, or another job took it
    return False


def _beat(path, info, stop) -> None:
    while not stop.wait(BEAT_S):
        now = _read(path)
        if now is not None and now is not _TORN and now.get("token") != info["token"]:
            print(f" --save {os.path.dirname(path)}: another job (host {now.get('host')}, "
                  f"process {now.get('pid')}) took over {LOCK} there: two jobs are writing "
                  f"this folder", flush=True)
            return
        info["beat"] += 1
        try:
            _rewrite(path, info)
        except OSError:
            pass  # a file system hiccup: the next beat tries again


def _acquire(folder) -> Optional[str]:
    """Rank 0: None once the lock is held, or why not."""
    path = os.path.join(folder, LOCK)
    try:
        os.makedirs(folder, exist_ok=True)
        other = _read(path)
        if other is _TORN:  # another job's beat at this instant: read it once more
            time.sleep(0.1)
            other = _read(path)
        if other is not None and _other_job_alive(path, other):
            job = f", Slurm job {other['job']}" if other.get("job") else ""
            return (f"--save {folder} is in use by another job (host {other.get('host')}, "
                    f"process {other.get('pid')}{job}): two jobs would overwrite each other's "
                    f"checkpoints. Stop that job, or give another --save; if it is gone, "
                    f"delete {path}")
        release_save_folder(folder)  # an in-process restart's own thread
        info = {"host": socket.gethostname(), "where": _where(), "pid": os.getpid(),
                "job": _job_id(), "token": uuid.uuid4().hex, "beat": 0}
        _write(path, info)
    except OSError as error:
        return f"--save {folder}: cannot hold {LOCK} there ({error.strerror or error})"
    stop = threading.Event()
    threading.Thread(target=_beat, args=(path, dict(info), stop), daemon=True,
                     name="megatron-eod-save-lock").start()
    _HELD[folder] = (info["token"], stop)
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
    """Stop the heartbeat and remove the lock where this job still holds it (every folder
    when none is named). Any rank may call it: only rank 0 holds one."""
    for held in [folder] if folder else list(_HELD):
        token, stop = _HELD.pop(held, (None, None))
        if stop is None:
            continue
        stop.set()
        path = os.path.join(held, LOCK)
        now = _read(path)
        if now is not None and now.get("token") == token:
            try:
                os.remove(path)
            except OSError:
                pass
