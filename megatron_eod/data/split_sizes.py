"""Start-up check that every split the run draws samples from holds data in every dataset.

One job: megatron-core's GPTDataset cuts each dataset into train/valid/test by `--split`
(sequence ranges, rounded) and, asked for samples from a range with no sequence, searches for
its tokens forever (`GPTDataset._get_num_epochs`): every rank spins at 100% CPU with no
message. A small dataset in a blend (under ~500 sequences with the default 969,30,1) or a thin
share does it. This names the dataset, the split and the fixes instead.

What it does not do: no check of blends per split (each takes its whole dataset, and an empty
dataset is refused by checks.py), none of object-storage or mock data.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_eod.data.checks import DatasetError, sequence_count
from megatron_eod.megatron.imports import import_megatron

__all__ = ["check_split_sizes"]

_SPLITS = ("train", "validation", "test")
_OBJECT_STORAGE = ("s3://", "msc://")


def check_split_sizes(blend, split: Optional[str], sizes: Sequence[Optional[int]]) -> None:
    """`blend`: (prefixes, weights or None); `split`: the --split string; `sizes`: samples
    asked of each split (None: the whole split). DatasetError where a dataset with a positive
    weight has no sequence in a split asked for samples."""
    if blend is None or split is None:
        return
    config = import_megatron("megatron.core.datasets.blended_megatron_dataset_config")
    ranges = config.convert_split_vector_to_split_matrix(config.parse_and_normalize_split(split))
    prefixes, weights = blend
    for k, prefix in enumerate(prefixes):
        if (weights is not None and weights[k] <= 0) or prefix.startswith(_OBJECT_STORAGE):
            continue
        sequences = sequence_count(prefix)
        for name, size, share in zip(_SPLITS, sizes, ranges):
            if not size or share is None:
                continue
            first, end = (int(round(bound * sequences)) for bound in share)
            if end <= first:
                raise DatasetError(
                    f"{prefix}: its {name} share of --split {split} "
                    f"({share[1] - share[0]:.4g}) holds none of its {sequences} sequences, but "
                    f"the run asks for {name} samples from it (megatron-core would search for "
                    f"them forever): give {name} a larger share of --split, take no {name} "
                    f"samples (--eval-iters 0 for validation and test), or blend in more data")
