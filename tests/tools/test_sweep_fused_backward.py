"""tools/sweep_fused_backward.py on the CPU through Triton's interpreter (a GPU lease relies
on it): every shape's row, its kernels timed apart, the fused gradients equal to PyTorch's, a
failing shape NaN with the others kept, and bad shapes named."""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import sweep_fused_backward  # noqa: E402

SMALL = ["--configs", "128:2", "--mixes", "web", "--heads", "2", "--kv-heads", "1",
         "--head-dim", "16", "--repeats", "1", "--tile-rows", "32"]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused kernels on a CPU need Triton's interpreter")
def test_every_shape_is_timed_and_checked_and_a_failing_one_is_nan(capsys, monkeypatch):
    from megatron_eod.attention import triton_backward

    launch = triton_backward.tile_dkdv

    def fails_at_dkdv_warps_2(*args, **kwargs):
        if triton_backward._blocks(16)[4] == 2:
            raise RuntimeError("out of resources (a stand-in)")
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_backward, "tile_dkdv", fails_at_dkdv_warps_2)
    table = sweep_fused_backward.main(["--shapes", "32:16:8:3:2,16:32:4:2@32,atomic:16:4:2"]
                                      + SMALL)
    cells = table["web 128"]
    assert list(cells) == ["PyTorch", "32:16:8:3:2", "16:32:4:2@32", "atomic:16:4:2"]
    for label in ("16:32:4:2@32", "atomic:16:4:2"):
        assert cells[label][2] < 1e-5, (label, cells[label])  # float32: exact to rounding
        assert all(math.isfinite(x) for x in cells[label])
    assert all(math.isnan(x) for x in cells["32:16:8:3:2"])
    # no dq kernel ran for the atomic shape; the others' dq column is timed (on a loaded CPU,
    # through the interpreter, a difference of clocks that may come out below 0)
    assert cells["atomic:16:4:2"][3] == 0 != cells["16:32:4:2@32"][3]
    # restored after the sweep
    assert triton_backward.BACKWARD_OVERRIDE is None and not triton_backward.ATOMIC_DQ
    captured = capsys.readouterr()
    assert "[sweep] 32:16:8:3:2 failed" in captured.err
    assert "| 16:32:4:2@32 | " in captured.out
    assert "[sweep] web 128 | 16:32:4:2@32 | backward " in captured.out  # as the mix ends
    kernels = captured.out.split("dq / dk/dv / delta")[1]  # the second table: no PyTorch row
    assert "| 16:32:4:2@32 | " in kernels and "| PyTorch |" not in kernels
    assert "[sweep] best by the device-only clock (mean over the mixes): " in captured.out
    best = captured.out.split("[sweep] best by the wall clock (mean over the mixes): ")[1]
    assert best.split(",")[0] in ("16:32:4:2@32", "atomic:16:4:2")  # not NaN's


def test_the_best_shape_skips_failed_and_wrong_ones():
    nan = float("nan")
    table = {"a": {"x": (0.5, 0.5, 0.2), "y": (0.9, 1.2, 0.0), "z": (nan, nan, nan),
                   "w": (1.0, 0.8, 0.0)},
             "b": {"x": (0.5, 0.5, 0.0), "y": (0.9, 1.0, 0.0), "z": (0.1, 0.1, 0.0),
                   "w": (1.0, 0.8, 0.0)}}
    assert sweep_fused_backward.best_shape(table, 0) == ("y", 0.9)  # x wrong, z failed in a
    assert sweep_fused_backward.best_shape(table, 1) == ("w", 0.8)
    assert sweep_fused_backward.best_shape({"a": {"z": (nan, nan, nan)}}, 0) is None


@pytest.mark.parametrize("shapes,message", [
    ("32:32:8", "--shapes: DQ_BLOCK_N:DKDV_BLOCK_M:WARPS:STAGES[:DKDV_WARPS]"),
    ("32:32:8:2@48", "--shapes 32:32:8:2@48: KEYS after @ must be a power of two >= 16"),
    ("32:24:8:2", "the blocks powers of two >= 16"),
    ("atomic:32:8", "--shapes: atomic:DKDV_BLOCK_M:WARPS:STAGES[:DKDV_WARPS] (e.g. "
                    "atomic:32:8:2), got 'atomic:32:8'"),
    ("atomic:24:8:2", "--shapes atomic:24:8:2: the blocks powers of two >= 16"),
])
def test_bad_shapes_name_the_flag(capsys, shapes, message):
    with pytest.raises(SystemExit):
        sweep_fused_backward.main(["--shapes", shapes] + SMALL)
    assert message in capsys.readouterr().err
