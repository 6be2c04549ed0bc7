"""training/checkpoint_save.py's tracker: Megatron-LM's own write of it, through the name its
checkpointing module opens it by (`maybe_msc.open` >= 0.18, `open_file` before), replaces the
file (a new inode: a temporary file renamed over it) instead of writing it in place, where a
kill left it empty. The room check, a full disk and a failed save run under the trainer:
tests/functional/test_checkpoint_faults.py, tests/training/test_faults.py."""

import importlib
import os
import types

import pytest

from megatron_eod.training.checkpoint_save import hook_save_checkpoint
from tests.training.megatron_lm_checkout import import_megatron_lm


def _opener(checkpointing):
    storage = getattr(checkpointing, "maybe_msc", None)
    return storage.open if storage is not None else checkpointing.open_file


@pytest.fixture
def checkpointing():
    import_megatron_lm()
    module = importlib.import_module("megatron.training.checkpointing")
    saved = {name: getattr(module, name) for name in ("maybe_msc", "open_file")
             if hasattr(module, name)}
    hook_save_checkpoint(types.SimpleNamespace(save_checkpoint=lambda *a, **k: None))
    yield module
    for name, value in saved.items():
        setattr(module, name, value)


def test_megatron_lms_tracker_write_replaces_the_file(checkpointing, tmp_path):
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("2")
    before = os.stat(tracker).st_ino
    with _opener(checkpointing)(str(tracker), "w") as f:  # as Megatron-LM's save writes it
        f.write("4")
    assert tracker.read_text() == "4"
    assert os.stat(tracker).st_ino != before, "written in place"
    assert os.listdir(tmp_path) == [tracker.name]  # no temporary file left


def test_a_write_that_fails_leaves_the_tracker_as_it_was(checkpointing, tmp_path):
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("2")
    with pytest.raises(KeyboardInterrupt):
        with _opener(checkpointing)(str(tracker), "w") as f:
            f.write("4")
            raise KeyboardInterrupt
    assert tracker.read_text() == "2"


def test_other_files_open_as_before(checkpointing, tmp_path):
    other = tmp_path / "progress.txt"
    with _opener(checkpointing)(str(other), "w") as f:
        f.write("x")
    with _opener(checkpointing)(str(other), "r") as f:
        assert f.read() == "x"
