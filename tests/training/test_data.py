"""training/data.py: the datasets' start-up checks on every rank, Megatron-LM's data flags and
its tokenizers against the data."""

import os
import re

from megatron_eod.training import data as eod_data
from tests.harness import run_ranks

def test_object_storage_data_needs_megatron_lm_flags_and_skips_local_checks(capsys):
    """s3:// and msc:// prefixes are megatron-core's to read: the flags it only asserts are
    named, and the local checks (which would call the data unreadable) are skipped."""
    import argparse

    import pytest

    from megatron_eod.data.checks import DatasetError

    remote = ["s3://bucket/corpus_text_document"]
    args = argparse.Namespace(object_storage_cache_path=None, mmap_bin_files=True)
    with pytest.raises(DatasetError, match="s3://bucket/corpus_text_document.*needs "
                                           "--object-storage-cache-path"):
        eod_data.check_object_storage(args, remote)
    args.object_storage_cache_path = "/tmp/idx-cache"
    with pytest.raises(DatasetError, match="needs --no-mmap-bin-files"):
        eod_data.check_object_storage(args, remote)
    args.mmap_bin_files = False
    eod_data.check_object_storage(args, ["msc://profile/corpus_text_document"])
    assert "not checked here" in capsys.readouterr().out
    eod_data.check_object_storage(argparse.Namespace(), [])  # local data: nothing to say


def test_ambiguous_pad_tokens_that_would_erase_every_eod_are_refused():
    """--allow-ambiguous-pad-tokens with a tokenizer whose pad id is its EoD id: GPTDataset
    would turn each EoD into token 0 and the documents would run together."""
    import argparse
    import types

    import pytest

    from megatron_eod.data.checks import DatasetError

    args = argparse.Namespace(allow_ambiguous_pad_tokens=True)
    with pytest.raises(DatasetError, match="--allow-ambiguous-pad-tokens: the tokenizer's pad "
                                           "id is its EoD id \\(7\\)"):
        eod_data.megatron_lm_datasets(args, types.SimpleNamespace(eod=7, pad=7), [8, 0, 0])


def _megatron_lm_tokenizer(monkeypatch, kind, model):
    """Megatron-LM's own tokenizer for `--tokenizer-type kind`, built as its trainer builds it
    (its parse_args on a command line, then its build_tokenizer)."""
    import sys

    from tests.training.megatron_lm_checkout import import_megatron_lm

    import_megatron_lm()
    from megatron.training import arguments, global_vars

    monkeypatch.setattr(sys, "argv", [
        "pretrain_gpt.py", "--tokenizer-type", kind, "--tokenizer-model", model,
        "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
        "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1"])
    args = arguments.parse_args()
    args.rank, args.tensor_model_parallel_size = 0, 1
    monkeypatch.setattr(global_vars, "_GLOBAL_TOKENIZER", None)
    return args, global_vars._build_tokenizer(args)


def test_sentencepiece_data_under_megatron_lm_names_the_tokenizer_that_reads_it(
        tmp_path, monkeypatch):
    """Data made with `--tokenizer-type SentencePieceTokenizer` separates documents with the
    model's eos (as megatron-core's tokenizer and later Megatron-LMs do); Megatron-LM's own
    SentencePieceTokenizer (to core_v0.16) adds an `<EOD>` piece of its own. The start-up check
    names the flag that reads the data (before: "pass the tokenizer flags the data was made
    with", which the user had done), and that flag's tokenizer passes every check."""
    import json

    import pytest

    from megatron_eod.data.checks import DatasetError, check_dataset
    from megatron_eod.data.preprocess import preprocess_jsonl
    from megatron_eod.data.tokenizers import build_tokenizer
    from tests.data.test_core_tokenizers import _sentencepiece_model

    model = _sentencepiece_model(tmp_path, eos_id=5, pad_id=3, unk_id=0, bos_id=1)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                           ["the quick brown fox", "jumps over", "the lazy dog"]))
    preprocess_jsonl(str(src), str(tmp_path / "d"), build_tokenizer(
        "SentencePieceTokenizer", tokenizer_model=model), append_eod=True, log=lambda m: 0)
    prefix = str(tmp_path / "d_text_document")

    args, theirs = _megatron_lm_tokenizer(monkeypatch, "SentencePieceTokenizer", model)
    flags = eod_data.tokenizer_eod_flags(args, theirs)
    if theirs.eod == 5:  # a Megatron-LM whose SentencePieceTokenizer is megatron-core's
        check_dataset(prefix, theirs, eod_flags=flags)
    else:
        with pytest.raises(DatasetError, match=rf"EoD id 5 .*EoD id is {theirs.eod}: train "
                                               r"with --tokenizer-type "
                                               r"GPTSentencePieceTokenizer \(the same"):
            check_dataset(prefix, theirs, eod_flags=flags)
    _, advised = _megatron_lm_tokenizer(monkeypatch, "GPTSentencePieceTokenizer", model)
    check_dataset(prefix, advised, eod_flags=flags)  # EoD, vocabulary and probe digest agree


def _check_copies(rank, world, folders):
    """Each rank reads `d_text_document` in its own folder (a node's own copy)."""
    from megatron_eod.data.checks import DatasetError
    from megatron_eod.data.tokenizers import ByteTokenizer

    os.chdir(folders[rank])
    try:
        eod_data.check_datasets(["d_text_document"], ByteTokenizer())
    except DatasetError as error:
        return str(error)
    return None


def test_a_rank_reading_another_copy_of_the_data_stops_every_rank(tmp_path):
    """CP ranks on other nodes draw the same samples: a node's copy of another version (same
    size here) would give them other layouts to plan, and their exchanges would hang or
    mismatch. Every rank stops at start-up, naming the dataset, both ranks and hosts."""
    import json
    import socket

    from megatron_eod.data.preprocess import preprocess_jsonl
    from megatron_eod.data.tokenizers import ByteTokenizer

    folders = []
    for name, letter in (("node0", "a"), ("node1", "a"), ("node2", "b")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "in.jsonl").write_text("".join(
            json.dumps({"text": letter * (3 + i % 40)}) + "\n" for i in range(300)))
        preprocess_jsonl(str(folder / "in.jsonl"), str(folder / "d"), ByteTokenizer(),
                         append_eod=True, log=lambda m: 0)
        folders.append(str(folder))
    assert run_ranks(_check_copies, 2, folders[:2]) == [None, None]  # the same bytes
    errors = run_ranks(_check_copies, 3, folders)
    host = socket.gethostname()
    assert errors == [errors[0]] * 3 and errors[0] == (
        f"d_text_document: rank 2 ({host}) and rank 0 ({host}) read different copies of the "
        f"dataset (its .bin is {os.path.getsize(os.path.join(folders[0], 'd_text_document.bin'))}"
        f" bytes on both, with other bytes (compared whole)). Ranks that draw the "
        f"same samples must read the same bytes: make the copies the same (or read the data "
        f"from a shared file system)")


def _scan_counts(rank, world, prefixes):
    from megatron_eod.data import checks
    from megatron_eod.data.checks import DatasetError
    from megatron_eod.data.tokenizers import ByteTokenizer

    scanned, scan = [], checks._scan
    checks._scan = lambda bin_, *args: scanned.append(bin_) or scan(bin_, *args)
    try:
        eod_data.check_datasets(prefixes, ByteTokenizer())
    except DatasetError as error:
        return scanned, str(error)
    return scanned, None


def test_datasets_without_metadata_are_scanned_once_each_spread_over_the_ranks(tmp_path):
    """Megatron's own tool writes no metadata, so each of its datasets gets a bounded token
    scan at start-up: rank 0 read every one of a blend (minutes for 1,000 shards, at every
    restart); now prefix i is scanned on rank i mod world, and an error any rank finds stops
    every rank."""
    import json

    from megatron_eod.data.preprocess import preprocess_jsonl
    from megatron_eod.data.sidecar import sidecar_path
    from megatron_eod.data.tokenizers import ByteTokenizer, NullTokenizer

    prefixes = []
    for i in range(5):
        (tmp_path / f"{i}.jsonl").write_text(json.dumps({"text": f"doc {i} " * 9}) + "\n")
        tokenizer = NullTokenizer(300) if i == 3 else ByteTokenizer()
        if i == 3:  # ids past the byte vocabulary, from another tokenizer (below the EoD id,
            # 300 under megatron-core 0.16's NullTokenizer(300) and 299 under 0.19's)
            (tmp_path / "3.jsonl").write_text(json.dumps({"text": "280 1 280"}) + "\n")
        preprocess_jsonl(str(tmp_path / f"{i}.jsonl"), str(tmp_path / f"d{i}"), tokenizer,
                         append_eod=True, log=lambda m: 0)
        prefixes.append(str(tmp_path / f"d{i}_text_document"))
        os.remove(sidecar_path(prefixes[-1]))
    results = run_ranks(_scan_counts, 2, prefixes[:3] + prefixes[4:])
    assert [scanned for scanned, _ in results] == [
        [prefixes[0] + ".bin", prefixes[2] + ".bin"], [prefixes[1] + ".bin", prefixes[4] + ".bin"]]
    assert [error for _, error in results] == [None, None]
    results = run_ranks(_scan_counts, 2, prefixes)  # d3 is scanned on rank 1
    assert results[1][0] == [prefixes[1] + ".bin", prefixes[3] + ".bin"]
    assert results[0][1] == results[1][1]
    assert re.search(r"d3_text_document\.bin: token id (280|299|300) is outside the training "
                     r"tokenizer's vocabulary \(258\)", results[0][1])
