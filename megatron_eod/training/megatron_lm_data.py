"""Megatron-LM's data flags for the EoD providers: the data sources and dataset-builder
settings its own pretrain_gpt.py reads, so that a launch script's data flags mean under our
providers what they mean under Megatron-LM's.

One job: from Megatron-LM's parsed args, (1) the blends, through Megatron-LM's own
`get_blend_and_blend_per_split`: `--data-path` or `--data-args-path` (one blend split by
`--split`), `--train-data-path`/`--valid-data-path`/`--test-data-path` or
`--per-split-data-args-path` (a blend per split); (2) the GPTDatasetConfig settings
pretrain_gpt.py's `core_gpt_dataset_config_from_args` passes (validation sets, builder
threads, mmap, caches, surplus, per-dataset sequence counts, parallel sizes), those this
megatron-core's GPTDatasetConfig has.

What it does not do: the EoD settings (the reset flags, no dense attention mask) stay with
megatron/dataset.py's `build_gpt_datasets`; `--sft` and `--fim-data` are refused
(megatron_lm_args); no dataset of its own.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Optional

from megatron_eod.data.split_sizes import split_shares
from megatron_eod.megatron.dataset import PER_SPLIT_SOURCES, data_sources_given
from megatron_eod.megatron.imports import import_megatron

__all__ = ["blends", "builder_settings", "validates_one_row_at_a_time", "validation_source"]

# GPTDatasetConfig field -> how pretrain_gpt.py reads it from Megatron-LM's args.
_SETTINGS = {
    "multiple_validation_sets": lambda a: a.multiple_validation_sets,
    "full_validation": lambda a: a.full_validation,
    "num_dataset_builder_threads": lambda a: a.num_dataset_builder_threads,
    "mmap_bin_files": lambda a: a.mmap_bin_files,
    "object_storage_cache_path": lambda a: a.object_storage_cache_path,
    "mid_level_dataset_surplus": lambda a: a.mid_level_dataset_surplus,
    "allow_ambiguous_pad_tokens": lambda a: a.allow_ambiguous_pad_tokens,
    "fast_cache_load": lambda a: a.dataloader_fast_cache_load,
    "defer_npy_index_mmap": lambda a: a.dataloader_defer_npy_index_mmap,
    "sequences_per_dataset": lambda a: _sequences_per_dataset(a.per_dataset_sequences_path),
    "context_parallel_size": lambda a: a.context_parallel_size,
    "data_parallel_size": lambda a: a.data_parallel_size,
    "sequence_parallel_size": lambda a: a.tensor_model_parallel_size * a.sequence_parallel,
}


def blends(args):
    """(blend, blend_per_split) as Megatron-LM builds them: one is None, or both with
    --mock-data."""
    utils = importlib.import_module("megatron.training.utils")
    return utils.get_blend_and_blend_per_split(args)


def validates_one_row_at_a_time(args) -> bool:
    """Whether this Megatron-LM reads --full-validation's data one sequence a micro-batch
    (from 0.19, its MegatronFullValidationSampler), whatever the micro-batch size."""
    if not getattr(args, "full_validation", False):
        return False
    try:
        samplers = importlib.import_module("megatron.training.datasets.data_samplers")
    except ImportError:
        return False
    return hasattr(samplers, "MegatronFullValidationSampler")


def validation_source(args) -> Optional[str]:
    """Where the validation data comes from, or None where there is none: the split's
    validation share (--data-path, --data-args-path, --mock-data), or the validation blend
    (--valid-data-path, --per-split-data-args-path)."""
    if set(data_sources_given(args)) & set(PER_SPLIT_SOURCES):
        return "the validation blend" if blends(args)[1][1] else None
    if getattr(args, "mock_data", False):
        return "--mock-data"  # megatron-core splits it 1,1,1 whatever --split says
    share = split_shares(args.split or "969,30,1")[1]
    return f"--split {args.split}" if share > 0 else None


def builder_settings(args, names=None) -> dict:
    """The GPTDatasetConfig settings pretrain_gpt.py passes besides the blends, split, seed,
    sequence length, tokenizer, cache path and the reset flags; only the fields this
    megatron-core has (a flag of a later Megatron-LM is not in its parser either). `names`:
    only these settings (the lean trainer's)."""
    gpt = import_megatron("megatron.core.datasets.gpt_dataset")
    fields = {f.name for f in dataclasses.fields(gpt.GPTDatasetConfig) if f.init}
    out = {}
    for name, read in _SETTINGS.items():
        if name not in fields or (names is not None and name not in names):
            continue
        try:
            out[name] = read(args)
        except AttributeError:  # a flag this Megatron-LM's parser lacks: the field's default
            continue
    return out


def _sequences_per_dataset(path: Optional[str]):
    if path is None:
        return None
    with open(path) as f:
        return json.load(f)
