"""Checkpoints under the ways clusters kill jobs, through Megatron-LM's REAL `pretrain()` on gloo
ranks (issue 51): a full disk (a real tmpfs, mounted here: root only, else skipped), a tracker
cut to 0 bytes, and kill -9 of rank 0 during a save under torchrun.

Losses are compared with the uninterrupted run's (`baseline`, the same layout: bitwise).
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.training.megatron_lm_checkout import subprocess_env
from tests.training.runs import error_lines, flags, run_ranks, start, train

pytestmark = pytest.mark.timeout(300)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACKER = "latest_checkpointed_iteration.txt"


@contextlib.contextmanager
def tmpfs(path, size_bytes):
    """A tmpfs of `size_bytes` at `path`, unmounted after."""
    os.makedirs(path)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes // 1024}k", "tmpfs",
                           str(path)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"a tmpfs cannot be mounted here (root only): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _grow(path, size_bytes):
    subprocess.run(["mount", "-o", f"remount,size={size_bytes // 1024}k", str(path)],
                   check=True)


def _bytes(folder):
    return sum(os.path.getsize(os.path.join(where, name))
               for where, _, names in os.walk(folder) for name in names)


@pytest.fixture(scope="module")
def saved_at_2(short_docs_data, tmp_path_factory):
    """The tiny GPT (4 ranks, CP=1) saved at iteration 2: (its --save folder, its size, the
    losses of iterations 1-2)."""
    folder = tmp_path_factory.mktemp("saved")
    save = str(folder / "ckpt")
    losses, _ = train(folder, "first", short_docs_data, "--save", save, "--exit-interval", "2")
    assert sorted(losses) == [1, 2]
    return save, _bytes(os.path.join(save, "iter_0000002")), losses


def _ended_with_one_line(results, said):
    lines = error_lines(results)
    for (code, text), mine in zip(results, lines):
        assert code == 2 and len(mine) == 1 and said in mine[0], text[-3000:]
        assert "Traceback" not in text, text[-3000:]
    return lines[0][0]


def test_no_room_for_the_next_save_stops_every_rank_and_a_relaunch_with_room_resumes(
        baseline, saved_at_2, short_docs_data, tmp_path):
    """A --save with room for one checkpoint: the save of iteration 4 stops every rank with
    one line before writing (free and needed space named); the tracker stays on 2; grown,
    the same launch resumes with the uninterrupted run's losses."""
    source, size, first = saved_at_2
    with tmpfs(tmp_path / "disk", size * 3 // 2) as disk:
        save = str(disk / "ckpt")
        shutil.copytree(source, save)
        argv = flags(short_docs_data, None, "--load", save, "--save", save)
        started = time.monotonic()
        results = run_ranks(start, 4, argv, timeout=240, daemon=False)
        took = time.monotonic() - started
        line = _ended_with_one_line(results, f"--save {save}: no room for the checkpoint of "
                                             f"iteration 4: ")
        assert "MiB needed (the size of the last checkpoint, iteration 2)" in line, line
        assert not os.path.exists(os.path.join(save, "iter_0000004"))
        assert open(os.path.join(save, TRACKER)).read().strip() == "2"
        _grow(disk, size * 4)
        rest, _ = train(tmp_path, "rest", short_docs_data, "--load", save, "--save", save)
        assert open(os.path.join(save, TRACKER)).read().strip() == "4"
    assert {**first, **rest} == baseline[0]
    print(f"stopped in {took:.1f} s; checkpoint {size} bytes")


def test_a_disk_that_fills_during_a_save_is_one_line_and_the_unfinished_folder_removed(
        saved_at_2, short_docs_data, tmp_path):
    """Room for the estimate (a lower bound) but not for the checkpoint: megatron-core's write
    fails on the ranks (Megatron-LM: a traceback on every rank, the first line "unexpected pos
    704 vs 598", and the partial folder kept on the full disk); now one line on each, the
    room before the save named, the folder removed, and no tracker written."""
    _, size, _ = saved_at_2
    with tmpfs(tmp_path / "disk", size * 92 // 100) as disk:
        save = str(disk / "ckpt")
        results = run_ranks(start, 4, flags(short_docs_data, None, "--save", save,
                                             "--exit-interval", "2"), timeout=240, daemon=False)
        line = _ended_with_one_line(results, "the checkpoint of iteration 2 could not be written")
        assert " was free there before it, " in line and "MiB needed (an estimate of the " \
            "first checkpoint" in line and line.endswith(
            "its unfinished folder is removed: free space there or give another --save, then "
            "resume"), line
        assert not os.path.exists(os.path.join(save, "iter_0000002"))
        assert not os.path.exists(os.path.join(save, TRACKER))


def test_a_tracker_cut_to_nothing_resumes_the_newest_checkpoint_with_the_same_losses(
        baseline, saved_at_2, short_docs_data, tmp_path):
    """Megatron-LM wrote the tracker in place: a kill then left it empty, and the next launch
    refused until it was edited. It resumes from the newest complete checkpoint now, with the
    uninterrupted run's losses."""
    source, _, first = saved_at_2
    save = str(tmp_path / "ckpt")
    shutil.copytree(source, save)
    open(os.path.join(save, TRACKER), "w").close()
    rest, log = train(tmp_path, "rest", short_docs_data, "--load", save)
    assert {**first, **rest} == baseline[0]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _of_job(port):
    def mine(process):
        try:
            return (process.environ().get("MASTER_PORT") == str(port) and
                    process.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False
    return [p for p in psutil.process_iter() if mine(p)]


DELAYS = (0.1, 0.25)  # (0.1: where a writer outlived its rank before process_tree.py)


def _said(process):
    try:
        return f"parent {process.ppid()}: {' '.join(process.cmdline())[:80]}"
    except psutil.Error:
        return "ended"


def _is_rank_0(process):
    try:  # a writer that has just exited is a zombie: no command line
        return ("pretrain_gpt.py" in " ".join(process.cmdline()) and
                process.environ().get("RANK") == "0")
    except psutil.Error:
        return False


def test_kill_9_of_rank_0_during_a_save_leaves_no_process(short_docs_data, tmp_path):
    """torchrun, 2 ranks, --exit-signal-handler (Megatron-LM's SIGTERM handler, inherited by
    what a rank forks), a save at every iteration: rank 0 killed DELAYS s after the third
    save's folder appears, one job per delay, the jobs side by side (their start-up, ~1 min
    here, is mostly imports). No process of any job is left 20 s after its torchrun ends
    (measured with megatron-core 0.16.1 before process_tree.py: a forked writer, parent PID 1,
    at 0.1 s; 0.19.2 on CPU forks no writer)."""
    jobs = []
    for delay in DELAYS:
        port, save = _free_port(), str(tmp_path / f"ckpt{delay}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               os.path.join(REPO, "pretrain_gpt.py"),
               *flags(short_docs_data, None, "--train-iters", "1000", "--lr-decay-iters",
                      "1000", "--eval-interval", "1000", "--save", save, "--save-interval",
                      "1", "--exit-signal-handler")]
        log = tmp_path / f"log{delay}.txt"
        proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO,
                                env=subprocess_env(OMP_NUM_THREADS="1"))
        jobs.append(dict(delay=delay, port=port, save=save, log=log, proc=proc, kill_at=None))
    try:
        end = time.monotonic() + 240
        while any(job["proc"].poll() is None for job in jobs):
            assert time.monotonic() < end, "a job did not end"
            for job in jobs:
                if job["kill_at"] is None and os.path.isdir(os.path.join(job["save"],
                                                                         "iter_0000003")):
                    job["kill_at"] = time.monotonic() + job["delay"]
                if job["kill_at"] is not None and time.monotonic() >= job["kill_at"]:
                    job["kill_at"] = float("inf")
                    for p in psutil.Process(job["proc"].pid).children(recursive=True):
                        if _is_rank_0(p):
                            p.send_signal(signal.SIGKILL)
                assert job["proc"].poll() is None or job["kill_at"] is not None, \
                    job["log"].read_text()[-3000:]
            time.sleep(0.002)
        end = time.monotonic() + 20
        while any(_of_job(job["port"]) for job in jobs) and time.monotonic() < end:
            time.sleep(0.2)
        left = [(job["delay"], p.pid, _said(p)) for job in jobs for p in _of_job(job["port"])]
        assert not left, f"alive 20 s after the job ended: {left}"
    finally:
        for job in jobs:
            for p in _of_job(job["port"]):
                p.kill()
            if job["proc"].poll() is None:
                job["proc"].kill()
