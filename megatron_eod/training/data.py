"""Datasets and micro-batch iterators for the trainer, in Megatron's sample order.

One job: build the train/valid/test GPTDatasets on the ranks that read data (TP rank 0 of
every pipeline stage) with Megatron's sizes, and iterate them the way Megatron's pretraining
sampler does: micro-batch j of the run covers global samples [j*mbs*dp, (j+1)*mbs*dp) and DP
rank d takes its `mbs` consecutive samples at offset d*mbs. The iterator's position is the
number of samples consumed, which checkpoints save, so a resumed run reads exactly the
micro-batches an uninterrupted run would.

What it does not do: no CP slicing or TP broadcast (megatron/steps.py).
"""

from __future__ import annotations

import torch

from megatron_eod.data.tokenizers import build_tokenizer
from megatron_eod.training import eod_wiring as wiring

__all__ = ["MicroBatches", "build_tokenizer_from_args", "build_datasets", "dataset_sizes"]

_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class MicroBatches:
    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0, name: str = "train", cyclic: bool = False):
        self.dataset, self.mbs, self.dp_rank, self.dp_size = dataset, micro_batch_size, dp_rank, dp_size
        self.consumed_samples, self.name, self.cyclic = consumed_samples, name, cyclic

    def __iter__(self):
        return self

    def __next__(self):
        first = self.consumed_samples + self.dp_rank * self.mbs
        size = len(self.dataset)
        if first + self.mbs > size and not self.cyclic:
            raise RuntimeError(f"the {self.name} dataset has {size} samples; the run asked for "
                               f"sample {first + self.mbs - 1} (raise the split's share or "
                               f"lower --train-iters/--eval-iters)")
        samples = [self.dataset[(first + i) % size] for i in range(self.mbs)]
        self.consumed_samples += self.mbs * self.dp_size
        return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in _KEYS}


def build_tokenizer_from_args(args):
    return build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                           vocab_file=args.vocab_file, merge_file=args.merge_file,
                           vocab_size=args.vocab_size)


def dataset_sizes(args):
    """Megatron's sample counts: train, valid (every eval), test."""
    gbs = args.global_batch_size
    evals = args.train_iters // args.eval_interval + 1
    train = args.train_samples if args.train_samples is not None else args.train_iters * gbs
    return [train, evals * args.eval_iters * gbs, args.eval_iters * gbs]


def build_datasets(args, tokenizer):
    return wiring.datasets(args, tokenizer, dataset_sizes(args))
