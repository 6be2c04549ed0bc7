"""Preprocessing never destroys the dataset it replaces, and records its tokenizer.

A re-run that fails, or is killed (SIGKILL) in the middle, over an existing --output-prefix
leaves the previous .bin/.idx/.json byte-identical; a finished run writes the metadata file
with the tokenizer and the dataset's counts."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_eod.data.preprocess import PreprocessError, preprocess_jsonl
from megatron_eod.data.tokenizers import ByteTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUFFIXES = (".bin", ".idx", ".json")


def digests(prefix):
    return {s: hashlib.sha256(open(prefix + s, "rb").read()).hexdigest() for s in SUFFIXES}


@pytest.fixture
def good(tmp_path):
    src = tmp_path / "good.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["alpha", "beta gamma", "d"]))
    preprocess_jsonl(str(src), str(tmp_path / "out"), ByteTokenizer(), append_eod=True,
                     log=lambda m: 0)
    prefix = str(tmp_path / "out_text_document")
    return prefix, digests(prefix)


def test_metadata_records_the_tokenizer_and_counts(good):
    prefix, _ = good
    meta = json.load(open(prefix + ".json"))
    from megatron_eod.data.sidecar import probe_digest
    from megatron_eod.data.tokenizers import ByteTokenizer

    assert meta["tokenizer"] == {"class": "megatron_eod.ByteTokenizer", "vocab_size": 258,
                                 "eod": 256, "pad": 257,
                                 "probe_digest": probe_digest(ByteTokenizer())}
    assert (meta["documents"], meta["tokens"], meta["non_eod_tokens"]) == (3, 19, 16)
    assert meta["bin_bytes"] == os.path.getsize(prefix + ".bin")


def test_a_failing_rerun_keeps_the_previous_dataset(good, tmp_path):
    prefix, before = good
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\nnot json\n")
    with pytest.raises(PreprocessError, match="bad.jsonl:2"):
        preprocess_jsonl(str(bad), str(tmp_path / "out"), ByteTokenizer(), append_eod=True,
                         log=lambda m: 0)
    assert digests(prefix) == before
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_a_killed_rerun_keeps_the_previous_dataset(good, tmp_path):
    prefix, before = good
    big = tmp_path / "big.jsonl"  # 48 MB (over a second of work): killed as it starts writing
    line = json.dumps({"text": "def f(x):\n    return x + 1\n" * 40}) + "\n"
    big.write_text(line * (48_000_000 // len(line)))
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"),
                             "--input", str(big), "--output-prefix", str(tmp_path / "out"),
                             "--append-eod", "--log-interval", "100000000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 240  # its start-up: ~1 s, 60+ s where imports crawl
        while not os.path.exists(prefix + ".bin.tmp") and proc.poll() is None:
            assert time.monotonic() < end, "preprocessing never started writing"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "preprocessing finished before it was killed"
    assert os.path.exists(prefix + ".bin.tmp")
    assert digests(prefix) == before  # the killed run's .tmp files may stay; the next run
    preprocess_jsonl(str(tmp_path / "good.jsonl"), str(tmp_path / "out"), ByteTokenizer(),
                     append_eod=True, log=lambda m: 0)  # ... removes them
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert digests(prefix) == before


def test_an_output_folder_it_cannot_make_is_named(tmp_path):
    """A regular file on --output-prefix's path: one line naming the flag and the file (it
    was a bare `[Errno 17] File exists: ...`)."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "alpha"}) + "\n")
    (tmp_path / "FILE").touch()
    with pytest.raises(OSError, match=r"^--output-prefix .*FILE/out: cannot make its folder "
                                      r".*FILE \(.*FILE is a file, not a folder\)$"):
        preprocess_jsonl(str(src), str(tmp_path / "FILE" / "out"), ByteTokenizer(),
                         log=lambda m: 0)
