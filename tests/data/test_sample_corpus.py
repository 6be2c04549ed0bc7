"""The offline sample corpus: deterministic, valid jsonl, heavy-tailed document lengths."""

import json

import numpy

from megatron_eod.data.sample_corpus import write_sample_corpus


def test_corpus_is_deterministic_and_heavy_tailed(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    stats = write_sample_corpus(str(a), max_bytes=600_000)
    write_sample_corpus(str(b), max_bytes=600_000)
    assert a.read_bytes() == b.read_bytes()
    lengths = numpy.array([len(json.loads(line)["text"].encode()) for line in a.open()])
    assert stats == {"documents": len(lengths), "bytes": int(lengths.sum())}
    assert 500_000 < lengths.sum() <= 600_000
    # Heavy tail: the longest documents are far above the median, and tiny ones exist.
    median = numpy.median(lengths)
    assert lengths.max() > 20 * median and numpy.percentile(lengths, 5) < median / 4
    write_sample_corpus(str(tmp_path / "c.jsonl"), max_bytes=600_000, seed=2)
    assert (tmp_path / "c.jsonl").read_bytes() != a.read_bytes()  # the seed matters


def test_methods_apart_makes_shorter_documents_from_the_same_text(tmp_path):
    """The quickstart's corpus: each method and the rest of its class are documents of their
    own, so rows hold more EoDs; the text is the same code, dedented, and still heavy-tailed."""
    whole, apart = tmp_path / "whole.jsonl", tmp_path / "apart.jsonl"
    write_sample_corpus(str(whole), max_bytes=600_000)
    write_sample_corpus(str(apart), max_bytes=600_000, methods_apart=True)
    docs = [json.loads(line) for line in apart.open()]
    lengths = numpy.array([len(d["text"].encode()) for d in docs])
    whole_lengths = numpy.array([len(json.loads(line)["text"].encode()) for line in whole.open()])
    assert lengths.mean() < whole_lengths.mean() / 2
    assert lengths.max() > 20 * numpy.median(lengths)
    methods = [d for d in docs if ":" in d["source"] and "." in d["source"].split(":")[1]]
    assert methods and all(d["text"].startswith(("def ", "async def ", "@")) for d in methods)


def test_a_method_with_a_line_at_column_zero_is_unindented_too(tmp_path, monkeypatch):
    """textwrap.dedent removes nothing from a method holding a comment or a string's line at
    column 0 (xml.sax.expatreader's ExpatParser.reset, pydoc's Helper.listsymbols: which
    files a seed picks decides whether the corpus has one); each line loses the method's own
    indentation, at most."""
    import ast

    from megatron_eod.data import sample_corpus
    source = ("class A:\n"
              "    @staticmethod\n"
              "    def f(x):\n"
              "# a comment at column 0\n"
              "        s = '''\n"
              "text at column 0\n"
              "      six blanks'''\n"
              "\n"
              "        return s\n")
    node = ast.parse(source).body[0]
    (name, text), = sample_corpus._class_apart("m:A", node, source.splitlines(keepends=True))
    assert name == "m:A.f"
    assert text == ("@staticmethod\n"
                    "def f(x):\n"
                    "# a comment at column 0\n"
                    "    s = '''\n"
                    "text at column 0\n"
                    "  six blanks'''\n"
                    "\n"
                    "    return s")
