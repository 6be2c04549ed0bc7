"""A worker whose launcher dies (kill -9 of torchrun's agent) ends instead of training on."""

import os
import signal
import subprocess
import sys
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = ("import sys, time; sys.path.insert(0, %r);"
         "from megatron_eod.training.parent_watch import exit_with_parent;"
         "assert exit_with_parent(); print('armed', flush=True); time.sleep(120)") % REPO
PARENT = ("import subprocess, sys, time;"
          "child = subprocess.Popen([sys.executable, '-c', %r], stdout=sys.stdout);"
          "print(child.pid, flush=True); time.sleep(120)") % CHILD


def test_worker_exits_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "armed"
        child = psutil.Process(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        end = time.monotonic() + 20
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < end, "the worker outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        try:
            psutil.Process(child_pid).kill()
        except (psutil.NoSuchProcess, NameError, UnboundLocalError):
            pass
