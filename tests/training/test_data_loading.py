"""`training/data.py`'s MicroBatches: Megatron's sample order per DP rank, read by a
DataLoader whose --num-workers worker processes really do the reading, resumable from a
sample count, and a clear error past a non-cyclic dataset's end."""

import pytest
import torch

from megatron_eod.training.data import MicroBatches


class Numbered(torch.utils.data.Dataset):
    """Sample i is i; `worker` says which DataLoader worker read it (-1: the main process)."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        value = torch.tensor([i])
        return {"tokens": value, "labels": value, "loss_mask": value,
                "position_ids": torch.tensor([-1 if info is None else info.id])}


def take(batches, n):
    out = [next(batches) for _ in range(n)]
    return [b["tokens"].flatten().tolist() for b in out], [b["position_ids"].flatten().tolist()
                                                           for b in out]


@pytest.mark.parametrize("workers", [0, 2])
def test_megatron_order_per_dp_rank(workers):
    # DP=2, micro-batch 2: micro-batch j covers samples [4j, 4j+4), rank 1 takes the second half.
    rank1 = MicroBatches(Numbered(), 2, 1, 2, num_workers=workers)
    samples, readers = take(rank1, 3)
    assert samples == [[2, 3], [6, 7], [10, 11]]
    assert rank1.consumed_samples == 12
    if workers:
        assert {r for rs in readers for r in rs} <= {0, 1} and readers[0] != readers[1]
    else:
        assert readers == [[-1, -1]] * 3


def test_resumes_from_consumed_samples_and_stops_at_the_end():
    batches = MicroBatches(Numbered(), 2, 0, 2, consumed_samples=12, num_workers=2)
    samples, _ = take(batches, 2)
    assert samples == [[12, 13], [16, 17]]
    with pytest.raises(RuntimeError, match="the train dataset has 20 samples; the run asked "
                                           "for sample 21"):
        next(batches)


def test_cyclic_wraps():
    samples, _ = take(MicroBatches(Numbered(), 3, 0, 1, consumed_samples=18, cyclic=True,
                                   name="valid"), 2)
    assert samples == [[18, 19, 0], [1, 2, 3]]


def test_training_with_workers_is_training_without(tiny_data):
    from tests.functional.test_cpu_training import train

    with_workers = train(2, tiny_data, "--context-parallel-size", "2", "--num-workers", "2")
    assert with_workers == train(2, tiny_data, "--context-parallel-size", "2")


def test_a_run_that_ends_where_its_data_ends_finishes(short_docs_data):
    """A weighted blend has exactly the samples the run asks for, so reading one micro-batch
    ahead (plan-ahead, the default) reads past its end on the last step: that read's error
    counts only if the step asks for it (it crashed the last iteration). TP=2: the peer
    learns of the failed read from the source's header."""
    from tests.functional.test_cpu_training import ITERS, train

    blend = ("--data-path", "0.3", short_docs_data, "0.7", short_docs_data)
    for world, extra in ((1, ()), (2, ("--tensor-model-parallel-size", "2",
                                       "--make-vocab-size-divisible-by", "64"))):
        losses = train(world, short_docs_data, *blend, *extra, drop=("--data-path",))
        assert len(losses) == ITERS
