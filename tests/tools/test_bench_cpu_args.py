"""tools/bench_cp.py and tools/bench_plan.py: a size they cannot run is one line naming the
flag, before any worker starts (before: --wall-tokens 0 and --trainer-seq -4 passed the
divisibility check and failed inside the benchmark's worker runs)."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import bench_cp  # noqa: E402
import bench_plan  # noqa: E402


@pytest.mark.parametrize("tool,argv,message", [
    (bench_cp, ["--wall-tokens", "0"], "--wall-tokens must be a positive multiple of 4, got 0"),
    (bench_cp, ["--wall-tokens", "-8"], "--wall-tokens must be a positive multiple of 4"),
    (bench_cp, ["--wall-tokens", "6"], "--wall-tokens must be a positive multiple of 4"),
    (bench_cp, ["--samples", "0"], "--samples must be >= 1, got 0"),
    (bench_plan, ["--trainer-seq", "-4"], "--trainer-seq must be a positive multiple of 4"),
    (bench_plan, ["--trainer-seq", "0"], "--trainer-seq must be a positive multiple of 4"),
    (bench_plan, ["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (bench_plan, ["--trainer-iters", "1"], "--trainer-iters must be >= 2, got 1"),
])
def test_a_size_it_cannot_run_names_the_flag(capsys, monkeypatch, tool, argv, message):
    def never(*args, **kwargs):
        raise AssertionError("the benchmark started")

    for name in ("bench_layouts", "bench_wallclock", "bench_host", "bench_trainer"):
        if hasattr(tool, name):
            monkeypatch.setattr(tool, name, never)
    with pytest.raises(SystemExit) as stop:
        tool.main(argv)
    assert stop.value.code == 2 and re.search(re.escape(message), capsys.readouterr().err)


@pytest.mark.parametrize("tool,argv,started", [
    (bench_cp, ["--wall-tokens", "4", "--samples", "1"], ("bench_wallclock", 4)),
    (bench_plan, ["--trainer-seq", "4", "--repeats", "1", "--trainer-iters", "2"],
     ("bench_trainer", 4)),
])
def test_the_smallest_sizes_start_the_benchmark(monkeypatch, tool, argv, started):
    calls = []
    for name in ("bench_layouts", "bench_wallclock", "bench_host", "bench_trainer"):
        if hasattr(tool, name):
            monkeypatch.setattr(tool, name, lambda *a, name=name: calls.append((name, a[0])))
    tool.main(argv)
    assert started in calls
