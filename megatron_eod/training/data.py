"""The datasets of the EoD providers, from Megatron-LM's data flags, checked before they are
built: a launch script's data flags mean under our providers what they mean under Megatron-LM's
pretrain_gpt.py.

One job: from Megatron-LM's parsed args, (1) the blends, through Megatron-LM's own
`get_blend_and_blend_per_split`: `--data-path` or `--data-args-path` (one blend split by
`--split`), `--train-data-path`/`--valid-data-path`/`--test-data-path` or
`--per-split-data-args-path` (a blend per split); (2) the GPTDatasetConfig settings
pretrain_gpt.py's `core_gpt_dataset_config_from_args` passes (validation sets, builder
threads, mmap, caches, surplus, per-dataset sequence counts, parallel sizes), those this
megatron-core's GPTDatasetConfig has; (3) `megatron_lm_datasets`: every prefix checked first on
every rank (data/checks.py: index, size, metadata, tokenizer, EoD id; each rank's copy against
rank 0's; the sample-index cache folders shared), then megatron/dataset.py's
`build_gpt_datasets`.

What it does not do: the EoD settings (the reset flags, no dense attention mask) stay with
megatron/dataset.py's `build_gpt_datasets`; `--sft` and `--fim-data` are refused (args.py);
no dataset of its own.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import socket
from typing import Optional

import torch.distributed as dist

from megatron_eod.data import copies
from megatron_eod.data.checks import DatasetError, check_dataset
from megatron_eod.data.index_cache import cache_folder, check_index_cache
from megatron_eod.data.split_sizes import check_split_sizes, split_shares
from megatron_eod.megatron.dataset import (PER_SPLIT_SOURCES, blend_prefixes, build_gpt_datasets,
                                           data_sources_given)
from megatron_eod.megatron.imports import import_megatron
from megatron_eod.megatron.steps import is_dataset_built_on_rank
from megatron_eod.training.every_rank import gathered
from megatron_eod.training.shared_folders import check_shared_folders

__all__ = ["blends", "builder_settings", "check_datasets", "megatron_lm_datasets",
           "tokenizer_eod_flags", "validates_one_row_at_a_time", "validation_source"]

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
    "inter_document_masking": lambda a: a.dataloader_inter_document_masking,  # >= 0.19
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


def builder_settings(args) -> dict:
    """The GPTDatasetConfig settings pretrain_gpt.py passes besides the blends, split, seed,
    sequence length, tokenizer, cache path and the reset flags; only the fields this
    megatron-core has (a flag of a later Megatron-LM is not in its parser either)."""
    gpt = import_megatron("megatron.core.datasets.gpt_dataset")
    fields = {f.name for f in dataclasses.fields(gpt.GPTDatasetConfig) if f.init}
    out = {}
    for name, read in _SETTINGS.items():
        if name not in fields:
            continue
        try:
            out[name] = read(args)
        except AttributeError:  # a flag this Megatron-LM's parser lacks: the field's default
            continue
    return out


def megatron_lm_datasets(args, tokenizer, sizes):
    """Train/valid/test GPTDatasets on the ranks that read data (None elsewhere): every data
    source and dataset-builder setting Megatron-LM's pretrain_gpt.py reads, each prefix
    checked first on every rank (`check_datasets`)."""
    if getattr(args, "allow_ambiguous_pad_tokens", False) and _pad_id(tokenizer) == tokenizer.eod:
        raise DatasetError(f"--allow-ambiguous-pad-tokens: the tokenizer's pad id is its EoD id "
                           f"({tokenizer.eod}), so GPTDataset would turn every EoD into token 0 "
                           f"and the documents would run together; drop the flag (GPTDataset "
                           f"then pads with an id of its own)")
    return _checked_datasets(args, tokenizer, sizes, *blends(args),
                             **builder_settings(args))


def _checked_datasets(args, tokenizer, sizes, blend, blend_per_split, **settings):
    if not getattr(args, "mock_data", False):
        prefixes = blend_prefixes(blend, blend_per_split)
        remote = import_megatron("megatron.core.datasets.object_storage_utils")
        check_object_storage(args, [p for p in prefixes if remote.is_object_storage_path(p)])
        check_datasets([p for p in prefixes if not remote.is_object_storage_path(p)], tokenizer,
                       tokenizer_eod_flags(args, tokenizer),
                       cache_path=getattr(args, "data_cache_path", None),
                       reset_flags=" ".join(f"--{flag.replace('_', '-')}" for flag in (
                           "reset_attention_mask", "reset_position_ids")
                           if getattr(args, flag, False)))
        check_split_sizes(blend, args.split if blend_per_split is None else None, sizes)
    return build_gpt_datasets(
        None, args.seq_length, tokenizer, list(sizes), split=args.split, seed=args.seed,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        path_to_cache=args.data_cache_path, is_built_on_rank=is_dataset_built_on_rank,
        blend=blend, blend_per_split=blend_per_split, **settings)


def tokenizer_eod_flags(args, tokenizer):
    """eod -> the training flags that give the tokenizer that EoD id, or None (for the start-up
    check's EoD mismatch message), where another flag can:
    - NullTokenizer: its EoD is --vocab-size up to megatron-core 0.17 and --vocab-size - 1 (or
      --null-tokenizer-eod-id) from 0.18, so data made under one version needs other flags
      under the next;
    - SentencePieceTokenizer: Megatron-LM's (to core_v0.16) adds an EoD piece of its own
      (`<EOD>`, after the model's pieces), where our preprocessing and later Megatron-LMs
      separate documents with the model's eos; its GPTSentencePieceTokenizer reads the same
      model with EoD = eos (and no added pieces)."""
    kind = getattr(args, "tokenizer_type", None)
    if kind == "SentencePieceTokenizer":
        eos = _special_id(tokenizer, "eos")
        return lambda eod: ("--tokenizer-type GPTSentencePieceTokenizer (the same "
                            "--tokenizer-model; Megatron-LM's SentencePieceTokenizer adds an "
                            "EoD piece of its own)") if eod == eos else None
    if kind != "NullTokenizer" or not args.vocab_size:
        return None
    if getattr(args, "null_tokenizer_eod_id", None) is not None:
        return lambda eod: f"--null-tokenizer-eod-id {eod}"
    offset = args.vocab_size - tokenizer.eod
    return lambda eod: f"--tokenizer-type NullTokenizer --vocab-size {eod + offset}"


def _special_id(tokenizer, name):
    try:
        return getattr(tokenizer, name)
    except (AttributeError, NotImplementedError):
        return None


def _pad_id(tokenizer):
    return _special_id(tokenizer, "pad")


def check_object_storage(args, prefixes) -> None:
    """Datasets on object storage (s3://, msc://) are read by megatron-core alone, with the
    flags it needs (it only asserts them); data/checks.py cannot read them, so their index,
    size and tokenizer checks are skipped, said once on rank 0."""
    if not prefixes:
        return
    where = f"--data-path {prefixes[0]}: data on object storage (s3://, msc://)"
    if args.object_storage_cache_path is None:
        raise DatasetError(f"{where} needs --object-storage-cache-path (a local folder where "
                           f"megatron-core keeps the .idx files)")
    if args.mmap_bin_files:
        raise DatasetError(f"{where} needs --no-mmap-bin-files (megatron-core streams the "
                           f".bin in chunks; it cannot memory-map it)")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"megatron-eod: {len(prefixes)} dataset(s) on object storage, first "
              f"{prefixes[0]}: not checked here (index, size, tokenizer, EoD id); megatron-core "
              f"reads them", flush=True)


def check_datasets(prefixes, tokenizer, eod_flags=None, cache_path=None,
                   reset_flags="") -> None:
    """data/checks.py on every prefix: the cheap index/size/metadata checks on every rank (a
    node may hold its own, damaged copy), the bounded token scan of a dataset without
    metadata on one rank (prefix i on rank i mod world: each scanned once, a blend's scans
    spread over the ranks, where rank 0 alone read them all: 0.14 s a prefix from a cold
    local disk, more from a network file system; minutes for a blend of 1,000 of Megatron's
    tool's shards, at every restart), the cached indices' stamp
    (data/index_cache.py) on rank 0 only; then every rank's copy of each dataset against
    rank 0's (data/copies.py: a node's copy of another version, or with a tail never
    written). Every rank raises the first rank's error, so none is left waiting in the
    dataset builder's collectives. Where the ranks span several hosts, the sample-index cache
    folders must be one for every node (shared_folders)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    error, fingerprints = None, None
    try:
        for i, prefix in enumerate(prefixes):
            check_dataset(prefix, tokenizer, scan_tokens=None if i % world == rank else 0,
                          eod_flags=eod_flags, reset_flags=reset_flags)
            if rank == 0:  # where megatron-core builds the cached indices
                check_index_cache(prefix, cache_path)
        fingerprints = [copies.fingerprint(prefix) for prefix in prefixes]
    except DatasetError as found:
        error = str(found)
    if dist.is_initialized():
        # Round one gathers a digest of each rank's fingerprints (a few bytes a rank); only
        # when two differ, rank 0 sends its fingerprints and each rank gathers what differs
        # on it in words (None where nothing does).
        found = gathered((error, copies.summary(fingerprints)))
        error = next((e for e, _ in found if e is not None), None)
        if error is None and len({digest for _, digest in found}) > 1:
            error = next((e for e in gathered(_other_copy(prefixes, fingerprints))
                          if e is not None), None)
    if error is not None:
        raise DatasetError(error)
    check_shared_folders(_cache_folders(prefixes, cache_path), DatasetError)


def _cache_folders(prefixes, cache_path):
    """The sample-index cache folders megatron-core writes on rank 0 and the ranks that build
    datasets read (for shared_folders)."""
    folders = sorted({cache_folder(prefix, cache_path) for prefix in prefixes})
    where = "--data-cache-path" if cache_path else "beside the dataset: no --data-cache-path"
    return [(f"the sample-index cache {folder} ({where}; megatron-core builds the indices on "
             f"rank 0 and the other ranks read them there)", folder, is_dataset_built_on_rank)
            for folder in folders]


def _other_copy(prefixes, fingerprints):
    """The first dataset this rank reads another copy of than rank 0 does, in words, or None
    (every rank calls it: rank 0 broadcasts its fingerprints)."""
    sent = [(fingerprints, socket.gethostname())]
    dist.broadcast_object_list(sent, src=0)
    reference, host = sent[0]
    names = (f"rank 0 ({host})", f"rank {dist.get_rank()} ({socket.gethostname()})")
    for prefix, ours, theirs in zip(prefixes, reference, fingerprints):
        what = copies.difference(ours, theirs, names)
        if what is not None:
            return (f"{prefix}: {names[1]} and {names[0]} read different copies of the "
                    f"dataset ({what}). Ranks that draw the same samples must read the same "
                    f"bytes: make the copies the same (or read the data from a shared file "
                    f"system)")
    return None


def _sequences_per_dataset(path: Optional[str]):
    if path is None:
        return None
    with open(path) as f:
        return json.load(f)
