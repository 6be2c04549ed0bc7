"""Datasets and micro-batch iterators for the trainer, in Megatron's sample order.

One job: build the train/valid/test GPTDatasets on the ranks that read data (TP rank 0 of
every pipeline stage) with Megatron's sizes (--train-samples, or --train-iters x global
batch), and iterate them the way Megatron's pretraining sampler does: micro-batch j of the run
covers global samples [j*mbs*dp, (j+1)*mbs*dp) and DP rank d takes its `mbs` consecutive
samples at offset d*mbs, read by a DataLoader with --num-workers workers. The iterator's
position is the number of samples consumed, which checkpoints save, so a resumed run reads
exactly the micro-batches an uninterrupted run would.

What it does not do: no CP slicing or TP broadcast (megatron/steps.py).
"""

from __future__ import annotations

import torch

from megatron_eod.data.tokenizers import build_tokenizer
from megatron_eod.training import eod_wiring as wiring

__all__ = ["MicroBatches", "build_tokenizer_from_args", "build_datasets", "dataset_sizes"]

_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class _MicroBatchIndices:
    """Batch sampler: each item is one micro-batch's dataset indices, in Megatron's order from
    `consumed_samples` on; a non-cyclic one stops at the dataset's end."""

    def __init__(self, size, micro_batch_size, dp_rank, dp_size, consumed_samples, cyclic):
        self.size, self.mbs, self.dp_rank, self.dp_size = size, micro_batch_size, dp_rank, dp_size
        self.consumed_samples, self.cyclic = consumed_samples, cyclic

    def __iter__(self):
        consumed = self.consumed_samples
        while True:
            first = consumed + self.dp_rank * self.mbs
            if first + self.mbs > self.size and not self.cyclic:
                return
            yield [(first + i) % self.size for i in range(self.mbs)]
            consumed += self.mbs * self.dp_size


def _stack(samples):
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in _KEYS}


class MicroBatches:
    """This DP rank's micro-batches, read by a torch DataLoader (--num-workers worker
    processes, as Megatron-LM's loader; 0 reads in this process). `consumed_samples` counts
    what was handed out, not what the workers prefetched, so a checkpoint resumes exactly."""

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0, name: str = "train", cyclic: bool = False,
                 num_workers: int = 0):
        self.dataset, self.mbs, self.dp_rank, self.dp_size = dataset, micro_batch_size, dp_rank, dp_size
        self.consumed_samples, self.name, self.cyclic = consumed_samples, name, cyclic
        self.num_workers, self._batches = num_workers, None

    def __iter__(self):
        return self

    def __next__(self):
        if self._batches is None:
            indices = _MicroBatchIndices(len(self.dataset), self.mbs, self.dp_rank,
                                         self.dp_size, self.consumed_samples, self.cyclic)
            # A generator of its own: the loader draws its workers' base seed when its
            # iterator is made, here at the first read, which in a resumed run comes after
            # the checkpoint's RNG state was restored; from torch's global generator that
            # draw would shift every later dropout mask against the uninterrupted run.
            self._batches = iter(torch.utils.data.DataLoader(
                self.dataset, batch_sampler=indices, num_workers=self.num_workers,
                collate_fn=_stack, pin_memory=torch.cuda.is_available(),
                persistent_workers=self.num_workers > 0,
                generator=torch.Generator().manual_seed(0)))
        try:
            batch = next(self._batches)
        except StopIteration:
            last = self.consumed_samples + self.dp_rank * self.mbs + self.mbs - 1
            raise RuntimeError(f"the {self.name} dataset has {len(self.dataset)} samples; the "
                               f"run asked for sample {last} (raise the split's share or "
                               f"lower --train-iters/--eval-iters)") from None
        self.consumed_samples += self.mbs * self.dp_size
        return batch


def build_tokenizer_from_args(args):
    return build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                           vocab_file=args.vocab_file, merge_file=args.merge_file,
                           vocab_size=args.vocab_size, tiktoken_pattern=args.tiktoken_pattern,
                           tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                           tiktoken_special_tokens=args.tiktoken_special_tokens)


def dataset_sizes(args):
    """Megatron's sample counts: train, valid (every eval), test."""
    gbs = args.global_batch_size
    evals = args.train_iters // args.eval_interval + 1
    train = args.train_samples if args.train_samples is not None else args.train_iters * gbs
    return [train, evals * args.eval_iters * gbs, args.eval_iters * gbs]


def build_datasets(args, tokenizer):
    return wiring.datasets(args, tokenizer, dataset_sizes(args))
