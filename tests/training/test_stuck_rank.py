"""A rank that stops answering (SIGSTOP) ends the whole torchrun job within
--distributed-timeout-minutes, with a message saying a collective timed out, instead of
hanging forever.

The rank that waits gives up within the timeout and exits; torchrun then sends SIGTERM to the
rest. A stopped process holds SIGTERM until it is continued, so torchrun would SIGKILL it only
after its fixed 30 s grace: torchrun's time, not ours. The test continues the stopped rank once
the waiting one has exited (the pending SIGTERM or the closed peer then ends it) and checks
that the job ends soon after."""

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.functional.tiny_gpt import tiny_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_a_stopped_rank_ends_the_job_within_the_timeout(tiny_data, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(REPO, "pretrain_gpt.py"), "--trainer", "lean",
           *tiny_flags(tiny_data, "--context-parallel-size", "2", "--train-iters", "100000",
                       "--lr-decay-iters", "100000", "--eval-interval", "100000",
                       "--distributed-timeout-minutes", "0.2", "--metrics-file",
                       str(metrics))]
    log = open(tmp_path / "log.txt", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        end = time.monotonic() + 150
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, open(tmp_path / "log.txt").read()[-3000:]
            assert time.monotonic() < end, "training never started"
            time.sleep(0.2)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "pretrain_gpt.py" in " ".join(p.cmdline())]
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
    assert waited < 0.2 * 60 + 60, f"the waiting rank took {waited:.0f} s to give up"
    assert ended < 20, f"the job took {ended:.0f} s to end after the waiting rank gave up"
    assert "--distributed-timeout-minutes" in text, text[-3000:]



class _Leave(Exception):
    pass


def _train_until_rank_1_leaves(rank, world, argv):
    from megatron_eod.training import pretrain as module
    from tests.training.test_nan_stop import _train

    step = module._Trainer._train_step

    def leaves_at_iteration_3(self):
        if rank == 1 and self.iteration == 2:
            raise _Leave  # its process then ends, as a rank killed mid-run (an OOM kill)
        return step(self)

    module._Trainer._train_step = leaves_at_iteration_3
    try:
        return _train(rank, world, argv)
    except _Leave:
        return None


@pytest.mark.timeout(120)
def test_a_peer_that_stops_is_one_line_on_the_ranks_left(tiny_data):
    """gloo tells the ranks left at once ("Connection closed by peer"): one line saying a peer
    stopped, exit 1 (a traceback before: the timeout's line was for waits only)."""
    from tests.harness import run_ranks

    results = run_ranks(_train_until_rank_1_leaves, 2,
                        tiny_flags(tiny_data, "--context-parallel-size", "2"))
    code, text, _ = results[0]
    assert code == 1 and "Traceback" not in text, text[-3000:]
    assert "pretrain_gpt.py: error: rank 0: a peer rank closed its connection (it stopped: see " \
           "its own error) in " in text, text[-3000:]


def _megatron_lm_until_rank_1_leaves(rank, world, argv):
    from megatron_eod.training.megatron_lm import EodProviders
    from tests.training.test_megatron_lm_pretrain import _start

    step, calls = EodProviders.forward_step, []

    def leaves_at_its_fifth_micro_batch(self, *args, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) == 5:
            raise _Leave
        return step(self, *args, **kwargs)

    EodProviders.forward_step = leaves_at_its_fifth_micro_batch
    try:
        return _start(rank, world, argv)
    except _Leave:
        return None


@pytest.mark.timeout(240)
def test_megatron_lm_trainer_says_a_lost_peer_in_one_line(short_docs_data, tmp_path):
    """Its ranks left printed a ~40-line gloo traceback each (a helper's 2-node run)."""
    from tests.harness import run_ranks
    from tests.training.megatron_lm_checkout import import_megatron_lm
    from tests.training.test_megatron_lm_pretrain import flags

    import_megatron_lm()
    results = run_ranks(_megatron_lm_until_rank_1_leaves, 2,
                        flags(short_docs_data, str(tmp_path / "m.jsonl")), timeout=200,
                        daemon=False)
    code, text = results[0]
    assert code == 1 and "Traceback" not in text, text[-3000:]
    assert "pretrain_gpt.py: error: rank 0: a peer rank closed its connection" in text, \
        text[-3000:]


def test_a_rank_that_never_joins_is_one_line(tiny_data, monkeypatch, capsys):
    """A flag valid on some nodes only stops those ranks before the process group exists; the
    others waited in init_process_group and stopped with torch's DistStoreError or
    DistNetworkError traceback (a helper's two-node runs)."""
    import torch.distributed as dist

    from megatron_eod.training.pretrain import pretrain

    for raised in (dist.DistStoreError("wait timeout after 60000ms, keys: /default_pg/0//cpu//0/2"),
                   dist.DistNetworkError("Failed to recv, got 0 bytes")):
        def never_joined(*args, raised=raised, **kwargs):
            raise raised

        monkeypatch.setattr(dist, "init_process_group", never_joined)
        with pytest.raises(SystemExit) as stop:
            pretrain(tiny_flags(tiny_data, "--distributed-timeout-minutes", "1"))
        assert stop.value.code == 1
        said = capsys.readouterr().err
        assert said.startswith("pretrain_gpt.py: error: rank ?: ") and said.count("\n") == 1
        assert ("a collective waited longer than --distributed-timeout-minutes 1.0" in said
                if isinstance(raised, dist.DistStoreError) else
                "a peer rank closed its connection" in said), said


def test_a_peer_that_refuses_connections_is_not_called_a_timeout(tiny_data, monkeypatch, capsys):
    """After torchrun restarted the workers (a soak's --max-restarts run), gloo's mesh failed
    in seconds with `timed out connecting: SO_ERROR: Connection refused`, which was said as a
    wait past --distributed-timeout-minutes 10."""
    import torch.distributed as dist

    from megatron_eod.training.pretrain import pretrain

    def refused(*args, **kwargs):
        raise RuntimeError("Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:152]"
                           " timed out connecting: SO_ERROR: Connection refused, "
                           "remote=[127.0.0.1]:4520$3")

    monkeypatch.setattr(dist, "init_process_group", refused)
    with pytest.raises(SystemExit) as stop:
        pretrain(tiny_flags(tiny_data))
    assert stop.value.code == 1
    said = capsys.readouterr().err
    assert said.startswith("pretrain_gpt.py: error: rank ?: a peer rank could not be reached "
                           "(nothing listens at its address") and "waited longer" not in said, said
