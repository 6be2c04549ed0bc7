"""tools/bench_e2e.py end to end on CPU with the tiny preset: both runs train through
torchrun and Megatron-LM's trainer, a causal row computes s(s+1)/2 pairs, EoD reset fewer,
and throughput is reported."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import bench_e2e  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_tiny_eod_and_causal_runs(tmp_path, capsys):
    rows = bench_e2e.main(["--preset", "tiny", "--seq-length", "1024", "--iters", "2",
                           "--warmup", "0", "--work-dir", str(tmp_path)])  # (the web mix's
    # second 1024-token row is one document: the median over both rows has EoDs)
    causal, eod = rows
    assert causal["pairs_per_row"] == 1024 * 1025 / 2
    assert eod["pairs_per_row"] < causal["pairs_per_row"]
    assert causal["tokens_per_s_per_gpu"] > 0 and eod["model_tflops_per_gpu"] > 0
    assert "EoD reset / causal tokens/s" in capsys.readouterr().out


@pytest.mark.parametrize("argv,said", [
    (["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
    (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["--iters", "-1", "--warmup", "-5"], "--iters must be >= 1, got -1"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
])
def test_bad_sizes_are_named_before_anything_runs(tmp_path, capsys, argv, said):
    """(Each started the training runs and failed inside them: a tools sweep.)"""
    with pytest.raises(SystemExit) as stop:
        bench_e2e.main([*argv, "--work-dir", str(tmp_path)])
    assert stop.value.code == 2 and said in capsys.readouterr().err
