"""GPT datasets over Megatron indexed data, built with megatron-core's own builder.

One job: turn Megatron-style data flags (`--data-path`, `--split`, `--seq-length`, the reset
flags) into megatron-core `GPTDataset` splits via `BlendedMegatronDatasetBuilder`, with the
dense attention mask switched off (`create_attention_mask=False`): the document structure
travels as the EoD tokens themselves and `build_doc_layout` recovers it per micro-batch.

What it does not do: no batching or CP slicing (that is `get_batch`, with the trainer), no
dataset of its own: samples are exactly megatron-core's.
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional, Sequence, Tuple, Union

from megatron_eod.megatron.imports import import_megatron

__all__ = ["DATA_SOURCES", "NO_DATA", "PER_SPLIT_SOURCES", "data_sources_given", "parse_data_path",
           "blend_prefixes", "build_gpt_datasets"]

# Megatron's data sources (one per run): the flags as a user writes them -> their args dests.
DATA_SOURCES = {"--mock-data": ("mock_data",), "--data-path": ("data_path",),
                "--data-args-path": ("data_args_path",),
                "--train-data-path/--valid-data-path/--test-data-path": (
                    "train_data_path", "valid_data_path", "test_data_path"),
                "--per-split-data-args-path": ("per_split_data_args_path",)}
PER_SPLIT_SOURCES = list(DATA_SOURCES)[3:]  # a blend per split
NO_DATA = ("no training data: pass --data-path PREFIX ... (or --data-args-path, "
           "--train-data-path/--valid-data-path/--test-data-path, --per-split-data-args-path or "
           "--mock-data)")


def data_sources_given(args) -> List[str]:
    """The DATA_SOURCES keys whose flags `args` sets."""
    return [flags for flags, dests in DATA_SOURCES.items()
            if any(getattr(args, dest, None) for dest in dests)]


def parse_data_path(data_path: Union[str, Sequence[str]]
                    ) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron's `--data-path` forms: `PREFIX ...` or `W1 PREFIX1 W2 PREFIX2 ...`."""
    items = [data_path] if isinstance(data_path, str) else list(data_path)
    if not items:
        raise ValueError("--data-path needs at least one dataset prefix")

    def is_number(text):
        try:
            float(text)
            return True
        except ValueError:
            return False

    if len(items) % 2 == 0 and all(is_number(w) for w in items[0::2]):
        weights, prefixes = [float(w) for w in items[0::2]], list(items[1::2])
        if any(w <= 0 for w in weights):
            raise ValueError(f"--data-path weights must be positive, got {weights}")
    elif any(is_number(x) for x in items):
        raise ValueError(f"--data-path must be PREFIX... or WEIGHT PREFIX pairs, got {items}")
    else:
        weights, prefixes = None, items
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ValueError(f"--data-path {prefix!r}: {prefix + ext} does not exist "
                                 f"(pass the prefix, e.g. data/corpus_text_document)")
    return prefixes, weights


def blend_prefixes(blend, blend_per_split) -> List[str]:
    """Every dataset prefix the blends read, each once, in order."""
    prefixes = []
    for one in [blend, *(blend_per_split or [])]:
        for prefix in (one[0] if one else []):
            if prefix not in prefixes:
                prefixes.append(prefix)
    return prefixes


def build_gpt_datasets(data_path, seq_length: int, tokenizer, num_samples: Sequence[int],
                       split: str = "969,30,1", seed: int = 1234,
                       reset_position_ids: bool = True, reset_attention_mask: bool = True,
                       eod_mask_loss: bool = False, create_attention_mask: bool = False,
                       path_to_cache: Optional[str] = None,
                       is_built_on_rank: Callable[[], bool] = lambda: True,
                       blend=None, blend_per_split=None, **settings):
    """-> [train, valid, test] megatron-core GPTDatasets (None for a split --split leaves
    empty or `num_samples` asks no sample of; with `multiple_validation_sets`, valid is a
    list).

    `data_path=None` and no blends builds megatron-core's MockGPTDataset (synthetic
    documents, --mock-data). `blend` / `blend_per_split`: blends already parsed
    (Megatron-LM's (prefixes, weights) form) instead of `data_path`; a blend per split takes
    no `split`. `settings`: further GPTDatasetConfig fields (Megatron-LM's data flags,
    training/data.py).
    """
    builder = import_megatron("megatron.core.datasets.blended_megatron_dataset_builder")
    gpt = import_megatron("megatron.core.datasets.gpt_dataset")

    if seq_length <= 0:
        raise ValueError(f"--seq-length must be positive, got {seq_length}")
    if len(num_samples) != 3 or any(n is not None and n < 0 for n in num_samples):
        # None: the whole split (Megatron-LM's --full-validation asks so for validation)
        raise ValueError(f"num_samples must be 3 non-negative sizes or None, got "
                         f"{list(num_samples)}")
    dataset_class = gpt.MockGPTDataset  # no data: megatron's mock data
    if data_path is not None:
        blend = parse_data_path(data_path)
    if blend is not None or blend_per_split is not None:
        dataset_class = gpt.GPTDataset
    config = gpt.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=None if blend_per_split is not None else split,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        path_to_cache=path_to_cache,
        **settings,
    )
    datasets = builder.BlendedMegatronDatasetBuilder(dataset_class, list(num_samples),
                                                     is_built_on_rank, config).build()
    # A split asked for no sample (--eval-iters 0) is None: megatron-core builds a weighted
    # blend's as an empty dataset, on which Megatron-LM's sampler stops every rank.
    return [None if n == 0 else dataset for n, dataset in zip(num_samples, datasets)]
