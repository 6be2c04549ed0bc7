"""jsonl -> .bin/.idx: round trip through megatron-core, Megatron's rules, workers, bad lines."""

import json
import os
import subprocess
import sys

import numpy
import pytest

from megatron_eod.data.preprocess import PreprocessError, output_paths, preprocess_jsonl
from megatron_eod.data.tokenizers import ByteTokenizer, build_tokenizer
from megatron_eod.megatron.dataset import build_gpt_datasets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(record if isinstance(record, str) else json.dumps(record))
            f.write("\n")
    return str(path)


def read_indexed(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix)


TEXTS = ["first document", "", "ünïcödé ✓ 世界", "x", "a much longer document " * 40]


def test_round_trip_through_megatron_indexed_dataset(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    tok = ByteTokenizer()
    stats = preprocess_jsonl(src, str(tmp_path / "out"), tok, append_eod=True, log=lambda m: 0)
    prefix = str(tmp_path / "out_text_document")
    assert stats.outputs == {"text": prefix}
    assert (stats.documents, stats.empty_documents) == (5, 1)
    ds = read_indexed(prefix)
    non_empty = [t for t in TEXTS if t]
    assert len(ds) == len(non_empty)  # the empty document holds no sequence and no EoD
    assert len(ds.document_indices) == len(TEXTS) + 1  # ...but is still a document, as Megatron
    for i, text in enumerate(non_empty):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert bytes(ids[:-1]).decode("utf-8") == text
    assert ds[0].dtype == numpy.uint16  # megatron-core's optimal dtype for a 258-id vocab
    assert stats.tokens == sum(len(t.encode()) + 1 for t in non_empty)


def test_gpt_dataset_builds_on_preprocessed_corpus(tmp_path):
    from megatron_eod.data.sample_corpus import write_sample_corpus

    write_sample_corpus(str(tmp_path / "corpus.jsonl"), max_bytes=200_000)
    tok = ByteTokenizer()
    preprocess_jsonl(str(tmp_path / "corpus.jsonl"), str(tmp_path / "c"), tok, append_eod=True,
                     log=lambda m: 0)
    train, valid, _ = build_gpt_datasets(
        str(tmp_path / "c_text_document"), 256, tok, num_samples=[20, 4, 0], split="90,10,0",
        reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
        path_to_cache=str(tmp_path / "cache"))
    sample = train[0]
    assert sample["tokens"].shape == (256,) and "attention_mask" not in sample
    assert any((train[i]["tokens"] == tok.eod).any() for i in range(len(train)))
    assert len(valid) >= 4


def test_json_keys_lists_and_multiple_outputs(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"text": ["one sentence", "", "two"], "title": "t1"},
        {"text": "plain", "title": ""},
    ])
    tok = ByteTokenizer()
    stats = preprocess_jsonl(src, str(tmp_path / "o"), tok, json_keys=["text", "title"],
                             append_eod=True, log=lambda m: 0)
    assert set(stats.outputs) == {"text", "title"}
    text = read_indexed(stats.outputs["text"])
    # A list's strings are ONE sequence, then the EoD: GPTDataset shuffles sequences as if each
    # were a document, so strings written apart (Megatron's tool) would be scattered.
    assert [bytes(s.tolist()[:-1]) for s in (text[0], text[1])] == [b"one sentencetwo",
                                                                     b"plain"]
    assert text[0][-1] == text[1][-1] == tok.eod
    assert list(text.document_indices) == [0, 1, 2]
    assert len(read_indexed(stats.outputs["title"])) == 1


def test_workers_write_identical_bytes(tmp_path, monkeypatch):
    import megatron_eod.data.preprocess as preprocess

    monkeypatch.setattr(preprocess, "_CHUNK_BYTES", 1000)  # many chunks, cut mid-line
    records = [{"text": f"document {i} " * (i % 37)} for i in range(700)]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    tok = ByteTokenizer()
    for workers in (1, 2, 3):
        preprocess_jsonl(src, str(tmp_path / f"w{workers}"), tok, append_eod=True,
                         workers=workers, log_interval=100, log=lambda m: 0)
    for ext_index in (0, 1):
        files = [output_paths(str(tmp_path / f"w{w}"), "text")[ext_index] for w in (1, 2, 3)]
        contents = [open(f, "rb").read() for f in files]
        assert contents[0] == contents[1] == contents[2], files


BAD_LINES = [
    ('{"text": "ok"', "malformed JSON"),
    ('["text"]', "must be a JSON object"),
    ('{"body": "no text key"}', "missing key 'text'"),
    ('{"text": 5}', "must hold a string or a list of strings"),
    ('{"text": "\\ud800"}', "not valid Unicode"),
]


@pytest.mark.parametrize("line,message", BAD_LINES)
def test_bad_line_names_file_and_line(tmp_path, line, message):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "good"}, line, {"text": "good"}])
    with pytest.raises(PreprocessError, match=rf"in\.jsonl:2: .*{message}"):
        preprocess_jsonl(src, str(tmp_path / "o"), ByteTokenizer(), log=lambda m: 0)
    assert not any(os.path.exists(p) for p in output_paths(str(tmp_path / "o"), "text")), \
        "a failed run must not leave a partial dataset"


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "good"}\n\n{"text": "bad \xff\xfe"}\n')
    with pytest.raises(PreprocessError, match=r"in\.jsonl:3: not valid UTF-8"):
        preprocess_jsonl(str(path), str(tmp_path / "o"), ByteTokenizer(), log=lambda m: 0)


def test_line_numbers_stay_exact_across_chunks(tmp_path, monkeypatch):
    import megatron_eod.data.preprocess as preprocess

    monkeypatch.setattr(preprocess, "_CHUNK_BYTES", 64)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "x" * (i % 50)} for i in range(300)]
                      + ["", '{"text": 1}'])
    with pytest.raises(PreprocessError, match=r"in\.jsonl:302: "):
        preprocess_jsonl(src, str(tmp_path / "o"), ByteTokenizer(), workers=2, log=lambda m: 0)


def test_skip_bad_lines_counts_and_keeps_the_rest(tmp_path):
    lines = [{"text": "a"}] + [line for line, _ in BAD_LINES] + ["", {"text": "b"}]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    stats = preprocess_jsonl(src, str(tmp_path / "o"), ByteTokenizer(), skip_bad_lines=True,
                             workers=2, log=lambda m: 0)
    assert (stats.documents, stats.skipped_lines, stats.blank_lines) == (2, len(BAD_LINES), 1)
    assert stats.first_skipped.startswith(src + ":2: malformed JSON")
    assert len(read_indexed(stats.outputs["text"])) == 2


def test_null_tokenizer_rejects_out_of_vocab_ids_with_line(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "4 50"}])
    tok = build_tokenizer("NullTokenizer", vocab_size=10)  # EoD 10 (<= 0.17) or 9 (>= 0.18)
    with pytest.raises(PreprocessError, match=rf"in\.jsonl:2: .*outside \[0, {tok.eod}\) "
                                              rf"\(below the EoD id {tok.eod} of --vocab-size "
                                              rf"10\)"):
        preprocess_jsonl(src, str(tmp_path / "o"), tok, append_eod=True, log=lambda m: 0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(workers=0), "--workers must be >= 1"),
    (dict(log_interval=0), "--log-interval must be >= 1"),
    (dict(json_keys=[]), "--json-keys must name distinct keys"),
    (dict(json_keys=["text", "text"]), "--json-keys must name distinct keys"),
])
def test_bad_arguments(tmp_path, kwargs, message):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    with pytest.raises(PreprocessError, match=message):
        preprocess_jsonl(src, str(tmp_path / "o"), ByteTokenizer(), **kwargs)
    with pytest.raises(PreprocessError, match="--input"):
        preprocess_jsonl(str(tmp_path / "missing.jsonl"), str(tmp_path / "o"), ByteTokenizer())


@pytest.mark.slow
def test_command_line_tool(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}] * 30 + ['{"text": 1}'])
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", src,
           "--append-eod", "--log-interval", "10"]
    runs = [subprocess.Popen(cmd + ["--output-prefix", str(tmp_path / name), *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, extra in (("failed", []), ("ok", ["--skip-bad-lines", "--workers", "2"]))]
    try:
        outputs = [run.communicate(timeout=120) for run in runs]  # side by side
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    failed, ok = (subprocess.CompletedProcess(run.args, run.returncode, *out)
                  for run, out in zip(runs, outputs))
    assert failed.returncode == 1 and "in.jsonl:31:" in failed.stderr
    assert ok.returncode == 0, ok.stderr
    assert "processed 30 documents" in ok.stderr and "MB/s" in ok.stderr
    assert "1 bad lines skipped" in ok.stderr
    assert "Transformer Engine" not in ok.stderr  # megatron-core's import noise is filtered


class _ParsesSpecials(ByteTokenizer):
    tokenize_array = None  # use tokenize()
    """A tokenizer that turns the EoD token written in the text into the EoD id (as
    transformers' tokenizers do by default)."""

    def tokenize(self, text):
        head, _, tail = text.partition("<eod>")
        ids = list(head.encode())
        return ids + [self.eod] + list(tail.encode()) if _ else ids


def test_a_text_that_tokenizes_to_the_eod_id_is_a_bad_line(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "good"}, {"text": "a <eod> b"}])
    with pytest.raises(PreprocessError, match=r"in\.jsonl:2: key 'text': the text tokenizes "
                                              r"to the tokenizer's EoD id 256"):
        preprocess_jsonl(src, str(tmp_path / "o"), _ParsesSpecials(), append_eod=True,
                         log=lambda m: 0)
    stats = preprocess_jsonl(src, str(tmp_path / "o"), _ParsesSpecials(), append_eod=True,
                             skip_bad_lines=True, log=lambda m: 0)
    assert stats.documents == 1 and stats.skipped_lines == 1
