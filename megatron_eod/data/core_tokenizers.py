"""megatron-core's own text tokenizers (SentencePiece, TikToken, HuggingFace) behind the small
interface our preprocessing and datasets use (`eod`, `pad`, `vocab_size`, `tokenize`,
`detokenize`, `unique_identifiers`).

One job: build the tokenizer from megatron.core.tokenizers' libraries, as Megatron-LM does for
its --tokenizer-type values, and take EoD from the tokenizer's own end-of-sequence id (a
tokenizer without one is an error naming the file: EoD reset needs a separator).

    sentencepiece_tokenizer("tok.model")                       # SentencePieceTokenizer, ...
    tiktoken_tokenizer("vocab.json", "v2", 131072, 1000, None)  # TikTokenizer
    huggingface_tokenizer("model_dir")                          # needs `transformers`

What it does not do: no downloading, no chat templates; the optional packages (sentencepiece,
tiktoken, transformers) are imported only when their tokenizer is asked for.
"""

from __future__ import annotations

import importlib
import os
from collections import OrderedDict
from typing import List, Optional, Sequence

__all__ = ["CoreTokenizer", "sentencepiece_tokenizer", "tiktoken_tokenizer",
           "huggingface_tokenizer"]


def _need(module: str, flag_value: str):
    try:
        importlib.import_module(module)
    except ImportError:
        raise ValueError(f"--tokenizer-type {flag_value} needs the '{module}' package: pip "
                         f"install {module} (optional; the default ByteTokenizer needs "
                         f"nothing)") from None


class CoreTokenizer:
    """A megatron.core.tokenizers text library tokenizer, EoD = its eos id."""

    def __init__(self, inner, kind: str, source: str):
        self._inner, self.kind, self.source = inner, kind, source
        eod = _valid_id(getattr(inner, "eos_id", None), inner.vocab_size)
        if eod is None:
            raise ValueError(f"--tokenizer-model {source}: the {kind} has no end-of-sequence "
                             f"token, which EoD reset needs as the document separator")
        self.eod = eod
        pad = _valid_id(_safe(lambda: inner.pad_id), inner.vocab_size)
        if pad is not None and pad != eod:
            self.pad = pad
        self.vocab_size = int(inner.vocab_size)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(**{"class": f"megatron_eod.{self.kind}",
                              "source": os.path.abspath(self.source)})

    def tokenize(self, text: str) -> List[int]:
        encoding = getattr(self._inner, "tokenizer", None)
        if self.kind == "TikTokenizer" and hasattr(encoding, "encode_ordinary"):
            # megatron-core's text_to_ids lets special tokens written in the text through
            # (allowed_special="all"): "</s>" in a document would become its EoD id.
            return [int(i) for i in encoding.encode_ordinary(text)]
        return [int(i) for i in self._inner.text_to_ids(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._inner.ids_to_text([int(i) for i in ids])


def _safe(get):
    try:
        return get()
    except (AttributeError, ValueError, IndexError, KeyError):
        return None


def _valid_id(value, vocab_size) -> Optional[int]:
    return int(value) if value is not None and 0 <= int(value) < int(vocab_size) else None


def _existing(path: Optional[str], kind: str) -> str:
    if not path or not os.path.exists(path):
        raise ValueError(f"--tokenizer-type {kind} needs --tokenizer-model (an existing file), "
                         f"got {path!r}")
    return path


def sentencepiece_tokenizer(path: Optional[str], kind: str = "SentencePieceTokenizer"):
    """A SentencePiece model (Megatron-LM's SentencePieceTokenizer, GPTSentencePieceTokenizer
    and Llama2Tokenizer all read one); EoD is the model's eos piece."""
    _need("sentencepiece", kind)
    from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import (
        SentencePieceTokenizer)

    path = _existing(path, kind)
    try:
        inner = SentencePieceTokenizer(path)
    except RuntimeError as error:  # sentencepiece's "could not parse ModelProto"
        raise ValueError(f"--tokenizer-model {path}: not a SentencePiece model "
                         f"({str(error).splitlines()[0][:120]})") from None
    return CoreTokenizer(inner, kind, path)


def tiktoken_tokenizer(path: Optional[str], pattern: str, vocab_size: Optional[int],
                       num_special_tokens: int, special_tokens: Optional[List[str]]):
    """Megatron's TikToken format (a JSON list of {rank, token_bytes, token_str}); the special
    tokens come first, EoD is "</s>" among them."""
    _need("tiktoken", "TikTokenizer")
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer

    path = _existing(path, "TikTokenizer")
    if not path.endswith(".json"):
        raise ValueError(f"--tokenizer-type TikTokenizer reads Megatron's .json vocabulary, "
                         f"got --tokenizer-model {path}")
    kwargs = dict(pattern=pattern, num_special_tokens=num_special_tokens,
                  special_tokens=special_tokens)
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    return CoreTokenizer(TikTokenTokenizer(path, **kwargs), "TikTokenizer", path)


def huggingface_tokenizer(model_dir: str):
    """A local HuggingFace model directory through megatron-core (transformers' AutoTokenizer):
    EoD is the tokenizer's eos_token_id."""
    _need("transformers", "HuggingFaceTokenizer")
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import (
        HuggingFaceTokenizer)

    inner = HuggingFaceTokenizer(model_dir)  # a local directory: no download
    return CoreTokenizer(inner, "HuggingFaceTokenizer", model_dir)
