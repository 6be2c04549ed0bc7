"""`megatron_eod.training.args`: the data and tokenizer flags (Megatron's data sources, one at
a time; the tokenizers and what each needs). CPU only, no process groups."""

import pytest

from megatron_eod.data.tokenizers import TOKENIZER_TYPES
from megatron_eod.megatron.dataset import parse_data_path
from megatron_eod.training.args import FlagError
from tests.training.test_args import parse


@pytest.mark.parametrize("name", TOKENIZER_TYPES)
def test_tokenizer_types_accepted(name):
    extra = {"HuggingFaceTokenizer": ["--tokenizer-model", "tok.json"],
             "GPT2BPETokenizer": ["--vocab-file", "v.json", "--merge-file", "m.txt"],
             "NullTokenizer": ["--vocab-size", 1000],
             "TikTokenizer": ["--tokenizer-model", "v.json", "--tiktoken-pattern", "v2"]}.get(
        name, ["--tokenizer-model", "tok.model"] if "SentencePiece" in name or "Llama" in name
        else [])
    assert parse("--tokenizer-type", name, *extra).tokenizer_type == name


def test_data_path_feeds_dataset(tmp_path):
    prefixes = [str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")]
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            open(prefix + ext, "wb").close()
    args = parse(data=["--data-path", "0.3", prefixes[0], "0.7", prefixes[1]])
    assert args.data_path == ["0.3", prefixes[0], "0.7", prefixes[1]] and not args.mock_data
    assert parse_data_path(args.data_path) == (prefixes, [0.3, 0.7])


@pytest.mark.parametrize("data,match", [
    ([], r"no training data: pass --data-path PREFIX \.\.\. \(or --data-args-path, "
         r"--train-data-path/--valid-data-path/--test-data-path, --per-split-data-args-path or "
         r"--mock-data\)"),
    (["--data-path"], r"no training data: pass --data-path PREFIX"),
    (["--data-path", "corpus_text_document", "--mock-data"],
     r"--mock-data and --data-path are exclusive: pass one data source"),
    (["--data-args-path", "blend.txt", "--train-data-path", "a"],
     r"--data-args-path and --train-data-path/--valid-data-path/--test-data-path are "
     r"exclusive"),
    (["--train-data-path", "a", "--split", "90,8,2"],
     r"--split 90,8,2 shares one blend between the splits; --train-data-path/"
     r"--valid-data-path/--test-data-path gives each split its own: drop --split"),
    (["--valid-data-path", "a"], r"a blend per split needs --train-data-path"),
])
def test_data_flags(data, match):
    with pytest.raises(FlagError, match=match):
        parse(data=data)


def test_data_sources_and_the_default_split():
    assert parse(data=["--data-args-path", "blend.txt"]).split == "969,30,1"
    args = parse(data=["--train-data-path", "a", "--valid-data-path", "b"])
    assert args.split is None and args.train_data_path == ["a"] and args.test_data_path is None
    assert parse(data=["--per-split-data-args-path", "s.json"]).split is None
    assert parse(data=["--mock-data", "--split", "99,1,0"]).split == "99,1,0"
