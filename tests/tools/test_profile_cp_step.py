"""tools/profile_cp_step.py: the interval arithmetic it splits time with (a union, overlaps
counted once; attention told from glue by kernel name; the parts add up to the wall time),
and a small CPU run (the GPU session's `profile` stage relies on it) printing our four layouts."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import profile_cp_step  # noqa: E402


def test_busy_time_is_the_union_of_intervals():
    assert profile_cp_step.busy_us([]) == 0
    intervals = [("a", 0, 10), ("b", 5, 12), ("c", 20, 25), ("d", 21, 22), ("e", 12, 13)]
    assert profile_cp_step.busy_us(intervals) == 13 + 5


def test_split_tells_attention_from_glue_and_adds_up_to_the_wall():
    intervals = [("flash_fwd_kernel", 0, 400), ("triton_poi_fused_merge_0", 400, 450),
                 ("void at::native::index_elementwise_kernel", 450, 470),
                 ("pytorch_fmha::bwd", 500, 900), ("triton_poi_fused_merge_0", 900, 960)]
    split, by_name = profile_cp_step.split_time(intervals, wall_s=1e-3)
    assert abs(split["attention"] - 800e-6) < 1e-12 and abs(split["glue"] - 130e-6) < 1e-12
    assert abs(split["attention"] + split["glue"] + split["idle"] - 1e-3) < 1e-12
    assert by_name["triton_poi_fused_merge_0"][0] == 2
    assert abs(by_name["triton_poi_fused_merge_0"][1] - 110e-6) < 1e-12
    # A profile slower than the timed wall never gives negative idle time.
    assert profile_cp_step.split_time(intervals, wall_s=1e-4)[0]["idle"] == 0


def test_small_cpu_run_prints_our_layouts(capsys):
    profile_cp_step.main(["--configs", "2048:4", "--mixes", "web", "--heads", "4",
                          "--kv-heads", "2", "--head-dim", "16", "--repeats", "1"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ours")]
    assert [r[0] for r in rows] == ["| ours ring", "| ours ring (steps)", "| ours hybrid u=2",
                                    "| ours hybrid u=2 (steps)", "| ours ring (concurrent)",
                                    "| ours hybrid u=2 (concurrent)",
                                    "| ours ring (concurrent, split)",
                                    "| ours hybrid u=2 (concurrent, split)"]
    for cells in rows:
        wall = float(cells[1])
        parts = [float(c.split()[0]) for c in cells[2:5]]  # "10.441 (48%)"
        assert parts[0] > 0 and abs(sum(parts) - wall) < 0.01 * wall + 2e-3, cells
        attention, glue = (int(x) for x in cells[5].rstrip(" |").split(" / "))
        assert attention >= 2 and glue > 0
    assert "top glue kernels" in out


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        profile_cp_step.main(["--mixes", "web,books"])
    assert "--mixes" in capsys.readouterr().err
