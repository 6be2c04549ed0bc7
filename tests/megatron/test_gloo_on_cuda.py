"""`megatron_eod.megatron.gloo_on_cuda`: the lean trainer's stand-ins for gloo on CUDA (the GPU
tests' processes sharing one GPU). Their CUDA side runs in tests/functional/test_gpu_training.py;
here, on CPU gloo, the stand-in for megatron-core's coalesced gradient reduction is forced on
and must train exactly as the real one, with the attention's host staging on meanwhile."""

import pytest

from megatron_eod.attention import comm
from megatron_eod.megatron import gloo_on_cuda
from megatron_eod.megatron.imports import import_megatron
from megatron_eod.training.pretrain import pretrain
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks


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
    original = buffers._coalescing_manager
    losses = pretrain(argv)
    restored = buffers._coalescing_manager is not original and not comm._STAGING[0]
    return losses, calls, staged, restored


@pytest.mark.parametrize("extra", [["--context-parallel-size", "2"],
                                   ["--use-distributed-optimizer"]], ids=["cp2", "distopt"])
def test_gradients_reduced_bucket_by_bucket_train_as_coalesced(tiny_data, extra):
    argv = tiny_flags(tiny_data, *extra, "--train-iters", "4")
    reference = [r[0] for r in run_ranks(_train, 2, argv, False)]
    results = run_ranks(_train, 2, argv, True)
    for (losses, calls, staged, restored), expected in zip(results, reference):
        assert losses == pytest.approx(expected, rel=1e-6)
        assert calls and not any(calls) and all(staged)  # used, synchronous, staging on
        assert restored  # shutdown put megatron-core's manager back and staging off


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
