"""`megatron_eod.megatron.gloo_on_cuda`: the stand-ins for gloo on CUDA (the GPU tests'
processes sharing one GPU). Their CUDA side runs in tests/functional/test_gpu_training.py;
here, on CPU gloo under Megatron-LM's trainer, the stand-in for megatron-core's coalesced
gradient reduction is forced on and must train exactly as the real one, with the attention's
host staging on meanwhile."""

import pytest

from megatron_eod.attention import comm
from megatron_eod.megatron import gloo_on_cuda
from megatron_eod.megatron.imports import import_megatron
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import import_megatron_lm
from tests.training.runs import flags, metrics_records, start


def _train(rank, world, argv, stand_in):
    buffers = import_megatron("megatron.core.distributed.param_and_grad_buffer")
    calls, staged = [], []
    if stand_in:
        gloo_on_cuda.apply()

        def counted(*args, **kwargs):
            calls.append(kwargs.get("async_ops"))
            staged.append(comm._STAGING[0])
            return gloo_on_cuda.uncoalesced(*args, **kwargs)
        buffers._coalescing_manager = counted
    code, _ = start(rank, world, argv)
    return code, calls, staged


@pytest.mark.parametrize("extra", [["--context-parallel-size", "2"], []], ids=["cp2", "dp2"])
def test_gradients_reduced_bucket_by_bucket_train_as_coalesced(short_docs_data, tmp_path, extra):
    import_megatron_lm()
    losses = []
    for stand_in in (False, True):
        metrics = tmp_path / f"{stand_in}.jsonl"
        results = run_ranks(_train, 2, flags(short_docs_data, metrics, *extra, "--train-iters",
                                             "2"), stand_in, timeout=240, daemon=False)
        assert [code for code, _, _ in results] == [0, 0], results
        losses.append([r["lm_loss"] for r in metrics_records(metrics) if "kind" not in r])
        if stand_in:
            for _, calls, staged in results:  # used, synchronous, staging on
                assert calls and not any(calls) and all(staged)
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and len(losses[0]) == 2


def test_an_overlapped_reduction_is_refused():
    with pytest.raises(AssertionError, match="--overlap-grad-reduce"):
        with gloo_on_cuda.uncoalesced(None, async_ops=True):
            pass


@pytest.mark.parametrize("local_rank, count, expected", [(0, 1, 0), (1, 1, 0), (3, 2, 1),
                                                         (1, 2, 1), (5, 0, 5)])
def test_share_devices_maps_local_ranks_beyond_the_gpus(local_rank, count, expected):
    """Megatron-LM's start-up sets the device to args.local_rank: with two processes on one
    GPU rank 1 stopped at "invalid device ordinal" (2026-11-27 H200 lease)."""
    from types import SimpleNamespace
    args = SimpleNamespace(local_rank=local_rank)
    gloo_on_cuda.share_devices(args, count)
    assert args.local_rank == expected
