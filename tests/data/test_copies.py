"""data/copies.py: two copies of a dataset compare equal only when their sampled bytes and
sizes agree; another version of the same size or of another size, and a preallocated copy
whose bytes were never written where a transfer stopped, each differ, in words."""

import json
import os
import shutil

import pytest

from megatron_eod.data import copies
from megatron_eod.data.preprocess import preprocess_jsonl
from megatron_eod.data.tokenizers import ByteTokenizer

NAMES = ("rank 0 (n1)", "rank 5 (n2)")


def _dataset(folder, letter, documents=3000):
    folder.mkdir()
    src = folder / "in.jsonl"
    src.write_text("".join(json.dumps({"text": letter * (5 + i % 50)}) + "\n"
                           for i in range(documents)))
    preprocess_jsonl(str(src), str(folder / "d"), ByteTokenizer(), log=lambda m: 0)
    return str(folder / "d_text_document")


@pytest.fixture
def pair(tmp_path):
    a = _dataset(tmp_path / "a", "x")
    (tmp_path / "b").mkdir()
    for ext in (".bin", ".idx"):
        shutil.copyfile(a + ext, str(tmp_path / "b" / "d_text_document") + ext)
    return a, str(tmp_path / "b" / "d_text_document")


def _differs(a, b):
    return copies.difference(copies.fingerprint(a), copies.fingerprint(b), NAMES)


def test_identical_copies_agree(pair):
    assert _differs(*pair) is None
    assert copies.summary([copies.fingerprint(p) for p in pair]) == copies.summary(
        [copies.fingerprint(p) for p in reversed(pair)])


def test_another_version_of_the_same_size_differs(tmp_path, pair):
    other = _dataset(tmp_path / "c", "y")  # same lengths, other letters
    size = os.path.getsize(other + ".bin")
    assert size == os.path.getsize(pair[0] + ".bin") and size > 17 * 4096
    assert _differs(pair[0], other) == (
        f"its .bin is {size} bytes on both, with other bytes (17 blocks of 4 KiB compared)")
    assert copies.summary([copies.fingerprint(pair[0])]) != copies.summary(
        [copies.fingerprint(other)])


def test_another_version_of_another_size_differs(tmp_path, pair):
    other = _dataset(tmp_path / "c", "x", documents=3001)
    assert _differs(pair[0], other) == (
        f"its .bin is {os.path.getsize(pair[0] + '.bin')} bytes on rank 0 (n1), "
        f"{os.path.getsize(other + '.bin')} on rank 5 (n2)")


@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_a_copy_whose_bytes_were_never_written_differs(pair, where):
    """A transfer that preallocated the file and stopped leaves zeros (here: a byte of the
    last token, which is not zero) where it stopped."""
    size = os.path.getsize(pair[1] + ".bin")
    at = {"first": 0, "last": size - 2, "middle": size // 2}[where]
    with open(pair[1] + ".bin", "r+b") as f:
        f.seek(at)
        assert f.read(1) != b"\0"
        f.seek(at)
        f.write(b"\0")
    assert _differs(*pair).startswith(f"its .bin is {size} bytes on both, with other bytes")


def test_a_small_file_is_compared_whole(tmp_path):
    small, other = _dataset(tmp_path / "a", "x", 20), _dataset(tmp_path / "b", "y", 20)
    assert os.path.getsize(small + ".bin") < 17 * 4096
    assert _differs(small, other).endswith("with other bytes (compared whole)")


def test_a_file_it_cannot_read_is_a_dataset_error(pair, monkeypatch):
    """Raised as the start-up checks' error, which every rank gathers (an OSError on one rank
    would leave the others waiting in the gather)."""
    from megatron_eod.data.checks import DatasetError

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("builtins.open", denied)
    with pytest.raises(DatasetError, match=r"d_text_document\.bin: cannot be read \(Permission "
                                           r"denied\)"):
        copies.fingerprint(pair[0])
