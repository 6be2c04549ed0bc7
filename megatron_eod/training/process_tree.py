"""No process of a job outlives it: a rank ends with its launcher, and what a rank started ends
with the rank, whatever ends it (kill -9 by the OOM killer included).

One job, two guards, armed by run.py when torchrun started the rank:
- `exit_with_parent()`: when torchrun's agent dies (kill -9, a lost node), its workers must not
  train on as orphans writing checkpoints nobody reads; Linux sends the rank SIGTERM when its
  parent exits (prctl PR_SET_PDEATHSIG).
- `reap_group_at_exit()`: the processes a rank starts (megatron-core's checkpoint writers:
  forked per save before 0.17 and by --async-save, a spawned results-queue Manager and
  persistent async worker after; data-loader workers) are in the rank's process group, and
  torchrun's agent ends a failed rank's group with SIGTERM only. A forked writer inherits the
  rank's SIGTERM handler (Megatron-LM's --exit-signal-handler) and swallows it, then waits
  forever on a queue its dead parent held (measured: megatron-core 0.16.1, kill -9 of rank 0
  0.1 s into a save, a writer alive with PID 1 as parent). A watcher process (~15 MB, started
  once) waits for the rank's exit (pidfd) and then SIGKILLs the group, itself last. Armed only
  where the rank leads its process group (torchrun starts each worker in a session of its
  own): elsewhere the group holds the launcher and other ranks.

What it does not do: nothing on systems without prctl or process groups (macOS, Windows), no
guard for a rank started by another launcher (srun, mpirun: their job step's cgroup ends it).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

__all__ = ["exit_with_parent", "launched_by_torchrun", "reap_group_at_exit"]

_PR_SET_PDEATHSIG = 1


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def exit_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Arrange `sig` for this process when its parent dies; True where that is in effect."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent or parent == 1:  # the parent died before the request
        os.kill(os.getpid(), sig)
    return True


# The watcher: ignores the SIGTERM torchrun sends the group (it must outlast the rank), says it
# is armed, waits for the rank's exit (a pidfd; where there is none, its parent changing), then
# kills the group.
_WATCHER = """
import os, select, signal, sys, time
rank = int(sys.argv[1])
for name in ("SIGTERM", "SIGINT", "SIGHUP"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
try:
    exited = os.pidfd_open(rank)
except (AttributeError, OSError):
    exited = None
print("armed", flush=True)
sys.stdout.close()
if exited is not None:
    select.select([exited], [], [])
while exited is None and os.getppid() == rank:
    time.sleep(0.5)
os.killpg(rank, signal.SIGKILL)
"""


def reap_group_at_exit() -> bool:
    """Start the watcher that SIGKILLs this rank's process group when the rank exits; True
    where it is armed (the rank leads its own group)."""
    if not hasattr(os, "killpg") or os.getpgid(0) != os.getpid():
        return False
    global _watcher
    _watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, close_fds=True, text=True)
    with _watcher.stdout:  # armed before the rank goes on (~50 ms, once)
        return _watcher.stdout.readline().strip() == "armed"


_watcher = None  # held: the rank's exit, not Python's collection of it, ends the watch
