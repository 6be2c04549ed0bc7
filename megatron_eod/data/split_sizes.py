"""Start-up check that every split the run draws samples from holds data in every dataset.

One job: megatron-core's GPTDataset cuts each dataset into train/valid/test by `--split`
(sequence ranges, rounded) and, asked for samples from a range with no sequence, searches for
its tokens forever (`GPTDataset._get_num_epochs`): every rank spins at 100% CPU with no
message. A small dataset in a blend (under ~500 sequences with the default 969,30,1) or a thin
share does it, even for a split asked for no samples (--eval-iters 0) or a dataset weighted
0. This names the dataset, the split and the fixes instead.

What it does not do: no check of blends per split (each takes its whole dataset, and an empty
dataset is refused by checks.py), none of object-storage or mock data.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

from megatron_eod.data.checks import DatasetError, sequence_count
from megatron_eod.megatron.imports import import_megatron

__all__ = ["check_split_sizes", "split_shares"]

_SPLITS = ("train", "validation", "test")


def split_shares(split: str) -> List[float]:
    """The train, valid, test shares of a --split string, read as megatron-core reads it (the
    numbers in it, missing ones 0), normalised to sum 1. ValueError naming --split and the
    rule where megatron-core would stop on a bare assertion (four numbers) or divide by zero
    (all 0)."""
    config = import_megatron("megatron.core.datasets.blended_megatron_dataset_config")
    try:  # asserts three numbers at most; "1.2.3" is a ValueError; all 0 gives NaN shares
        shares = [float(share) for share in config.parse_and_normalize_split(split)]
    except (AssertionError, ValueError, ZeroDivisionError):
        shares = []
    if not shares or not all(math.isfinite(share) for share in shares):
        raise ValueError(f"--split {split}: give up to three shares (train,valid,test, e.g. "
                         f"969,30,1; missing ones are 0), not all 0")
    return shares


def check_split_sizes(blend, split: Optional[str], sizes: Sequence[Optional[int]]) -> None:
    """`blend`: (prefixes, weights or None); `split`: the --split string; `sizes`: samples
    asked of each split (None: the whole split). DatasetError where a dataset has no sequence
    in a split with a share of --split: megatron-core builds every such split, even one asked
    for 0 samples or of a dataset weighted 0, and asks it for at least its one extra token."""
    if blend is None or split is None:
        return
    config = import_megatron("megatron.core.datasets.blended_megatron_dataset_config")
    remote = import_megatron("megatron.core.datasets.object_storage_utils")
    try:
        shares = split_shares(split)
    except ValueError as error:
        raise DatasetError(str(error)) from None
    ranges = config.convert_split_vector_to_split_matrix(shares)
    for prefix in blend[0]:
        if remote.is_object_storage_path(prefix):
            continue
        sequences = sequence_count(prefix)
        for name, size, share in zip(_SPLITS, sizes, ranges):
            if size is None or share is None:  # the whole split / no such split: no search
                continue
            first, end = (int(round(bound * sequences)) for bound in share)
            if end <= first:
                zero = ",".join("0" if i == _SPLITS.index(name) else "N" for i in range(3))
                raise DatasetError(
                    f"{prefix}: its {name} share of --split {split} "
                    f"({share[1] - share[0]:.4g}) holds none of its {sequences} sequences "
                    f"(megatron-core would search that split for tokens forever): give {name} "
                    f"a larger share of --split, or none at all (--split {zero}), or use a "
                    f"larger dataset")
