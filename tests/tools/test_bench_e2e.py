"""tools/bench_e2e.py end to end on CPU with the tiny preset: both runs train through
torchrun, a causal row computes s(s+1)/2 pairs, EoD reset fewer, and throughput is reported."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import bench_e2e  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_tiny_eod_and_causal_runs(tmp_path, capsys):
    rows = bench_e2e.main(["--preset", "tiny", "--seq-length", "2048", "--iters", "3",
                           "--warmup", "1", "--work-dir", str(tmp_path)])
    causal, eod = rows
    assert causal["pairs_per_row"] == pytest.approx(2048 * 2049 / 2, rel=1e-6)
    assert eod["pairs_per_row"] < causal["pairs_per_row"]
    assert causal["tokens_per_s_per_gpu"] > 0 and eod["model_tflops_per_gpu"] > 0
    assert "EoD reset / causal tokens/s" in capsys.readouterr().out
