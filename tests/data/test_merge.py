"""Merging datasets preprocessed apart: the bytes (and metadata) of preprocessing their
concatenation, parts checked and named, tokenizers that differ refused, outputs replaced
safely."""

import json
import os
import runpy

import pytest

from megatron_eod.data.checks import check_dataset
from megatron_eod.data.merge import MergeError, merge_datasets
from megatron_eod.data.preprocess import preprocess_jsonl
from megatron_eod.data.sidecar import read_sidecar, sidecar_path
from megatron_eod.data.tokenizers import ByteTokenizer, build_tokenizer

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "merge_datasets.py")


def shard_lines(shard, n=60):
    return [json.dumps({"text": f"shard {shard} text {i} " * (i % 6)}) + "\n" for i in range(n)]


def make(tmp_path, name, lines, tokenizer=None, folder="shards"):
    (tmp_path / folder).mkdir(exist_ok=True)
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(lines))
    preprocess_jsonl(str(src), str(tmp_path / folder / name), tokenizer or ByteTokenizer(),
                     append_eod=True, log=lambda m: 0)
    return str(tmp_path / folder / f"{name}_text_document")


def files(prefix, exts=(".bin", ".idx", ".json")):
    return tuple(open(prefix + ext, "rb").read() if os.path.exists(prefix + ext) else None
                 for ext in exts)


@pytest.fixture
def shards(tmp_path):
    # The third shard holds only empty documents: a dataset with no sequences merges too.
    lines = [shard_lines(0), shard_lines(1, 7), ['{"text": ""}\n'] * 3, shard_lines(3, 25)]
    parts = [make(tmp_path, f"part-{i}", shard) for i, shard in enumerate(lines)]
    whole = make(tmp_path, "whole", [line for shard in lines for line in shard], folder="ref")
    return parts, whole


def test_merged_shards_equal_preprocessing_their_concatenation(tmp_path, shards):
    parts, whole = shards
    out = str(tmp_path / "merged" / "all_text_document")
    stats = merge_datasets([str(tmp_path / "shards")], out)  # a directory: sorted by name
    assert stats.parts == parts and stats.without_metadata == []
    assert files(out) == files(whole)  # .bin, .idx and the metadata file
    assert (stats.documents, stats.tokens) == (read_sidecar(whole)["documents"],
                                               read_sidecar(whole)["tokens"])
    check_dataset(out, ByteTokenizer())
    # Prefixes and .bin/.idx paths name datasets too, in the order given.
    merge_datasets([parts[0] + ".idx", parts[1], parts[2] + ".bin", parts[3]], out + "2")
    assert files(out + "2") == files(whole)
    merge_datasets([parts[1], parts[0]], out + "3")
    assert files(out + "3") != files(out + "2")


def test_a_part_without_metadata_gives_a_merge_without_it(tmp_path, shards):
    parts, _ = shards
    out = str(tmp_path / "merged" / "all")
    merge_datasets(parts, out)
    assert os.path.exists(sidecar_path(out))
    os.remove(sidecar_path(parts[1]))  # as Megatron's own tool makes them
    stats = merge_datasets(parts, out)
    assert stats.without_metadata == [parts[1]]
    assert not os.path.exists(sidecar_path(out)), "the previous metadata would describe " \
                                                  "other files"
    check_dataset(out, ByteTokenizer())  # checked by a scan now


def test_a_part_without_metadata_of_another_tokenizer_or_without_eods_is_refused(
        tmp_path, shards):
    """Megatron's own tool writes no metadata: such a part is checked against the tokenizer
    the other parts' metadata names (before, merged: the trainer's start-up scan finds ids
    past the vocabulary only, never documents without the EoD that separates them)."""
    parts, _ = shards
    null = make(tmp_path, "null", ['{"text": "1 2 3"}\n'] * 4, build_tokenizer(
        "NullTokenizer", vocab_size=300), folder="other")
    os.remove(sidecar_path(null))
    with pytest.raises(MergeError, match=r"null_text_document \(no metadata file\) holds "
                                         r"token id (299|300), outside the vocabulary of the "
                                         r".*ByteTokenizer \(vocab 258, EoD 256\) that "
                                         r".*part-0_text_document"):
        merge_datasets([parts[0], null], str(tmp_path / "o"))
    src = tmp_path / "plain.jsonl"  # the same tokenizer, without --append-eod
    src.write_text("".join(shard_lines(5, 30)))
    preprocess_jsonl(str(src), str(tmp_path / "other" / "plain"), ByteTokenizer(),
                     append_eod=False, log=lambda m: 0)
    plain = str(tmp_path / "other" / "plain_text_document")
    os.remove(sidecar_path(plain))
    with pytest.raises(MergeError, match=r"plain_text_document \(no metadata file\): 0 of the 25 "
                                         r"documents checked end with EoD id 256, where all 50 "
                                         r"checked of .*part-0_text_document do .*without "
                                         r"--append-eod"):
        merge_datasets([parts[0], plain], str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o.bin")


def test_parts_all_without_metadata_are_checked_against_each_other(tmp_path, shards):
    """With no metadata file anywhere (every part made by Megatron's own tool), the parts'
    document ends are compared: the first part whose checked documents all end with one id
    (its EoD) is the reference (before: merged unchecked)."""
    parts, _ = shards
    for part in parts:
        os.remove(sidecar_path(part))
    assert merge_datasets(parts, str(tmp_path / "all")).without_metadata == parts  # alike

    def without_eod(name, texts):  # the same tokenizer, without --append-eod
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        preprocess_jsonl(str(src), str(tmp_path / "other" / name), ByteTokenizer(),
                         append_eod=False, log=lambda m: 0)
        os.remove(sidecar_path(str(tmp_path / "other" / f"{name}_text_document")))
        return str(tmp_path / "other" / f"{name}_text_document")

    varied = without_eod("varied", [f"text number {i}" for i in range(30)])
    with pytest.raises(MergeError, match=r"varied_text_document \(no metadata file\): 0 of the "
                                         r"30 documents checked end with token id 256, where all "
                                         r"50 checked of .*part-0_text_document do \(its EoD id, "
                                         r"it seems; no part has a metadata file\): made with "
                                         r"another tokenizer, or without --append-eod"):
        merge_datasets([parts[0], parts[2], varied], str(tmp_path / "o"))
    # Documents that all end alike with another id (the text's last character, another
    # tokenizer's EoD) are named against the first part that ends alike, in either order.
    spaced = without_eod("spaced", ["a text ending with a space "] * 20)
    null = make(tmp_path, "null", ['{"text": "1 2 3"}\n'] * 4, build_tokenizer(
        "NullTokenizer", vocab_size=300), folder="other")
    os.remove(sidecar_path(null))
    for order, (part, count, id_), (first, first_count, first_id) in (
            ([parts[0], spaced], ("spaced", 20, "32"), ("part-0", 50, "256")),
            ([varied, spaced, parts[0]], ("part-0", 50, "256"), ("spaced", 20, "32")),
            ([parts[1], null], ("null", 4, "(299|300)"), ("part-1", 5, "256"))):
        with pytest.raises(MergeError, match=rf"{part}_text_document \(no metadata file\): all "
                                             rf"{count} documents checked end with token id "
                                             rf"{id_}, where all {first_count} checked of "
                                             rf".*{first}_text_document end with token id "
                                             rf"{first_id} .*made with other tokenizers, or one "
                                             rf"without --append-eod"):
            merge_datasets(order, str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o.bin")


def test_parts_of_different_tokenizers_are_refused(tmp_path, shards):
    parts, _ = shards
    null = make(tmp_path, "null", ['{"text": "1 2 3"}\n'], build_tokenizer(
        "NullTokenizer", vocab_size=300), folder="other")
    with pytest.raises(MergeError, match=r"null_text_document was made with another tokenizer "
                                         r"than .*part-0_text_document \(class .*eod"):
        merge_datasets([parts[0], null], str(tmp_path / "o"))
    wide = make(tmp_path, "wide", ['{"text": "1 2 3"}\n'], build_tokenizer(
        "NullTokenizer", vocab_size=70000), folder="other")
    with pytest.raises(MergeError, match=r"wide_text_document holds int32 tokens, .*part-0"
                                         r"_text_document uint16: .*different vocabulary"):
        merge_datasets([parts[0], wide], str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o.bin")


def test_a_damaged_part_is_named_and_the_previous_merge_kept(tmp_path, shards):
    parts, _ = shards
    out = str(tmp_path / "merged" / "all")
    merge_datasets(parts, out)
    before = files(out)
    with open(parts[3] + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(parts[3] + ".bin") - 2)
    with pytest.raises(MergeError, match=r"cannot merge .*part-3_text_document: .*part-3_text"
                                         r"_document\.bin: \d+ bytes, but .* points at"):
        merge_datasets(parts, out)
    assert files(out) == before
    assert sorted(os.listdir(tmp_path / "merged")) == ["all.bin", "all.idx", "all.json"]


def test_a_killed_merges_leftovers_are_removed_by_the_next(tmp_path, shards):
    """What a merge killed mid-write leaves (its .tmp files and the index writer's scratch
    file, which for short documents outgrows the .bin) goes with the next merge to that
    prefix, also one that then fails."""
    from megatron_eod.data.dataset_files import scratch_files, temporary_files

    parts, _ = shards
    out = str(tmp_path / "merged" / "all")
    os.makedirs(tmp_path / "merged")
    for path in (*temporary_files(out), *scratch_files(out)):
        open(path, "wb").write(b"left by a killed run")
    with open(parts[3] + ".bin", "r+b") as f:  # this run then fails on a damaged part
        f.truncate(2)
    with pytest.raises(MergeError, match="cannot merge .*part-3"):
        merge_datasets(parts, out)
    assert os.listdir(tmp_path / "merged") == []


def test_a_part_with_foreign_or_damaged_metadata_or_multimodal_is_named(tmp_path, shards):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    parts, _ = shards
    for content, why in (('{"x":', "unreadable dataset metadata"),
                         ('{"format": "stats"}', "not a megatron-eod dataset metadata file")):
        with open(sidecar_path(parts[2]), "w") as f:
            f.write(content)
        with pytest.raises(MergeError, match=rf"cannot merge .*part-2_text_document: .*{why}"):
            merge_datasets(parts, str(tmp_path / "o"))
    multimodal = str(tmp_path / "mm")
    builder = IndexedDatasetBuilder(multimodal + ".bin", multimodal=True)
    builder.add_item(__import__("torch").tensor([1, 2, 3]), 0)
    builder.end_document()
    builder.finalize(multimodal + ".idx")
    with pytest.raises(MergeError, match=r"mm\.idx: a multimodal dataset"):
        merge_datasets([multimodal], str(tmp_path / "o"))


def test_bad_inputs_and_outputs_are_named(tmp_path, shards):
    parts, _ = shards
    (tmp_path / "empty").mkdir()
    (tmp_path / "lonely").mkdir()
    (tmp_path / "lonely" / "x.bin").write_bytes(b"")
    for ext in (".bin", ".idx"):  # a hard link names the same dataset
        os.link(parts[0] + ext, str(tmp_path / "hard") + ext)
    cases = [
        ([str(tmp_path / "empty")], r"--input .*empty: the directory holds no \.bin/\.idx"),
        ([str(tmp_path / "lonely")], r"--input .*lonely: .*x\.idx does not exist"),
        ([str(tmp_path / "nothing")], r"--input .*nothing: .*nothing\.bin does not exist"),
        ([parts[0], parts[0] + ".idx"], r"the dataset .*part-0_text_document is named twice"),
        ([str(tmp_path / "shards"), parts[1]], r"part-1_text_document is named twice"),
        ([parts[0], str(tmp_path / "hard")], r"part-0_text_document and .*hard are the same "
                                              r"dataset"),
        ([], r"name at least one dataset"),
    ]
    for inputs, message in cases:
        with pytest.raises(MergeError, match=message):
            merge_datasets(inputs, str(tmp_path / "out" / "o"))
    with pytest.raises(MergeError, match=r"--output-prefix .*shards/all is in --input .*shards: "
                                         r"a re-run would merge the merged dataset"):
        merge_datasets([str(tmp_path / "shards")], str(tmp_path / "shards" / "all"))
    with pytest.raises(MergeError, match=r"--output-prefix .*part-1_text_document is one of"):
        merge_datasets(parts[:2], parts[1])
    (tmp_path / "FILE").touch()  # a regular file where the output's folder would be
    with pytest.raises(OSError, match=r"--output-prefix .*FILE/sub/o: cannot make its folder "
                                      r".*FILE/sub \(.*FILE is a file, not a folder\)"):
        merge_datasets(parts[:1], str(tmp_path / "FILE" / "sub" / "o"))


def test_the_tool(tmp_path, shards, capsys):
    main = runpy.run_path(TOOL)["main"]
    parts, whole = shards
    os.remove(sidecar_path(parts[0]))
    assert main(["--input", str(tmp_path / "shards"), "--output-prefix",
                 str(tmp_path / "m")]) == 0
    err = capsys.readouterr().err
    assert "done: 4 datasets, 95 documents" in err and "1 of them have no metadata" in err
    assert "no tokens" not in err
    assert files(str(tmp_path / "m"), (".bin", ".idx")) == files(whole, (".bin", ".idx"))
    # The shard of empty documents alone: written, with a warning (it was 'done' only).
    assert main(["--input", parts[2], "--output-prefix", str(tmp_path / "e")]) == 0
    assert "warning: the merged dataset holds no tokens" in capsys.readouterr().err
    assert main(["--input", str(tmp_path / "nothing"), "--output-prefix", "o"]) == 1
    assert "error: --input" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--input", "x", "--output-prefix", "o", "--multimodal"])
    assert "--multimodal is not supported" in capsys.readouterr().err
