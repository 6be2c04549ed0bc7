"""Workers end with the launcher that started them.

One job: when torchrun's agent dies (kill -9, a lost node), its workers must not train on as
orphans writing checkpoints nobody reads. `exit_with_parent()` asks Linux to send SIGTERM to
this process when its parent exits (prctl PR_SET_PDEATHSIG), and checks that the parent is
not already gone. Used by both trainers at start-up when a launcher started the process.

What it does not do: nothing on systems without prctl (macOS): there it returns False.
"""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["exit_with_parent", "launched_by_torchrun"]

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
