"""`pretrain` stops at start-up on invalid flag combinations: exit status 2 and one line on
stderr that names the flags, before any process group, model or data is created."""

import pytest
import torch.distributed as dist

from megatron_eod.training.pretrain import pretrain
from tests.functional.tiny_gpt import tiny_flags


@pytest.mark.parametrize("world,extra,named", [
    (4, ["--context-parallel-size", "4", "--context-parallel-algo", "hybrid",
         "--ulysses-degree-in-cp", "3"], ["--ulysses-degree-in-cp", "--context-parallel-size"]),
    (4, ["--context-parallel-size", "4", "--context-parallel-algo", "ulysses",
         "--num-attention-heads", "2"], ["--num-attention-heads", "--context-parallel-size"]),
    (4, ["--context-parallel-size", "4", "--seq-length", "130"],
     ["--seq-length", "--context-parallel-size"]),
    (2, ["--context-parallel-size", "2", "--context-parallel-algo", "zigzag"],
     ["--context-parallel-algo"]),
    (3, ["--context-parallel-size", "2"], ["WORLD_SIZE", "--context-parallel-size"]),
], ids=["ulysses-degree", "heads", "seq-length", "unknown-algo", "world-size"])
def test_invalid_flags_stop_at_startup(monkeypatch, capsys, world, extra, named):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as stop:
        pretrain(tiny_flags("/nonexistent/data", *extra))
    assert stop.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith("pretrain_gpt.py: error: --") or "WORLD_SIZE" in message
    for flag in named:
        assert flag in message, message
    assert not dist.is_initialized()


def test_every_rank_says_why(monkeypatch, capsys):
    """Not rank 0 alone: torchrun ends every rank once the first exits, so a line left to
    rank 0 was lost whenever it started later than the others."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as stop:
        pretrain(tiny_flags("/nonexistent/data", "--context-parallel-size", "4",
                            "--seq-length", "130"))
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("pretrain_gpt.py: error: --seq-length 130")


def test_each_rank_writes_its_error_line_whole(monkeypatch):
    """Every rank writes the same error at once; under torchrun stderr is unbuffered, and
    print's two writes (the text, then the newline) ran the ranks' lines together
    ("...file system)pretrain_gpt.py: error: ..."). One write a line, newline included."""
    import sys

    from megatron_eod.training.cp_flags import exit_with_error

    class Writes:
        def __init__(self):
            self.calls = []

        def write(self, text):
            self.calls.append(text)

        def flush(self):
            pass

    writes = Writes()
    monkeypatch.setattr(sys, "stderr", writes)
    with pytest.raises(SystemExit):
        exit_with_error("d_text_document: other copies", 2)
    assert writes.calls == ["pretrain_gpt.py: error: d_text_document: other copies\n"]
