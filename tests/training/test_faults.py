"""training/faults.py under Megatron-LM's trainer: a rank that stops answering, a peer that
leaves, a rank that never joins, a save that fails, and a result that fails Megatron-LM's
validation (a NaN loss or gradient) end every rank, each with one line, within the timeout.

The stopped rank: the rank that waits gives up within --distributed-timeout-minutes and exits;
torchrun then sends SIGTERM to the rest. A stopped process holds SIGTERM until it is
continued, so torchrun would SIGKILL it only after its fixed 30 s grace: torchrun's time, not
ours. The test continues the stopped rank once the waiting one has exited (the pending SIGTERM
or the closed peer then ends it) and checks that the job ends soon after.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.training.megatron_lm_checkout import import_megatron_lm, subprocess_env
from tests.training.runs import error_lines, flags, run_ranks, start

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The process group's timeout also bounds its forming: at 0.1 minutes, one rank's start-up
# (importing torch and Megatron-LM) lagging the other's by 6 s on a loaded machine (the suite
# in two workers beside another job) failed the connection before any step.
TIMEOUT = 0.25


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stopped_rank_ends_the_job_within_the_timeout(short_docs_data, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(REPO, "tests", "training", "short_timeout.py"),
           *flags(short_docs_data, metrics, "--context-parallel-size", "2", "--train-iters",
                  "100000", "--lr-decay-iters", "100000", "--eval-interval", "100000")]
    log = open(tmp_path / "log.txt", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env=subprocess_env(OMP_NUM_THREADS="1",
                                               EOD_TEST_TIMEOUT_MINUTES=str(TIMEOUT)))
    try:
        end = time.monotonic() + 150
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, open(tmp_path / "log.txt").read()[-3000:]
            assert time.monotonic() < end, "training never started"
            time.sleep(0.2)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "short_timeout.py" in " ".join(p.cmdline())]
        assert len(workers) == 2
        stopped = time.monotonic()
        os.kill(workers[0].pid, signal.SIGSTOP)
        workers[1].wait(timeout=120)
        waited = time.monotonic() - stopped
        os.kill(workers[0].pid, signal.SIGCONT)
        proc.wait(timeout=60)
        ended = time.monotonic() - stopped - waited
    finally:
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
    log.seek(0)
    text = log.read()
    assert proc.returncode != 0
    assert waited < TIMEOUT * 60 + 60, f"the waiting rank took {waited:.0f} s to give up"
    assert ended < 20, f"the job took {ended:.0f} s to end after the waiting rank gave up"
    assert f"a collective waited longer than --distributed-timeout-minutes {TIMEOUT}" in text, \
        text[-3000:]


class _Leave(Exception):
    pass


def _until_rank_1_leaves(rank, world, argv):
    from megatron_eod.training.providers import EodProviders

    step, calls = EodProviders.forward_step, []

    def leaves_at_its_fifth_micro_batch(self, *args, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) == 5:
            raise _Leave  # its process then ends, as a rank killed mid-run (an OOM kill)
        return step(self, *args, **kwargs)

    EodProviders.forward_step = leaves_at_its_fifth_micro_batch
    try:
        return start(rank, world, argv)
    except _Leave:
        return None


@pytest.mark.timeout(240)
def test_a_peer_that_stops_is_one_line_on_the_ranks_left(short_docs_data, tmp_path):
    """gloo tells the ranks left at once ("Connection closed by peer"): one line saying a
    peer stopped, exit 1 (each printed a ~40-line gloo traceback: a helper's 2-node run)."""
    import_megatron_lm()
    results = run_ranks(_until_rank_1_leaves, 2, flags(short_docs_data, tmp_path / "m.jsonl"),
                        timeout=200, daemon=False)
    code, text = results[0]
    assert code == 1 and "Traceback" not in text, text[-3000:]
    assert "pretrain_gpt.py: error: rank 0: a peer rank closed its connection (it stopped: see " \
           "its own error) in " in text, text[-3000:]


def _with_process_group_failing(rank, world, argv, raised):
    import torch.distributed as dist

    def init_process_group(*args, **kwargs):
        raise raised

    dist.destroy_process_group()  # the harness's: Megatron-LM makes its own
    dist.init_process_group = init_process_group
    return start(rank, world, argv)


@pytest.mark.parametrize("raised,said", [
    ("store", "a collective waited longer than --distributed-timeout-minutes 1 (a rank "
              "stopped answering"),
    ("network", "a peer rank closed its connection"),
    ("refused", "a peer rank could not be reached (nothing listens at its address"),
], ids=["never-joined", "lost-at-start", "connection-refused"])
def test_a_process_group_that_cannot_form_is_one_line(short_docs_data, tmp_path, raised, said):
    """A flag valid on some nodes only stops those ranks before the process group exists; the
    others waited in init_process_group and stopped with torch's DistStoreError or
    DistNetworkError traceback (a helper's two-node runs). After torchrun restarted the
    workers (a soak's --max-restarts run), gloo's mesh failed in seconds with "timed out
    connecting: SO_ERROR: Connection refused", which was said as a timeout."""
    import torch.distributed as dist

    import_megatron_lm()
    error = {"store": dist.DistStoreError("wait timeout after 60000ms, keys: "
                                         "/default_pg/0//cpu//0/2"),
             "network": dist.DistNetworkError("Failed to recv, got 0 bytes"),
             "refused": RuntimeError("Gloo connectFullMesh failed with [../gloo/transport/tcp/"
                                     "pair.cc:152] timed out connecting: SO_ERROR: Connection "
                                     "refused, remote=[127.0.0.1]:4520$3")}[raised]
    (code, text), = run_ranks(_with_process_group_failing, 1,
                              flags(short_docs_data, None, "--distributed-timeout-minutes", "1"),
                              error, timeout=120, daemon=False)
    assert code == 1 and "Traceback" not in text, text[-3000:]
    lines = error_lines([(code, text)])[0]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: rank ") \
        and said in lines[0], text[-3000:]


# --lr 1e3 in float32: the loss or gradients go non-finite within a few iterations.
DIVERGE = ["--lr", "1e3", "--clip-grad", "0", "--context-parallel-size", "2", "--train-iters",
           "10", "--lr-decay-iters", "10"]


def test_a_non_finite_result_under_megatron_lms_rerun_machine(short_docs_data, tmp_path):
    """--check-for-nan-in-loss-and-grad (on by default) under --rerun-mode validate_results
    (the default): the rerun machine reruns the iteration in place and, the NaN reproduced,
    saves a checkpoint and exits 16 for a rerun on other GPUs, said in one line on every rank;
    without --save (a TypeError in its save on every rank) one line and exit 17."""
    import_megatron_lm()
    save = tmp_path / "ckpt"
    results = run_ranks(start, 2, flags(short_docs_data, None, *DIVERGE, "--save", str(save)),
                        timeout=240, daemon=False)
    assert [code for code, _ in results] == [16, 16], results
    for _, text in results:
        assert "saved a checkpoint at --save: resume the job from it" in text and \
            "exits 16" in text \
            and "Traceback" not in text, text[-3000:]
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())  # the one before
    assert f": iteration {saved + 1}: a result failed validation" in results[0][1]
    results = run_ranks(start, 2, flags(short_docs_data, None, *DIVERGE), timeout=240,
                        daemon=False)
    assert [code for code, _ in results] == [17, 17], results
    for _, text in results:
        assert "but no --save is given: stopping" in text and "Traceback" not in text, \
            text[-3000:]


def test_a_transient_fault_replays_the_iteration_with_its_plans(short_docs_data, tmp_path):
    """Megatron-LM's fault injection (--error-injection-type transient_error): a result fails
    validation, the rerun machine replays the iteration in place (its micro-batches planned
    ahead, replayed with the plans they had: plan_ahead.py), the rerun gives another result
    (a transient fault) and every rank exits 17 with one line."""
    import_megatron_lm()
    results = run_ranks(start, 2, flags(short_docs_data, None, "--context-parallel-size", "2",
                                         "--error-injection-rate", "3",
                                         "--error-injection-type", "transient_error"),
                        timeout=240, daemon=False)
    assert [code for code, _ in results] == [17, 17], results
    for _, text in results:
        assert "gave another result when rerun in place (a transient fault" in text and \
            "Traceback" not in text, text[-3000:]


def test_a_non_finite_result_without_reruns_and_the_check_turned_off(short_docs_data, tmp_path):
    """--rerun-mode disabled: Megatron-LM's RuntimeError on every rank becomes one line, exit
    1; --no-check-for-nan-in-loss-and-grad trains on."""
    import_megatron_lm()
    results = run_ranks(start, 2, flags(short_docs_data, None, *DIVERGE, "--rerun-mode",
                                         "disabled"), timeout=240, daemon=False)
    assert [code for code, _ in results] == [1, 1], results
    for lines, (_, text) in zip(error_lines(results), results):
        assert len(lines) == 1 and "Unexpected result" in lines[0] and \
            "--no-check-for-nan-in-loss-and-grad trains on" in lines[0], text[-3000:]
    results = run_ranks(start, 2, flags(short_docs_data, None, *DIVERGE,
                                         "--no-check-for-nan-in-loss-and-grad"),
                        timeout=240, daemon=False)
    assert [code for code, _ in results] == [0, 0], results


def _save_fails_on_rank_0(rank, world, argv):
    """`start`, with megatron-core's save of iteration 4 raising a full disk's OSError on
    rank 0 (the save of iteration 2 goes through)."""
    from megatron.core import dist_checkpointing

    save = dist_checkpointing.save

    def full_disk(state_dict, checkpoint_dir, *args, **kwargs):
        if rank == 0 and "iter_0000004" in str(checkpoint_dir):
            raise OSError(28, "No space left on device")
        return save(state_dict, checkpoint_dir, *args, **kwargs)

    dist_checkpointing.save = full_disk
    return start(rank, world, argv)


@pytest.mark.timeout(200)
def test_a_failed_save_is_one_line_and_ends_the_job(short_docs_data, tmp_path):
    """Megatron-LM gave a traceback on the failing rank. One line now, naming --save, the
    error and the room there (training/checkpoint_save.py); its peer ends on the closed
    connection; the tracker stays on the last complete checkpoint. (A real full disk:
    tests/functional/test_checkpoint_faults.py.)"""
    import_megatron_lm()
    save = str(tmp_path / "ckpt")
    started = time.monotonic()
    results = run_ranks(_save_fails_on_rank_0, 2,
                        flags(short_docs_data, None, "--save", save, "--save-interval", "2"),
                        timeout=180, daemon=False)
    assert time.monotonic() - started < 120
    (code0, err0), (code1, _) = results
    assert (code0, code1 != 0) == (2, True), results
    lines = error_lines(results)
    assert len(lines[0]) == 1 and "Traceback" not in err0, err0[-3000:]
    assert lines[0][0].startswith(
        f"pretrain_gpt.py: error: --save {save}: rank 0: the checkpoint of iteration 4 could "
        f"not be written (OSError: No space left on device); "), lines[0][0]
    assert re.search(r" was free there before it, [\d.]+ MiB needed \(the size of the last "
                     r"checkpoint, iteration 2\), the last checkpoint \(iteration 2, which the "
                     r"tracker still names\) takes [\d.]+ MiB; ", lines[0][0]) and \
        lines[0][0].endswith(
               "; its unfinished folder is removed: free space there or give another --save, "
               "then resume"), lines[0][0]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "2"
