"""data/copies.py: two copies of a dataset compare equal only when their sampled bytes and
sizes agree; another version of the same size, a copy cut short and one whose tail was never
written (zeros where a partial transfer stopped) each differ, in words naming the file."""

import json
import os
import shutil

import pytest

from megatron_eod.data import copies
from megatron_eod.data.preprocess import preprocess_jsonl
from megatron_eod.data.tokenizers import ByteTokenizer


def _dataset(folder, letter, documents=400):
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
    return copies.difference("P", copies.fingerprint(a), copies.fingerprint(b),
                             ("rank 0 (n1)", "rank 5 (n2)"))


def test_identical_copies_agree(pair):
    assert _differs(*pair) is None


def test_another_version_of_the_same_size_differs(tmp_path, pair):
    other = _dataset(tmp_path / "c", "y")  # same lengths, other letters
    assert os.path.getsize(other + ".bin") == os.path.getsize(pair[0] + ".bin")
    assert _differs(pair[0], other) == (
        f"P.bin is {os.path.getsize(other + '.bin')} bytes on both but holds other bytes "
        f"(compared every ~{os.path.getsize(other + '.bin') // 16} bytes)")


@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_a_copy_whose_bytes_were_never_written_differs(pair, where):
    """A partial transfer that preallocated the file leaves zeros where it stopped (here: any byte changed)."""
    size = os.path.getsize(pair[1] + ".bin")
    at = {"first": 0, "last": size - 1, "middle": size // 2}[where]
    with open(pair[1] + ".bin", "r+b") as f:
        f.seek(at)
        f.write(b"\xff")
    assert "P.bin is" in _differs(*pair) and "holds other bytes" in _differs(*pair)


def test_a_copy_cut_short_differs_by_size(pair):
    with open(pair[1] + ".idx", "ab") as f:
        f.write(b"\0" * 8)
    size = os.path.getsize(pair[0] + ".idx")
    assert _differs(*pair) == (f"P.idx is {size} bytes on rank 0 (n1) and {size + 8} bytes on "
                               f"rank 5 (n2)")


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
