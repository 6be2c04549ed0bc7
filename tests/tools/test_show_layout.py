"""tools/show_layout.py: the micro-batch the trainer would read, its documents shown; a
dataset made with another tokenizer's EoD id is refused as at the trainer's start-up (it was
shown as rows with no EoD and one document each, silently)."""

import importlib.util
import os

import pytest

from tests.data.test_checks import make

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "show_layout.py")


def _tool():
    spec = importlib.util.spec_from_file_location("show_layout", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shows_the_documents_and_refuses_another_tokenizers_data(tmp_path, capsys):
    prefix = make(tmp_path, "show", texts=["alpha beta " * 5, "gamma", "delta " * 9, "z"] * 8)
    common = ["--data-path", prefix, "--seq-length", "32", "--micro-batch-size", "2",
              "--data-cache-path", str(tmp_path / "cache")]
    assert _tool().main(common) == 0
    out = capsys.readouterr().out
    assert "micro-batch: 2 rows x 32 tokens" in out and " 0 EoD tokens" not in out
    with pytest.raises(SystemExit):
        _tool().main(common + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"])
    assert "the data was made with EoD id 256" in capsys.readouterr().err


def test_a_negative_sample_index_and_an_unusable_cache_path_are_named(tmp_path, capsys):
    """(The first showed the last samples as rows 0..; the second was a traceback: a tools
    sweep.)"""
    prefix = make(tmp_path, "show", texts=["alpha beta " * 5, "gamma"] * 8)
    (tmp_path / "afile").touch()
    common = ["--data-path", prefix, "--seq-length", "32", "--micro-batch-size", "1"]
    for extra, said in ((["--sample-index", "-1"], "--sample-index must be >= 0, got -1"),
                        (["--data-cache-path", str(tmp_path / "afile")],
                         "(--data-path, --data-cache-path)")):
        with pytest.raises(SystemExit) as stop:
            _tool().main(common + extra)
        assert stop.value.code == 2 and said in capsys.readouterr().err
