"""megatron-core's tokenizers (SentencePiece, TikToken) behind our tokenizer interface, and
EoD taken from each tokenizer's own eos id: a SentencePiece model's eos piece, TikToken's
"</s>", the eos_token a HuggingFace tokenizer.json's config names. Models are trained or
written here, offline."""

import base64
import json

import pytest

from megatron_eod.data.tokenizers import build_tokenizer
from tests.data.test_tokenizers import _train_tiny_bpe

TEXT = "the quick brown fox jumps over the lazy dog. " * 20


def _sentencepiece_model(tmp_path, **options):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXT.split(". ")))
    prefix = str(tmp_path / "sp")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=prefix, vocab_size=40,
                                   model_type="bpe", minloglevel=2, **options)
    return prefix + ".model"


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                                  "Llama2Tokenizer"])
def test_sentencepiece_eod_is_the_models_eos(tmp_path, kind):
    spm = pytest.importorskip("sentencepiece")
    path = _sentencepiece_model(tmp_path, eos_id=5, pad_id=3, unk_id=0, bos_id=1)
    tok = build_tokenizer(kind, tokenizer_model=path)
    assert tok.eod == spm.SentencePieceProcessor(model_file=path).eos_id() == 5
    assert tok.pad == 3 and tok.vocab_size == 40
    ids = tok.tokenize("the lazy fox")
    assert ids and tok.eod not in ids and tok.detokenize(ids) == "the lazy fox"
    assert tok.unique_identifiers["class"] == f"megatron_eod.{kind}"


def test_sentencepiece_without_eos_is_refused(tmp_path):
    path = _sentencepiece_model(tmp_path, eos_id=-1)
    with pytest.raises(ValueError, match="has no end-of-sequence token, which EoD reset needs"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=path)


def _tiktoken_vocab(tmp_path):
    merges = [bytes([i]) for i in range(256)] + [b"th", b"he", b"the"]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(m).decode(),
              "token_str": m.decode("utf-8", errors="replace")} for i, m in enumerate(merges)]
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(vocab))
    return str(path)


def test_tiktoken_eod_is_its_end_of_sequence_special_token(tmp_path):
    pytest.importorskip("tiktoken")
    tok = build_tokenizer("TikTokenizer", tokenizer_model=_tiktoken_vocab(tmp_path),
                          vocab_size=16 + 259, tiktoken_pattern="v2",
                          tiktoken_num_special_tokens=16)
    assert tok.eod == 2 and tok.pad == 4  # "</s>" and "<pad>" in megatron-core's order
    ids = tok.tokenize("the other")
    assert min(ids) >= 16 and tok.detokenize(ids) == "the other"


def test_huggingface_eod_is_the_eos_its_config_names(tmp_path):
    bpe = _train_tiny_bpe()
    bpe.add_special_tokens(["<|im_end|>"])
    bpe.save(str(tmp_path / "tokenizer.json"))
    bare = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert bare.eod == bpe.token_to_id("<|endoftext|>")  # no config: a well-known name
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<pad>"}))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert tok.eod == bpe.token_to_id("<|im_end|>") != bare.eod
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ValueError, match=r"names eos_token '<\|eot_id\|>', which is not in"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


def test_trainer_uses_the_sentencepiece_eos_as_eod(tmp_path):
    """Preprocess with a SentencePiece model, train two iterations on it through Megatron-LM's
    trainer and its GPTSentencePieceTokenizer (EoD = the model's eos at every version): the
    start-up checks pass and the datasets find documents at the model's eos id."""
    from megatron_eod.data.preprocess import preprocess_jsonl
    from tests.harness import run_ranks
    from tests.training.megatron_lm_checkout import import_megatron_lm
    from tests.training.runs import flags, metrics_records, start

    import_megatron_lm()
    path = _sentencepiece_model(tmp_path, eos_id=5, pad_id=3, unk_id=0, bos_id=1)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=path)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": TEXT[: 40 + 7 * i]}) for i in range(200)))
    preprocess_jsonl(str(docs), str(tmp_path / "sp"), tok, append_eod=True)
    argv = flags(str(tmp_path / "sp_text_document"), tmp_path / "m.jsonl", "--train-iters", "2",
                 "--split", "100,0,0", "--eval-iters", "0")
    for flag in ("--tokenizer-type", "--vocab-size"):
        at = argv.index(flag)
        del argv[at:at + 2]
    argv += ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", path]
    (code, said), = run_ranks(start, 1, argv, timeout=120, daemon=False)
    assert code == 0, said[-3000:]
    losses = [r["lm_loss"] for r in metrics_records(tmp_path / "m.jsonl") if "kind" not in r]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)


def test_tiktoken_special_tokens_written_in_the_text_are_text(tmp_path):
    pytest.importorskip("tiktoken")
    tok = build_tokenizer("TikTokenizer", tokenizer_model=_tiktoken_vocab(tmp_path),
                          vocab_size=16 + 259, tiktoken_pattern="v2",
                          tiktoken_num_special_tokens=16)
    ids = tok.tokenize("the </s> and <pad> other")
    assert min(ids) >= 16 and tok.detokenize(ids) == "the </s> and <pad> other"


def test_a_file_that_is_not_a_sentencepiece_model_is_named(tmp_path):
    """(sentencepiece's RuntimeError traceback before: a tools sweep.)"""
    pytest.importorskip("sentencepiece")
    from megatron_eod.data.tokenizers import build_tokenizer

    wrong = tmp_path / "corpus.jsonl"
    wrong.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=r"--tokenizer-model .*corpus\.jsonl: not a "
                                         r"SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", str(wrong))
