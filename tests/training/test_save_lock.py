"""One job at a time in a --save folder (training/save_lock.py), both trainers. Two jobs on one
--save (a job submitted twice) cleared and overwrote each other's checkpoints, and one stopped
with a FileNotFoundError traceback when the other removed its tracker's .tmp (a helper's soak).
Other hosts are stood in for by a host name in the lock; their heartbeat by a thread."""

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from megatron_eod.training import save_lock
from megatron_eod.training.save_lock import LOCK
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)


def _lock(at, **info):
    """A lock as another job on this host (this test's process unless `pid` says) wrote it."""
    os.makedirs(at, exist_ok=True)
    with open(os.path.join(at, LOCK), "w") as f:
        json.dump({"host": socket.gethostname(), "where": save_lock._where(),
                   "pid": os.getpid(), "started": None, "folder": save_lock._folder_id(at),
                   "job": None, "token": "theirs", "beat": 0, **info}, f)


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def quick_beats(monkeypatch):
    monkeypatch.setattr(save_lock, "BEAT_S", 0.08)


def test_a_lock_is_held_while_the_job_runs_and_removed_at_its_end(tmp_path, quick_beats):
    folder = str(tmp_path / "ckpt")
    path = os.path.join(folder, LOCK)
    assert save_lock._acquire(folder) is None
    with open(path) as f:
        assert json.load(f)["pid"] == os.getpid()
    time.sleep(0.5)  # the heartbeat raises its counter in place
    with open(path) as f:
        assert json.load(f)["beat"] >= 3
    assert save_lock._acquire(folder) is None  # this process again: an in-process restart
    (_, _, _, thread), = save_lock._HELD.values()
    save_lock.release_save_folder()
    assert os.listdir(folder) == [] and not thread.is_alive()
    assert save_lock.written_folder(argparse.Namespace(save=folder, skip_train=True)) is None


def test_a_live_job_on_this_host_is_refused_a_gone_one_taken_over(tmp_path, quick_beats):
    folder = str(tmp_path / "ckpt")
    _lock(folder, pid=os.getppid(), job="17")
    said = save_lock._acquire(folder)
    assert said == (f"--save {folder} is in use by another job (host {socket.gethostname()}, "
                    f"process {os.getppid()}, Slurm job 17): two jobs would overwrite each "
                    f"other's checkpoints. Stop that job, or give another --save; if it is "
                    f"gone, delete {folder}/{LOCK}")
    for gone in (dict(pid=_dead_pid()),  # killed: its lock stays
                 dict(pid=os.getppid(), started="1"),  # its process id taken by another
                 dict(pid=os.getppid(), folder="0:0")):  # a copy of its folder
        _lock(folder, **gone)
        assert save_lock._acquire(folder) is None, gone
        save_lock.release_save_folder()


def test_a_process_id_of_another_namespace_is_not_read_here(tmp_path, quick_beats):
    """This host's name in another process id namespace (a container sharing the host's
    name): its process id means nothing here; the lock's bytes decide."""
    folder = str(tmp_path / "ckpt")
    path = os.path.join(folder, LOCK)
    elsewhere = dict(pid=_dead_pid(), where=f"{socket.gethostname()} ? pid:[1]")
    _lock(folder, **elsewhere)
    with open(path, "rb") as f:
        raw = f.read()
    _lock(folder, beat=1, **elsewhere)  # it beat since
    assert save_lock._other_job_alive(path, raw, folder)


def test_the_same_slurm_job_takes_its_lock_over(tmp_path, monkeypatch):
    """torchrun restarting the workers inside one Slurm job: the old rank 0 is gone."""
    folder = str(tmp_path / "ckpt")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    _lock(folder, host="elsewhere", where="elsewhere", job="42")
    assert save_lock._acquire(folder) is None
    save_lock.release_save_folder()


def test_a_job_on_another_host_is_alive_while_its_lock_changes(tmp_path, quick_beats):
    folder = str(tmp_path / "ckpt")
    node7 = dict(host="node7", where="node7")
    _lock(folder, **node7)
    stop = threading.Event()

    def beating():
        beat = 0
        while not stop.wait(0.02):
            beat += 1
            _lock(folder, beat=beat, **node7)

    thread = threading.Thread(target=beating)
    thread.start()
    try:
        assert save_lock._acquire(folder).startswith(f"--save {folder} is in use by another "
                                                     f"job (host node7, ")
    finally:
        stop.set()
        thread.join()
    assert save_lock._acquire(folder) is None  # its heartbeat stopped: taken over
    save_lock.release_save_folder()
    with open(os.path.join(folder, LOCK), "w") as f:  # left half-written (a full disk):
        f.write('{"host": "node7", "pi')  # it never changes, so it is taken over too
    assert save_lock._acquire(folder) is None
    save_lock.release_save_folder()


def test_another_job_in_the_folder_stops_every_rank(short_docs_data, tmp_path):
    from tests.training.megatron_lm_checkout import import_megatron_lm
    from tests.training.runs import flags, start

    import_megatron_lm()
    folder = str(tmp_path / "ckpt")
    _lock(folder)  # this test's process: alive, on this host
    argv = flags(short_docs_data, None, "--save", folder, "--save-interval", "5")
    results = run_ranks(start, 2, argv, timeout=240, daemon=False)
    assert [code for code, _ in results] == [2, 2], results
    for _, text in results:
        assert f"pretrain_gpt.py: error: --save {folder} is in use by another job" in text \
            and "Traceback" not in text, text[-2000:]
    os.remove(os.path.join(folder, LOCK))  # that job gone: this one runs, and cleans up
    results = run_ranks(start, 2, argv, timeout=240, daemon=False)
    assert [code for code, _ in results] == [0, 0], results
    assert LOCK not in os.listdir(folder) and "latest_checkpointed_iteration.txt" in \
        os.listdir(folder)
