"""Preprocessing's sources: several files, glob patterns, compressed files and stdin give the
bytes of their concatenation, bad lines name their own file, damaged files and bad --input
values are errors naming them, and a stream is read in bounded memory."""

import bz2
import gzip
import io
import json
import lzma
import os
import runpy
import sys
import threading
from multiprocessing.pool import ThreadPool

import pytest

from megatron_eod.data.jsonl_inputs import bounded_ordered_map
from megatron_eod.data.preprocess import PreprocessError, output_paths, preprocess_jsonl
from megatron_eod.data.sidecar import read_sidecar
from megatron_eod.data.tokenizers import ByteTokenizer

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "preprocess_data.py")


def _zstd(data: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    half = len(data) // 2  # two frames, as pzstd and `cat a.zst b.zst` make
    compressor = zstandard.ZstdCompressor()
    return compressor.compress(data[:half]) + compressor.compress(data[half:])


COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress, ".zst": _zstd}


def shard_lines(shard: int, n: int = 150):
    return [json.dumps({"text": f"shard {shard} document {i} " * (i % 9)}) + "\n"
            for i in range(n)]


def write(path, lines, ext=""):
    data = "".join(lines).encode()
    path = str(path) + ext
    with open(path, "wb") as f:
        f.write(COMPRESS[ext](data) if ext else data)
    return path


def dataset_bytes(prefix):
    return tuple(open(p, "rb").read() for p in output_paths(prefix, "text"))


def run(inputs, prefix, **kwargs):
    return preprocess_jsonl(inputs, str(prefix), ByteTokenizer(), append_eod=True,
                            log=lambda m: 0, **kwargs)


@pytest.fixture
def small_chunks(monkeypatch):
    import megatron_eod.data.preprocess as preprocess

    monkeypatch.setattr(preprocess, "_CHUNK_BYTES", 700)  # many chunks, cut mid-line


@pytest.mark.parametrize("ext", sorted(COMPRESS))
def test_inputs_in_every_form_equal_their_concatenation(tmp_path, monkeypatch, small_chunks,
                                                        ext):
    shards = [shard_lines(i) for i in range(4)]
    whole = write(tmp_path / "whole.jsonl", [line for s in shards for line in s])
    run(whole, tmp_path / "whole")
    expected = dataset_bytes(str(tmp_path / "whole"))
    (tmp_path / "in").mkdir()
    # Names whose sorted order is the documents' order; one shard compressed, one from stdin.
    plain = [write(tmp_path / "in" / f"part-{i:02d}.jsonl", shards[i]) for i in (0, 1)]
    packed = write(tmp_path / "in" / "part-02.jsonl", shards[2], ext)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("".join(shards[3]).encode())))
    for workers in (1, 3):
        stats = run([os.path.join(tmp_path, "in", "part-*"), "-"], tmp_path / f"w{workers}",
                    workers=workers)
        assert stats.inputs == plain + [packed, "-"]
        assert dataset_bytes(str(tmp_path / f"w{workers}")) == expected, (ext, workers)
        sys.stdin.buffer.seek(0)
    meta = read_sidecar(str(tmp_path / "w3_text_document"))
    assert meta["documents"] == 600 and meta["tokens"] == stats.tokens


@pytest.mark.parametrize("ext", ["", ".gz"])
def test_a_byte_order_mark_at_a_start_is_skipped(tmp_path, ext):
    lines = shard_lines(0, 5)
    marked = write(tmp_path / "bom.jsonl", ["\ufeff" + lines[0], *lines[1:]], ext)
    run([marked, write(tmp_path / "plain.jsonl", lines)], tmp_path / "o")  # not "given twice"
    run(write(tmp_path / "twice.jsonl", lines + lines), tmp_path / "ref")
    assert dataset_bytes(str(tmp_path / "o")) == dataset_bytes(str(tmp_path / "ref"))


def test_explicit_inputs_keep_their_order(tmp_path):
    a, b = (write(tmp_path / f"{n}.jsonl", shard_lines(i, 5)) for i, n in enumerate("ab"))
    write(tmp_path / "a1.jsonl", shard_lines(7, 5))  # what the pattern a[1].jsonl matches
    b = os.rename(b, tmp_path / "a[1].jsonl") or str(tmp_path / "a[1].jsonl")  # read as named
    run([b, a], tmp_path / "ba")
    run(write(tmp_path / "ba.jsonl", shard_lines(1, 5) + shard_lines(0, 5)), tmp_path / "ref")
    assert dataset_bytes(str(tmp_path / "ba")) == dataset_bytes(str(tmp_path / "ref"))


@pytest.mark.parametrize("ext", ["", ".gz"])
def test_a_bad_line_names_its_own_file_and_line(tmp_path, small_chunks, ext):
    first = write(tmp_path / "a.jsonl", shard_lines(0, 40))
    second = write(tmp_path / "b.jsonl", shard_lines(1, 30) + ['{"text": 7}\n'], ext)
    with pytest.raises(PreprocessError, match=rf"b\.jsonl{ext}:31: key 'text' must hold"):
        run([first, second], tmp_path / "o", workers=2)
    assert not any(os.path.exists(p) for p in output_paths(str(tmp_path / "o"), "text"))
    stats = run([first, second], tmp_path / "o", workers=2, skip_bad_lines=True)
    assert stats.first_skipped.startswith(f"{second}:31: ")
    assert stats.documents == 70


def _flip(data: bytes, at: int) -> bytes:
    damaged = bytearray(data)
    damaged[at] ^= 0x55
    return bytes(damaged)


@pytest.mark.parametrize("ext", sorted(COMPRESS))
def test_a_damaged_cut_or_empty_compressed_file_is_named_and_keeps_the_previous_dataset(
        tmp_path, ext):
    lines = shard_lines(0, 400)
    good = write(tmp_path / "good.jsonl", lines, ext)
    run(good, tmp_path / "out")
    before = dataset_bytes(str(tmp_path / "out"))
    data = open(good, "rb").read()
    one_stream = COMPRESS[ext]("".join(lines).encode()) if ext != ".zst" else \
        pytest.importorskip("zstandard").ZstdCompressor().compress("".join(lines).encode())
    damaged = {
        "cut": data[: len(data) * 2 // 3],
        "empty": b"",
        # A second stream (gzip member, bzip2/xz stream, zstd frame), as `cat a.gz b.gz`
        # makes, damaged in its header or its data: BZ2File and LZMAFile stop there silently.
        "second-header": one_stream + _flip(one_stream, 1),
        "second-data": one_stream + _flip(one_stream, len(one_stream) // 2),
        "garbage-after": one_stream + b"\x01garbage",
    }
    for name, content in damaged.items():
        path = tmp_path / f"{name}.jsonl{ext}"
        path.write_bytes(content)
        with pytest.raises(PreprocessError, match=rf"{name}\.jsonl{ext}: .*(cannot be read to "
                                                  rf"its end|cut short|no .* data \(empty\))"):
            run([good, str(path)], tmp_path / "out", workers=2)
        assert dataset_bytes(str(tmp_path / "out")) == before, name
    garbage = tmp_path / f"plain.jsonl{ext}"
    garbage.write_bytes(b'{"text": "not compressed"}\n')
    with pytest.raises(PreprocessError, match=rf"plain\.jsonl{ext}: named as \w+ data, but it "
                                              rf"is not \(it starts with b'{{\"text'"):
        run(str(garbage), tmp_path / "out")


@pytest.mark.parametrize("ext", sorted(COMPRESS))
def test_compression_is_told_by_the_data_and_padding_is_allowed(tmp_path, ext):
    lines = shard_lines(2, 50)
    run(write(tmp_path / "plain.jsonl", lines), tmp_path / "ref")
    misnamed = write(tmp_path / "misnamed", lines, ext)
    os.rename(misnamed, tmp_path / "misnamed.jsonl")  # compressed, named as plain jsonl
    run(str(tmp_path / "misnamed.jsonl"), tmp_path / "o")
    assert dataset_bytes(str(tmp_path / "o")) == dataset_bytes(str(tmp_path / "ref"))
    if ext in (".gz", ".xz"):  # zero bytes after a member/stream, which gzip and xz allow
        padded = write(tmp_path / "padded.jsonl", lines, ext)
        with open(padded, "ab") as f:
            f.write(b"\0" * 8)
        run(padded, tmp_path / "p")
        assert dataset_bytes(str(tmp_path / "p")) == dataset_bytes(str(tmp_path / "ref"))


def test_a_long_line_in_a_stream(tmp_path, small_chunks):
    lines = shard_lines(0, 3) + [json.dumps({"text": "long " * 40_000}) + "\n"] + shard_lines(1, 3)
    run(write(tmp_path / "plain.jsonl", lines), tmp_path / "ref")
    run(write(tmp_path / "packed.jsonl", lines, ".gz"), tmp_path / "o", workers=2)
    assert dataset_bytes(str(tmp_path / "o")) == dataset_bytes(str(tmp_path / "ref"))


def test_zst_without_zstandard_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "in.jsonl.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import fails
    with pytest.raises(PreprocessError, match=r"in\.jsonl\.zst: reading zstd data needs the "
                                              r"zstandard package \(pip install zstandard\)"):
        run(str(path), tmp_path / "o")


def test_bad_input_values_are_named(tmp_path, monkeypatch):
    a = write(tmp_path / "a.jsonl", shard_lines(0, 3))
    (tmp_path / "sub").mkdir()
    os.symlink(a, tmp_path / "link.jsonl")
    os.link(a, tmp_path / "hard.json")
    cases = [
        ([str(tmp_path / "nothing-*.jsonl")], r"--input '.*nothing-\*\.jsonl' matches no file"),
        ([str(tmp_path / "missing.jsonl")], r"--input .*missing\.jsonl: no such file"),
        ([a + "/x"], r"--input .*a\.jsonl/x: no such file"),
        ([str(tmp_path / "sub")], r"--input .*sub is a directory; name its files"),
        ([str(tmp_path / "s*")], r"--input '.*s\*' matches no file"),  # directories passed over
        ([a, a], r"--input: .*a\.jsonl is given twice; its documents would be written twice"),
        ([str(tmp_path / "*.jsonl")], r"a\.jsonl and .*link\.jsonl are the same file \(by "
                                      r"'.*\*\.jsonl'\)"),
        ([a, str(tmp_path / "hard.json")], r"a\.jsonl and .*hard\.json are the same file"),
        ([str(tmp_path / "?.jsonl"), a], r"a\.jsonl is given twice \(by '.*\?\.jsonl' and "),
        ([], r"--input: give at least one"),
    ]
    for inputs, message in cases:
        with pytest.raises(PreprocessError, match=message):
            run(inputs, tmp_path / "o")
    # A glob over the folder the output goes to would read the previous run's output as jsonl.
    (tmp_path / "out").mkdir()
    run(write(tmp_path / "out" / "in.jsonl", shard_lines(0, 3)), tmp_path / "out" / "o")
    with pytest.raises(PreprocessError, match=r"--input '.*\*': .*o_text_document\.bin is this "
                                              r"run's own output"):
        run([str(tmp_path / "out" / "*")], tmp_path / "out" / "o")
    # Standard input: given twice (as - and as the file behind it), closed.
    with open(a, "rb") as f:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(f))
        for inputs in (["-", "-"], ["-", f"/proc/self/fd/{f.fileno()}"]):
            with pytest.raises(PreprocessError, match=r"<stdin> (is given twice|and .* are the "
                                                      r"same file)"):
                run(inputs, tmp_path / "o2")
    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(PreprocessError, match=r"--input -: standard input is closed"):
        run(["-"], tmp_path / "o2")


def test_bounded_ordered_map_keeps_order_and_reads_at_most_ahead():
    taken, lock = [0], threading.Lock()

    def items():
        for i in range(40):
            with lock:
                taken[0] += 1
            yield i % 3, i

    with ThreadPool(3) as pool:
        out = []
        for tag, value in bounded_ordered_map(lambda x: x * x, items(), pool, ahead=4):
            with lock:
                assert taken[0] <= len(out) + 4  # never more than `ahead` read and not taken
            out.append((tag, value))
    assert out == [(i % 3, i * i) for i in range(40)]
    assert list(bounded_ordered_map(lambda x: -x, iter([(0, 1), (5, 2)]))) == [(0, -1), (5, -2)]


def test_the_tool_takes_megatron_flags_and_names_the_ones_it_refuses(tmp_path, capsys):
    main = runpy.run_path(TOOL)["main"]
    for i in range(3):
        write(tmp_path / f"s{i}.jsonl", shard_lines(i, 20))
    assert main(["--input", str(tmp_path / "s*.jsonl"), "--output-prefix", str(tmp_path / "o"),
                 "--workers", "2", "--partitions", "2", "--keep-sequential-samples",
                 "--vocab-extra-ids", "0", "--lang", "english", "--keep-newlines"]) == 0
    err = capsys.readouterr().err
    assert "--partitions 2 was not needed" in err and "done: 3 inputs, 60 documents" in err
    refused = {"--split-sentences": "no sentence splitting",
               "--split-sentences --lang english": "no sentence",
               "--workers-to-check 16 32": "no worker-count",
               "--find-optimal-num-workers": "no worker-count", "--vocab-extra-ids 100": "T5"}
    for flags, why in refused.items():
        with pytest.raises(SystemExit) as stop:
            main(["--input", "x", "--output-prefix", "o", *flags.split()])
        assert stop.value.code == 2
        assert f"{flags.split()[0]} is not supported: {why}" in capsys.readouterr().err


def test_a_dataset_without_tokens_is_written_with_a_warning(tmp_path, capsys):
    """(It was reported as done, and megatron-core cannot open an empty .bin: a tools sweep.
    Written all the same: a shard of empty documents merges with others.)"""
    main = runpy.run_path(TOOL)["main"]
    write(tmp_path / "empty.jsonl", ['{"text": ""}\n', "\n"])
    assert main(["--input", str(tmp_path / "empty.jsonl"), "--output-prefix",
                 str(tmp_path / "o")]) == 0
    assert "warning: the dataset holds no tokens: megatron-core cannot open it to train" in \
        capsys.readouterr().err
