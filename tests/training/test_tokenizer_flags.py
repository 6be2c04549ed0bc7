"""training/tokenizer_flags.py: a launch script without tokenizer flags trains with the tokenizer
the data was made with, where its metadata says which, and is one line naming --tokenizer-type
where it does not (Megatron-LM's default, GPT2BPETokenizer, downloaded GPT-2's vocabulary: a
traceback on every rank ending in "wget library should be installed" where wget was missing,
the wrong vocabulary where not)."""

import argparse
import os
import shutil

import pytest

from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.tokenizer_flags import null_tokenizer_vocab_size, tokenizer_from_data
from tests.training.megatron_lm_checkout import import_megatron_lm


def _args(**values):
    import_megatron_lm()  # the data flags are read through Megatron-LM's own helper
    flags = dict(tokenizer_type=None, vocab_size=None, vocab_file=None, merge_file=None,
                 tokenizer_model=None, mock_data=False, data_path=None, data_args_path=None,
                 train_data_path=None, valid_data_path=None, test_data_path=None,
                 per_split_data_args_path=None, rank=0)
    return argparse.Namespace(**{**flags, **values})


def test_byte_level_data_needs_no_tokenizer_flags(short_docs_data, capsys):
    args = _args(data_path=[short_docs_data])
    tokenizer_from_data(args)
    assert (args.tokenizer_type, args.vocab_size) == ("NullTokenizer",
                                                      null_tokenizer_vocab_size(256))
    assert "the data was made with the byte-level tokenizer (EoD 256)" in capsys.readouterr().out


def test_tokenizer_flags_given_are_kept(short_docs_data):
    args = _args(data_path=[short_docs_data], tokenizer_type="NullTokenizer", vocab_size=300)
    tokenizer_from_data(args)
    assert (args.tokenizer_type, args.vocab_size) == ("NullTokenizer", 300)
    args = _args(data_path=[short_docs_data], vocab_file="gpt2-vocab.json")  # type left out
    tokenizer_from_data(args)
    assert args.tokenizer_type == "GPT2BPETokenizer"  # Megatron-LM's pretrain_gpt.py default


def test_data_without_metadata_or_of_another_tokenizer_is_one_line(short_docs_data, tmp_path):
    bare = str(tmp_path / "bare")
    for ext in (".bin", ".idx"):
        shutil.copy(short_docs_data + ext, bare + ext)
    with pytest.raises(FlagError, match=rf"^--tokenizer-type not given \({bare} has no metadata "
                                        rf"file saying which made it\): pass the tokenizer "
                                        rf"flags the data was made with"):
        tokenizer_from_data(_args(data_path=[bare]))
    other = str(tmp_path / "other")
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(short_docs_data + ext, other + ext)
    meta = open(other + ".json").read().replace("megatron_eod.ByteTokenizer", "GPT2BPETokenizer")
    with open(other + ".json", "w") as f:
        f.write(meta)
    with pytest.raises(FlagError, match=rf"^--tokenizer-type not given: {other} was made with "
                                        rf"GPT2BPETokenizer; pass the tokenizer flags"):
        tokenizer_from_data(_args(data_path=[other]))
    assert os.path.exists(bare + ".bin")
