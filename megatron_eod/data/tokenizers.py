"""Tokenizers shared by `tools/preprocess_data.py` and the trainer.

One job: map text to token ids and name the special ids (`eod`, `pad`) and `vocab_size` the way
megatron-core's datasets expect (`.eod`, `.vocab_size`, `.unique_identifiers`; `.pad` when the
tokenizer has one). The same object serves preprocessing and training, so the EoD id written
into the `.bin` files is the one `build_doc_layout` looks for.

* `ByteTokenizer` (the default, `--tokenizer-type ByteTokenizer`): offline, no files. Ids 0..255
  are the UTF-8 bytes, 256 is EoD, 257 is pad. The embedding is padded for efficiency by
  `padded_vocab_size` (Megatron's `--make-vocab-size-divisible-by` rule: 258 -> 384).
* `NullTokenizer` (`--vocab-size V`): Megatron's semantics, wrapping megatron-core's own class:
  text is space-separated integer ids; EoD is V and `vocab_size` V + 1 in megatron-core 0.16,
  EoD V - 1 and `vocab_size` V from 0.18 (Megatron-LM's own flag changed meaning; the
  dataset checks name the --vocab-size that fits data made under the other); no pad id.
* `HuggingFaceTokenizer` (`--tokenizer-model DIR_OR_tokenizer.json`) and `GPT2BPETokenizer`
  (`--vocab-file --merge-file`): a tokenizer.json is read with the `tokenizers` package, its
  EoD is the eos token its tokenizer_config.json / special_tokens_map.json name (as
  transformers' eos_token_id; only a bare tokenizer.json falls back to well-known names); a
  model directory without tokenizer.json goes through megatron-core's HuggingFaceTokenizer
  (`transformers`). Imported lazily, never fetched.
* `SentencePieceTokenizer` / `GPTSentencePieceTokenizer` / `Llama2Tokenizer`
  (`--tokenizer-model tok.model`) and `TikTokenizer` (`--tokenizer-model vocab.json`,
  `--tiktoken-pattern`, `--tiktoken-num-special-tokens`, `--tiktoken-special-tokens`):
  megatron-core's own libraries (core_tokenizers.py), EoD = their eos id.

What it does not do: no sentence splitting, no downloading.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import List, Optional, Sequence

import numpy

from megatron_eod.data import core_tokenizers

__all__ = [
    "TOKENIZER_TYPES",
    "ByteTokenizer",
    "NullTokenizer",
    "HuggingFaceTokenizer",
    "build_tokenizer",
    "padded_vocab_size",
]

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = ("ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   *SENTENCEPIECE_TYPES, "TikTokenizer")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus EoD (256) and pad (257)."""

    eod = 256
    pad = 257
    vocab_size = 258

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(**{"class": "megatron_eod.ByteTokenizer"})

    def tokenize(self, text: str) -> List[int]:
        return self.tokenize_array(text).tolist()

    def tokenize_array(self, text: str) -> numpy.ndarray:
        """The ids as a uint8 array, without a Python list in between."""
        # "strict" makes a lone surrogate (from a JSON "\ud800" escape) an error, not a '?'.
        return numpy.frombuffer(text.encode("utf-8", errors="strict"), dtype=numpy.uint8)

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer:
    """Megatron's NullTokenizer: space-separated ids in; EoD is megatron-core's (the flag's
    value up to 0.17, the value - 1 from 0.18)."""

    def __init__(self, vocab_size: Optional[int]):
        if vocab_size is None or not 0 < int(vocab_size) < 2**31:  # ids are stored as int32
            raise ValueError(
                f"--tokenizer-type NullTokenizer needs --vocab-size in [1, 2**31), got "
                f"{vocab_size}"
            )
        from megatron.core.tokenizers.text.libraries.null_tokenizer import (
            NullTokenizer as _MegatronNull,
        )

        self._inner, self._flag = _MegatronNull(int(vocab_size)), int(vocab_size)

    @property
    def eod(self) -> int:
        return self._inner.eod

    @property
    def vocab_size(self) -> int:
        return self._inner.vocab_size

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(**{"class": "megatron_eod.NullTokenizer", "eod": self.eod})

    def tokenize(self, text: str) -> List[int]:
        if not text.strip():
            return []
        try:
            ids = self._inner.text_to_ids(text.strip())
        except ValueError as err:
            raise ValueError(f"NullTokenizer expects space-separated integer ids: {err}") from None
        bad = [i for i in ids if not 0 <= i < self.eod]
        if bad:
            raise ValueError(
                f"NullTokenizer id {bad[0]} is outside [0, {self.eod}) (below the EoD id "
                f"{self.eod} of --vocab-size {self._flag})"
            )
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._inner.ids_to_text([int(i) for i in ids])


class HuggingFaceTokenizer:
    """A local tokenizer.json (or GPT-2 vocab + merges) read with the `tokenizers` package; EoD
    is the eos token its config names (a bare tokenizer.json: `<|endoftext|>`, `</s>`, ...)."""

    def __init__(self, tokenizer_json: Optional[str] = None, *,
                 vocab_file: Optional[str] = None, merge_file: Optional[str] = None):
        self._source = tokenizer_json or vocab_file
        tokenizers = _import_or_explain("tokenizers")
        if tokenizer_json:
            tok = tokenizers.Tokenizer.from_file(tokenizer_json)
        else:
            model = tokenizers.models.BPE.from_file(vocab_file, merge_file)
            tok = tokenizers.Tokenizer(model)
            tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = tokenizers.decoders.ByteLevel()
        # A special token written out in a document's text is text: "<|endoftext|>" in a
        # code file must not become the EoD id that cuts the document under EoD reset.
        tok.encode_special_tokens = True
        self._tok = tok
        self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
        self._decode = lambda ids: tok.decode(list(ids))
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        named = _configured_tokens(tokenizer_json) if tokenizer_json else {}
        eod = _token_id(vocab, named, "eos_token", self._source,
                        ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"))
        pad = _token_id(vocab, named, "pad_token", self._source, ("<pad>", "<|pad|>", "[PAD]"))
        if eod is None:
            raise ValueError(
                f"tokenizer {self._source} has no end-of-document token (eos / <|endoftext|>)"
            )
        self.eod = int(eod)
        if pad is not None and int(pad) != self.eod:
            self.pad = int(pad)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(**{"class": "megatron_eod.HuggingFaceTokenizer",
                              "source": os.path.abspath(self._source)})

    def tokenize(self, text: str) -> List[int]:
        return list(self._encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._decode(ids)


def _first_present(vocab: dict, names: Sequence[str]) -> Optional[int]:
    for name in names:
        if name in vocab:
            return vocab[name]
    return None


def _configured_tokens(tokenizer_json: str) -> dict:
    """The special tokens tokenizer_config.json / special_tokens_map.json beside a
    tokenizer.json name ({"eos_token": "</s>", ...}); {} when neither file is there."""
    folder = os.path.dirname(os.path.abspath(tokenizer_json))
    named = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path) as f:
                config = json.load(f)
            for key in ("eos_token", "pad_token"):
                value = config.get(key)
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    named[key] = value
    return named


def _token_id(vocab: dict, named: dict, key: str, source: str, fallback: Sequence[str]):
    """The id of the token the config names for `key`; without a config, the first
    well-known name present."""
    if key in named:
        if named[key] not in vocab:
            raise ValueError(f"tokenizer {source}: its config names {key} {named[key]!r}, "
                             f"which is not in its vocabulary")
        return vocab[named[key]]
    return _first_present(vocab, fallback)


def _import_or_explain(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise ValueError(
            f"this tokenizer needs the '{module}' package: pip install {module} "
            f"(it is optional; the default --tokenizer-type ByteTokenizer needs nothing)"
        ) from None


def build_tokenizer(tokenizer_type: str = "ByteTokenizer", tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    vocab_size: Optional[int] = None, tiktoken_pattern: str = "v2",
                    tiktoken_num_special_tokens: int = 1000,
                    tiktoken_special_tokens: Optional[List[str]] = None):
    """Build a tokenizer from Megatron-style flag values; errors name the flag."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of "
            f"{', '.join(TOKENIZER_TYPES)}"
        )
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return core_tokenizers.sentencepiece_tokenizer(tokenizer_model, tokenizer_type)
    if tokenizer_type == "TikTokenizer":
        return core_tokenizers.tiktoken_tokenizer(tokenizer_model, tiktoken_pattern, vocab_size,
                                                  tiktoken_num_special_tokens,
                                                  tiktoken_special_tokens)
    if tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise ValueError(f"--tokenizer-type GPT2BPETokenizer needs {flag} (an existing "
                                 f"file), got {path!r}")
        return HuggingFaceTokenizer(vocab_file=vocab_file, merge_file=merge_file)
    if not tokenizer_model or not os.path.exists(tokenizer_model):
        raise ValueError(
            f"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a local directory or "
            f"tokenizer.json), got {tokenizer_model!r}"
        )
    json_path = tokenizer_model
    if os.path.isdir(tokenizer_model):
        json_path = os.path.join(tokenizer_model, "tokenizer.json")
    if os.path.isfile(json_path):
        return HuggingFaceTokenizer(json_path)
    return core_tokenizers.huggingface_tokenizer(tokenizer_model)


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                      tensor_model_parallel_size: int = 1) -> int:
    """Megatron's embedding padding: round up to a multiple of divisible_by * TP."""
    if make_vocab_size_divisible_by <= 0:
        raise ValueError(
            f"--make-vocab-size-divisible-by must be positive, got {make_vocab_size_divisible_by}"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple
