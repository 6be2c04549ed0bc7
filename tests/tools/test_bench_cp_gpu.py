"""tools/bench_cp_gpu.py runs on the CPU at a small size (the GPU session relies on it): every
mix prints the seven layouts with forward, backward and both, and the ideal row is 1.00."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import bench_cp_gpu  # noqa: E402


def test_small_cpu_run_prints_every_layout_fwd_bwd(capsys):
    bench_cp_gpu.main(["--samples", "1", "--repeats", "1", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "16", "--configs", "2048:4"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ")
            and not line.startswith("| layout")]
    assert [r[0] for r in rows] == ["| " + name for name in (
        "ideal", "ours ring", "ours ring (steps)", "ours hybrid u=2", "ours hybrid u=2 (steps)",
        "contiguous", "doc-zigzag (padded)")] * 2
    for cells in rows:
        fwd, bwd, both = (float(x) for x in cells[1].split(" / "))
        assert fwd > 0 and bwd > 0 and abs(fwd + bwd - both) < 2e-3
    assert all(r[2] == "1.00 / 1.00 / 1.00" for r in rows if r[0] == "| ideal")
