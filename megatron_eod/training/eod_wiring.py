"""The EoD wiring both trainers share: layer spec arguments, datasets, step functions.

One job: turn parsed args (the lean trainer's, or Megatron-LM's after megatron_lm_args) into
the EoD pieces, in ONE place, so the lean trainer (model.py, data.py, pretrain.py) and the
Megatron-LM providers (megatron_lm.py) cannot drift apart. Flags either parser lacks read as
their Megatron-LM defaults.

What it does not do: no flag rules (training/args.py, megatron_lm_args.py), no process groups.
"""

from __future__ import annotations

import socket

import torch.distributed as dist

from megatron_eod.attention.groups import register_hybrid_groups
from megatron_eod.data import copies
from megatron_eod.data.checks import DatasetError, check_dataset
from megatron_eod.data.index_cache import cache_folder, check_index_cache
from megatron_eod.data.split_sizes import check_split_sizes
from megatron_eod.megatron.dataset import blend_prefixes, build_gpt_datasets, read_data_sources
from megatron_eod.megatron.imports import import_megatron
from megatron_eod.megatron.layer_spec import get_gpt_eod_block_spec
from megatron_eod.megatron.steps import EodGPTSteps, is_dataset_built_on_rank
from megatron_eod.training import megatron_lm_data
from megatron_eod.training.every_rank import gathered
from megatron_eod.training.shared_folders import check_shared_folders

__all__ = ["block_spec", "contexts_in_flight", "gpt_position_embedding_type", "datasets", "megatron_lm_datasets",
           "check_datasets", "steps", "hybrid_groups"]


def block_spec(registry, config, args, use_transformer_engine: bool, vp_stage=None):
    """This pipeline stage's (model chunk's) block spec with EoD attention and the args' RoPE
    settings."""
    rope = args.position_embedding_type == "rope"
    return get_gpt_eod_block_spec(
        registry, config, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage,
        rotary_base=args.rotary_base, rotary_percent=args.rotary_percent if rope else 0.0,
        rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
        normalization=args.normalization, qk_layernorm=getattr(args, "qk_layernorm", False),
        kernel="flash_attn" if getattr(args, "use_flash_attn", False) else "auto",
        ring_exchange=getattr(args, "cp_ring_exchange", "batched"),
        concurrent_calls=getattr(args, "cp_concurrent_calls", False),
        fused_forward=getattr(args, "cp_fused_forward", False),
        fused_backward=getattr(args, "cp_fused_backward", False))


def contexts_in_flight(args) -> int:
    """The most batch contexts a rank needs at once under megatron-core's schedules (both
    trainers): one per (model chunk, micro-batch) forward not yet run backward (on pipeline rank 0 the
    interleaved schedule warms up 2 (pp - 1) + (chunks - 1) x group of them, the group being
    megatron-core's `microbatch_group_size_per_vp_stage`, pp unless set; 1F1B pp - 1), the
    one running, and one for an evaluation in between."""
    pp = args.pipeline_model_parallel_size
    chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    group = getattr(args, "microbatch_group_size_per_vp_stage", None) or pp
    return 2 * (pp - 1) + (chunks - 1) * group + 2


def gpt_position_embedding_type(args) -> str:
    """GPTModel's own position embedding: RoPE is applied inside EoD attention ("none");
    learned absolute positions are looked up at the reset position ids get_batch passes."""
    return "learned_absolute" if args.position_embedding_type == "learned_absolute" else "none"


# The dataset-builder settings the lean trainer has flags for (Megatron-LM's spellings).
_LEAN_BUILDER_SETTINGS = ("mmap_bin_files", "num_dataset_builder_threads",
                          "mid_level_dataset_surplus", "fast_cache_load", "defer_npy_index_mmap")


def datasets(args, tokenizer, sizes):
    """Train/valid/test GPTDatasets for the lean trainer's args on the ranks that read data
    (None elsewhere), from any of Megatron's data sources (`read_data_sources`), after every
    rank checked every dataset against itself and the tokenizer (data/checks.py)."""
    blends = read_data_sources(
        args.data_path, args.data_args_path,
        (args.train_data_path, args.valid_data_path, args.test_data_path),
        args.per_split_data_args_path)
    return _checked_datasets(args, tokenizer, sizes, *blends, **megatron_lm_data.builder_settings(
        args, names=_LEAN_BUILDER_SETTINGS))


def megatron_lm_datasets(args, tokenizer, sizes):
    """`datasets` for Megatron-LM's args: every data source and dataset-builder setting its
    pretrain_gpt.py reads (megatron_lm_data), each prefix checked first."""
    if getattr(args, "allow_ambiguous_pad_tokens", False) and _pad_id(tokenizer) == tokenizer.eod:
        raise DatasetError(f"--allow-ambiguous-pad-tokens: the tokenizer's pad id is its EoD id "
                           f"({tokenizer.eod}), so GPTDataset would turn every EoD into token 0 "
                           f"and the documents would run together; drop the flag (GPTDataset "
                           f"then pads with an id of its own)")
    return _checked_datasets(args, tokenizer, sizes, *megatron_lm_data.blends(args),
                             **megatron_lm_data.builder_settings(args))


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
    if not hasattr(args, "object_storage_cache_path"):
        raise DatasetError(f"{where} is read through Megatron-LM's --object-storage-cache-path; "
                           f"the lean trainer reads local files only: use --trainer megatron-lm")
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


def steps(args, registry, eod_token_id: int, pad_token_id, plan_ahead: bool) -> EodGPTSteps:
    return EodGPTSteps(
        eod_token_id, registry, args.seq_length, args.micro_batch_size,
        algo=args.context_parallel_algo, ulysses_degree=args.ulysses_degree,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        pad_token_id=pad_token_id, plan_ahead=plan_ahead,
        eval_micro_batch_size=getattr(args, "eval_micro_batch_size", None),
        one_row_evaluation=megatron_lm_data.validates_one_row_at_a_time(args),
        fused_tiles=getattr(args, "cp_fused_forward", False))


def hybrid_groups(args) -> bool:
    """For hybrid CP, hand parallel_state's hierarchical CP groups ([u, cp/u]: Ulysses over
    consecutive ranks, Ring strided) to the attention. True when registered."""
    if args.context_parallel_algo != "hybrid" or args.context_parallel_size == 1:
        return False
    ps = import_megatron("megatron.core.parallel_state")
    inner, outer = ps.get_hierarchical_context_parallel_groups()
    register_hybrid_groups(ps.get_context_parallel_group(), args.ulysses_degree, inner, outer)
    return True
