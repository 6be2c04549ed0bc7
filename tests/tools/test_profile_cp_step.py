"""tools/profile_cp_step.py: the interval arithmetic it splits time with (a union, overlaps
counted once; attention told from glue by kernel name; the parts add up to the wall time),
and a small CPU run (the GPU session's `profile` stage relies on it) printing our layouts,
each forward alone and forward+backward."""

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
                          "--kv-heads", "2", "--head-dim", "16", "--repeats", "1",
                          "--only", "^(?!.*fused)"])  # Triton's interpreter: slow here
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ours")]
    layouts = ["| ours ring", "| ours ring (steps)", "| ours hybrid u=2",
               "| ours hybrid u=2 (steps)", "| ours ring (concurrent)",
               "| ours hybrid u=2 (concurrent)", "| ours ring (concurrent, split)",
               "| ours hybrid u=2 (concurrent, split)"]
    # Each layout's forward alone, then its forward+backward.
    assert [(r[0], r[1]) for r in rows] == [(layout, p) for layout in layouts
                                            for p in ("fwd", "fwd+bwd")]
    for cells in rows:
        wall = float(cells[2])
        parts = [float(c.split()[0]) for c in cells[3:6]]  # "10.441 (48%)"
        assert parts[0] > 0 and abs(sum(parts) - wall) < 0.01 * wall + 2e-3, cells
        attention, glue = (int(x) for x in cells[6].rstrip(" |").split(" / "))
        # forward: at least the local call; forward+backward: at least two calls more.
        assert attention >= (1 if cells[1] == "fwd" else 2) and glue > 0, cells
        assert cells[7].rstrip(" |") == "- / -"  # memory: CUDA only
    for fwd, both in zip(rows[::2], rows[1::2]):
        assert int(both[6].split(" / ")[0]) > int(fwd[6].split(" / ")[0]), (fwd, both)
    assert "ours ring, fwd: top glue kernels" in out
    assert "ours ring, fwd+bwd: top glue kernels" in out


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        profile_cp_step.main(["--mixes", "web,books"])
    assert "--mixes" in capsys.readouterr().err


@pytest.mark.gpu
def test_memory_counts_what_a_pass_holds_and_what_side_streams_keep():
    import torch

    device = torch.device("cuda")
    mib = 1 << 20
    peak, reserved = profile_cp_step.memory_mib(
        lambda: torch.empty(64 * mib, dtype=torch.uint8, device=device), device, 3)
    assert 64 <= peak < 65 and reserved >= peak, (peak, reserved)
    side = torch.cuda.Stream(device)

    def on_side_stream():  # freed on the side stream: cached in its pool, not reused here
        with torch.cuda.stream(side):
            torch.empty(64 * mib, dtype=torch.uint8, device=device)
        torch.empty(64 * mib, dtype=torch.uint8, device=device)

    peak, reserved = profile_cp_step.memory_mib(on_side_stream, device, 3)
    print(f"[figure] profile memory: one 64 MiB block per stream: peak {peak:.0f} MiB, "
          f"reserved {reserved:.0f} MiB")
    assert 64 <= peak < 65 and reserved >= 128, (peak, reserved)
    assert profile_cp_step.memory_mib(lambda: None, torch.device("cpu"), 1) is None


def test_only_profiles_the_layouts_it_names(monkeypatch, capsys):
    """--only as in tools/bench_cp_gpu.py: scripts/gpu_checks.sh's profile-open stage
    profiles the batched rows with and without --cp-concurrent-calls, not the steps rows."""
    reported = []
    monkeypatch.setattr(profile_cp_step, "profile_group", lambda sim, g, device, repeats: {})
    monkeypatch.setattr(profile_cp_step, "report",
                        lambda mix, n, cp, results, top: reported.append(list(results)))
    pattern = r"^ours (ring|hybrid u=2)( \(concurrent.*\))?$"
    profile_cp_step.main(["--configs", "2048:4", "--mixes", "web", "--heads", "4",
                          "--kv-heads", "2", "--head-dim", "16", "--repeats", "1",
                          "--only", pattern])
    assert reported == [["ours ring", "ours hybrid u=2", "ours ring (concurrent)",
                         "ours hybrid u=2 (concurrent)", "ours ring (concurrent, split)",
                         "ours hybrid u=2 (concurrent, split)"]]
    with pytest.raises(SystemExit):
        profile_cp_step.main(["--only", "one call"])  # not a profile layout
    assert "--only: 'one call' selects no layout" in capsys.readouterr().err
