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

import pytest

from megatron_eod.training import save_lock
from megatron_eod.training.save_lock import LOCK
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks
from tests.training.test_nan_stop import _train

pytestmark = pytest.mark.timeout(240)


def _lock(folder, **info):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, LOCK), "w") as f:
        json.dump({"host": socket.gethostname(), "where": save_lock._where(),
                   "pid": os.getpid(), "job": None, "token": "theirs", "beat": 0, **info}, f)


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_lock_is_held_while_the_job_runs_and_removed_at_its_end(tmp_path):
    folder = str(tmp_path / "ckpt")
    assert save_lock._acquire(folder) is None
    with open(os.path.join(folder, LOCK)) as f:
        assert json.load(f)["pid"] == os.getpid()
    assert save_lock._acquire(folder) is None  # this process again: an in-process restart
    save_lock.release_save_folder()
    assert os.listdir(folder) == []
    assert save_lock.written_folder(argparse.Namespace(save=folder, skip_train=True)) is None


def test_another_live_job_on_this_host_is_refused_a_dead_one_taken_over(tmp_path, monkeypatch):
    monkeypatch.setattr(save_lock, "BEAT_S", 0.08)
    folder = str(tmp_path / "ckpt")
    _lock(folder, pid=os.getppid(), job="17")
    said = save_lock._acquire(folder)
    assert said == (f"--save {folder} is in use by another job (host {socket.gethostname()}, "
                    f"process {os.getppid()}, Slurm job 17): two jobs would overwrite each "
                    f"other's checkpoints. Stop that job, or give another --save; if it is "
                    f"gone, delete {folder}/{LOCK}")
    _lock(folder, pid=_dead_pid())  # killed: its lock stays
    assert save_lock._acquire(folder) is None
    save_lock.release_save_folder()
    # This host's name in another process id namespace (a container sharing the host's name):
    # a process id there means nothing here, the heartbeat decides.
    _lock(folder, pid=_dead_pid(), where=f"{socket.gethostname()} pid:[1]")
    assert save_lock._other_job_alive(os.path.join(folder, LOCK), {
        "where": f"{socket.gethostname()} pid:[1]", "pid": os.getpid(), "token": "other",
        "beat": 0})  # the file's token differs: another job wrote it since


def test_the_same_slurm_job_takes_its_lock_over(tmp_path, monkeypatch):
    """torchrun restarting the workers inside one Slurm job: the old rank 0 is gone."""
    folder = str(tmp_path / "ckpt")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    _lock(folder, host="elsewhere", where="elsewhere ns", job="42")
    assert save_lock._acquire(folder) is None
    save_lock.release_save_folder()


def test_a_job_on_another_host_is_alive_while_its_heartbeat_moves(tmp_path, monkeypatch):
    monkeypatch.setattr(save_lock, "BEAT_S", 0.08)
    folder = str(tmp_path / "ckpt")
    _lock(folder, host="node7", where="node7 ns")
    stop = threading.Event()

    def beating():
        beat = 0
        while not stop.wait(0.02):
            beat += 1
            _lock(folder, host="node7", where="node7 ns", beat=beat)

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
    with open(os.path.join(folder, LOCK), "w") as f:
        f.write('{"host": "node7", "pi')  # read in the middle of a beat: not gone
    assert save_lock._read(os.path.join(folder, LOCK)) is save_lock._TORN
    assert save_lock._other_job_alive(os.path.join(folder, LOCK), {"host": "node7"})


def test_the_lean_trainer_stops_every_rank_and_cleans_up_after_itself(tiny_data, tmp_path):
    folder = str(tmp_path / "ckpt")
    _lock(folder)  # this test's process: alive, on this host
    results = run_ranks(_train, 2, tiny_flags(tiny_data, "--train-iters", "3", "--save", folder,
                                              "--save-interval", "3"), daemon=False)
    assert [code for code, *_ in results] == [2, 2], results
    for _, text, _ in results:
        assert f"pretrain_gpt.py: error: --save {folder} is in use by another job" in text
    os.remove(os.path.join(folder, LOCK))
    results = run_ranks(_train, 2, tiny_flags(tiny_data, "--train-iters", "3", "--save", folder,
                                              "--save-interval", "3"), daemon=False)
    assert [code for code, *_ in results] == [0, 0], results
    assert LOCK not in os.listdir(folder)


def test_megatron_lm_trainer_stops_every_rank_too(short_docs_data, tmp_path):
    from tests.training.megatron_lm_checkout import import_megatron_lm
    from tests.training.test_megatron_lm_pretrain import _start, flags

    import_megatron_lm()
    folder = str(tmp_path / "ckpt")
    _lock(folder)
    argv = flags(short_docs_data, str(tmp_path / "m.jsonl")) + ["--save", folder,
                                                                 "--save-interval", "5"]
    results = run_ranks(_start, 2, argv, timeout=240, daemon=False)
    assert [code for code, _ in results] == [2, 2], results
    for _, text in results:
        assert f"pretrain_gpt.py: error: --save {folder} is in use by another job" in text \
            and "Traceback" not in text, text[-2000:]
