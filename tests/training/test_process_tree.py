"""training/process_tree.py: a rank ends with its launcher; what a rank started ends with the
rank, however it dies.

The group test builds what megatron-core's forked checkpoint writers are (measured with
0.16.1: a writer inheriting Megatron-LM's --exit-signal-handler swallowed torchrun's SIGTERM
and outlived a rank killed with -9): a process the rank forked that ignores SIGTERM, in the
rank's own session as torchrun starts it. Unguarded, it outlives the rank (the control, so the
test can fail); guarded, it is gone within seconds. tests/functional/test_checkpoint_faults.py
kills ranks of Megatron-LM's trainer during saves.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# process_tree.py by its path: it needs the standard library only, and importing the package
# (torch) takes seconds
LOAD = ("import importlib.util as u;"
        "spec = u.spec_from_file_location('process_tree', %r);"
        "process_tree = u.module_from_spec(spec); spec.loader.exec_module(process_tree);"
        ) % os.path.join(REPO, "megatron_eod", "training", "process_tree.py")

CHILD = LOAD + ("import time;"
                "assert process_tree.exit_with_parent(); print('armed', flush=True);"
                "time.sleep(120)")
PARENT = ("import subprocess, sys, time;"
          "child = subprocess.Popen([sys.executable, '-c', %r], stdout=sys.stdout);"
          "print(child.pid, flush=True); time.sleep(120)") % CHILD


def _gone_within(pid, seconds) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _kill(pid):
    try:
        psutil.Process(pid).kill()
    except psutil.NoSuchProcess:
        pass


def test_a_worker_exits_when_its_launcher_is_killed():
    """A worker whose launcher dies (kill -9 of torchrun's agent) ends instead of training on."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        child_pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "armed"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone_within(child_pid, 20), "the worker outlived its parent"
    finally:
        parent.kill()
        if child_pid:
            _kill(child_pid)


# A rank: guarded or not, it forks a writer that ignores SIGTERM (as one inheriting a handler
# that swallows it), says both PIDs, and trains on (sleeps).
RANK = LOAD + ("import os, signal, sys, time;"
        "guarded = process_tree.reap_group_at_exit() if sys.argv[1] == 'guarded' else False;"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); writer = os.fork();"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL) if writer else None;"
        "print(os.getpid(), writer, guarded, flush=True) if writer else None;"
        "time.sleep(120)")


@pytest.mark.parametrize("guard", ["guarded", "unguarded"])
def test_what_a_killed_rank_started_ends_with_it(guard):
    rank = subprocess.Popen([sys.executable, "-c", RANK, guard], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)  # as torchrun starts a rank
    writer = None
    try:
        rank_pid, writer, guarded = rank.stdout.readline().split()
        writer = int(writer)
        assert guarded == str(guard == "guarded")
        os.killpg(rank.pid, signal.SIGTERM)  # what torchrun's agent sends a failed rank's group
        rank.send_signal(signal.SIGKILL)
        rank.wait()
        if guard == "guarded":
            assert _gone_within(writer, 20), "the rank's writer outlived it"
        else:  # the control: the fault this guard is for
            assert not _gone_within(writer, 2), "an unguarded writer that ignores SIGTERM ended"
    finally:
        rank.kill()
        if writer:
            _kill(writer)


def test_no_guard_where_the_rank_does_not_lead_its_group():
    """Started in its launcher's group (not by torchrun), the group holds the launcher and other
    ranks: no watcher."""
    said = subprocess.run([sys.executable, "-c", RANK.replace("time.sleep(120)", "None"),
                           "guarded"], capture_output=True, text=True, timeout=60)
    assert said.stdout.split()[2] == "False", said
