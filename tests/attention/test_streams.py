"""attention/streams.py: `Beside` runs its work at once off CUDA or when disabled, and on a
GPU (marked) orders the side stream after the work queued before it and the current stream
after the side work, with no host sync (a sleep kernel ahead of each makes a missing wait
show as a wrong value)."""

import contextlib

import pytest
import torch

from megatron_eod.attention.streams import Beside, fork_point, side_stream


@pytest.mark.parametrize("enabled", [False, True])
def test_on_cpu_the_work_runs_at_once(enabled):
    calls = []
    side = Beside(lambda: calls.append(1) or torch.ones(2), torch.device("cpu"), enabled)
    assert calls == [1]
    assert torch.equal(side.result(), torch.ones(2))
    assert torch.equal(side.result(), torch.ones(2))  # joining twice is harmless


def test_off_cuda_there_is_no_fork_point_and_two_side_streams():
    assert fork_point(torch.device("cpu"), True) is None
    assert fork_point(torch.device("cuda"), False) is None
    with pytest.raises(ValueError, match="side stream 2"):
        side_stream(torch.device("cuda", 0), 2)


def _slow_side_work(x):
    torch.cuda._sleep(20_000_000)  # the side stream is busy before its results exist
    return x * 2, x + 1


@contextlib.contextmanager
def _gpu_without_host_syncs():
    """A CUDA device, with any host sync an error inside (`checked` lifts it to read)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield torch.device("cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _checked(condition):
    """Assert a device value (a host read, allowed here only)."""
    torch.cuda.set_sync_debug_mode("default")
    assert condition()
    torch.cuda.set_sync_debug_mode("error")


@pytest.mark.gpu
def test_on_gpu_both_waits_hold_without_host_syncs():
    with _gpu_without_host_syncs() as device:
        x = torch.zeros(1 << 20, device=device)
        for step in range(1, 6):
            torch.cuda._sleep(20_000_000)  # the current stream is busy ...
            x.fill_(step)  # ... before this write, which the side work must see
            side = Beside(lambda: _slow_side_work(x), device, True)
            assert side._stream is side_stream(device)
            doubled, plus_one = side.result()
            total = doubled + plus_one  # on the current stream, after the side work
            _checked(lambda: torch.all(total == 3 * step + 1).item())


@pytest.mark.gpu
def test_on_gpu_work_after_a_fork_point_waits_for_what_came_before_it_only():
    """Side stream 1 after a fork point sees the writes queued before it, and does not wait
    for the current stream's later work (the batched ring's second local part)."""
    with _gpu_without_host_syncs() as device:
        x = torch.zeros(1 << 20, device=device)
        for step in range(1, 4):
            torch.cuda._sleep(20_000_000)
            x.fill_(step)
            fork = fork_point(device, True)
            first = Beside(lambda: _slow_side_work(x), device, True, which=0)
            torch.cuda._sleep(200_000_000)  # later work on the current stream ...
            started = torch.cuda.Event(enable_timing=True)
            second = Beside(lambda: (started.record(), x * 3)[1], device, True, which=1,
                            after=fork)
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()  # ... ends well after this side work has started
            assert second._stream is side_stream(device, 1)
            tripled = second.result()
            doubled, plus_one = first.result()
            total = doubled + plus_one + tripled
            _checked(lambda: torch.all(total == 6 * step + 1).item())
            _checked(lambda: started.elapsed_time(ended) > 50)  # ms: during the long sleep
