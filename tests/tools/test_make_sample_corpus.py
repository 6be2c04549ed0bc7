"""tools/make_sample_corpus.py: writes the corpus it says; an --output it cannot write is one
line naming the flag (tracebacks before: a tools sweep)."""

import json
import os
import runpy

import pytest

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "make_sample_corpus.py")
main = runpy.run_path(TOOL)["main"]


def test_writes_the_documents_it_reports(tmp_path, capsys):
    out = tmp_path / "new" / "corpus.jsonl"
    assert main(["--output", str(out), "--max-bytes", "3000"]) == 0
    documents = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    said = capsys.readouterr().out
    assert f"wrote {len(documents)} documents, {sum(map(len, documents))} bytes" in said


@pytest.mark.parametrize("output,message", [
    ("DIR", "--output must name a file to write, got '.*'"),
    ("", "--output must name a file to write, got ''"),
    ("FILE/x.jsonl", "--output .*FILE/x.jsonl: cannot write it"),
])
def test_an_output_it_cannot_write_is_named(tmp_path, capsys, output, message):
    import re

    (tmp_path / "FILE").touch()
    (tmp_path / "DIR").mkdir()
    output = str(tmp_path / output) if output else output
    with pytest.raises(SystemExit) as stop:
        main(["--output", output, "--max-bytes", "100"])
    assert stop.value.code == 2 and re.search(message, capsys.readouterr().err)
