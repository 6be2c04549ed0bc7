"""Tokenizers: ids, special tokens, Megatron's NullTokenizer rules, local HF files, errors."""

import json

import pytest

from megatron_eod.data.tokenizers import (
    ByteTokenizer, NullTokenizer, build_tokenizer, padded_vocab_size)


def test_byte_tokenizer_round_trip_and_special_ids():
    tok = build_tokenizer()  # the default needs no flag and no file
    assert isinstance(tok, ByteTokenizer)
    text = "héllo, 世界 \U0001F600"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.detokenize(ids + [tok.eod]) == text
    assert (tok.eod, tok.pad, tok.vocab_size) == (256, 257, 258)
    assert padded_vocab_size(tok.vocab_size) == 384
    assert padded_vocab_size(tok.vocab_size, 128, 4) == 512
    with pytest.raises(UnicodeEncodeError):
        tok.tokenize("\ud800")  # a lone surrogate is not text


def test_null_tokenizer_has_megatron_semantics():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as core

    tok = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert isinstance(tok, NullTokenizer)
    # megatron-core's own semantics, which changed: EoD 1000 of 1001 ids up to 0.17, 999 of
    # 1000 from 0.18.
    assert (tok.eod, tok.vocab_size) == (core(1000).eod, core(1000).vocab_size)
    assert (tok.eod, tok.vocab_size) in ((1000, 1001), (999, 1000))
    assert tok.tokenize("5 17 998") == [5, 17, 998]
    assert tok.tokenize("  ") == []
    assert tok.detokenize([5, 17]) == "5 17"
    assert not hasattr(tok, "pad")
    with pytest.raises(ValueError, match=rf"outside \[0, {tok.eod}\)"):
        tok.tokenize(f"5 {tok.eod}")
    with pytest.raises(ValueError, match="space-separated integer"):
        tok.tokenize("5 x")


@pytest.mark.parametrize("kwargs,message", [
    (dict(tokenizer_type="SentencePiece"), "--tokenizer-type 'SentencePiece' is not supported"),
    (dict(tokenizer_type="NullTokenizer"), "needs --vocab-size"),
    (dict(tokenizer_type="HuggingFaceTokenizer"), "needs --tokenizer-model"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nonexistent"),
     "needs --tokenizer-model"),
    (dict(tokenizer_type="GPT2BPETokenizer"), "needs --vocab-file"),
    (dict(tokenizer_type="NullTokenizer", vocab_size=0), r"needs --vocab-size in \[1, 2\*\*31\)"),
    # (An OverflowError traceback at preprocessing: a tools sweep.)
    (dict(tokenizer_type="NullTokenizer", vocab_size=99999999999), "got 99999999999"),
])
def test_bad_tokenizer_flags(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(**kwargs)


def test_make_vocab_size_divisible_by_must_be_positive():
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        padded_vocab_size(258, 0)


def _train_tiny_bpe():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    return tok


def test_huggingface_tokenizer_from_local_directory(tmp_path):
    _train_tiny_bpe().save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert (tok.eod, tok.pad) == (0, 1)
    ids = tok.tokenize("the lazy fox")
    assert ids and tok.eod not in ids and tok.detokenize(ids) == "the lazy fox"
    assert tok.unique_identifiers["class"] == "megatron_eod.HuggingFaceTokenizer"


def test_gpt2_bpe_from_vocab_and_merge_files(tmp_path):
    model = json.loads(_train_tiny_bpe().to_str())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                          merge_file=str(tmp_path / "merges.txt"))
    assert tok.eod == model["vocab"]["<|endoftext|>"]
    assert tok.detokenize(tok.tokenize("quick brown dog")) == "quick brown dog"


def test_special_tokens_written_in_the_text_are_text(tmp_path):
    """"<|endoftext|>" inside a code document must not become the EoD id (under EoD reset it
    would cut the document), nor "<pad>" the pad id."""
    _train_tiny_bpe().save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    text = "print('<|endoftext|>') and <pad> here"
    ids = tok.tokenize(text)
    assert tok.eod not in ids and tok.pad not in ids and tok.detokenize(ids) == text
