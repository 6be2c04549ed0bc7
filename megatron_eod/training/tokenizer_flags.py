"""The tokenizer flags of a run: from the data where the launch script gives none, and checked.

One job, two steps around Megatron-LM's validate_args (args.py calls them):
- `tokenizer_from_data(args)`, before it: where no tokenizer flag is on the command line
  (and no --mock-data; --use-checkpoint-args takes the checkpoint's), the datasets' metadata
  files
  (data/sidecar.py) say which tokenizer made the data. Data made with our byte-level tokenizer
  trains with Megatron-LM's NullTokenizer at the --vocab-size that gives it EoD 256 on this
  megatron-core (256 up to 0.17, 257 from 0.18: the user need not know), said on rank 0. Data
  of another tokenizer, or without metadata, is a FlagError naming --tokenizer-type: Megatron-LM's
  default (GPT2BPETokenizer) would download GPT-2's vocabulary, a traceback on every rank
  ending in "wget library should be installed" where wget or the network is missing, and
  the wrong vocabulary where neither is.
- `check_tokenizer(args)`, after it: the files each --tokenizer-type reads
  (flag_rules.check_tokenizer_files) where this Megatron-LM does not fetch them, and the rules
  of its HuggingFace tokenizer.

What it does not do: no tokenizer of its own (Megatron-LM builds it); the data's EoD id is
checked against it at start-up (data.py, data/checks.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from megatron_eod.data.sidecar import read_sidecar
from megatron_eod.data.tokenizers import ByteTokenizer
from megatron_eod.megatron.dataset import blend_prefixes
from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.flag_rules import check_tokenizer_files

__all__ = ["MEGATRON_LM_DEFAULT", "check_tokenizer", "null_tokenizer_vocab_size",
           "tokenizer_from_data"]

# Set by the flags that configure a tokenizer (None where not given).
_TOKENIZER_DESTS = ("vocab_size", "vocab_file", "merge_file", "tokenizer_model")
_BYTE_LEVEL = ByteTokenizer().unique_identifiers["class"]
# Megatron-LM's pretrain_gpt.py's default --tokenizer-type (its args_defaults).
MEGATRON_LM_DEFAULT = "GPT2BPETokenizer"


def null_tokenizer_vocab_size(eod: int) -> int:
    """The --vocab-size that gives this megatron-core's NullTokenizer the EoD id `eod` (the
    value itself up to 0.17, the value - 1 from 0.18)."""
    null = importlib.import_module("megatron.core.tokenizers.text.libraries.null_tokenizer")
    return eod + (eod - null.NullTokenizer(eod).eod)


def tokenizer_from_data(args) -> None:
    """Set --tokenizer-type / --vocab-size from the data where no tokenizer flag is given
    (`args` as parsed, before Megatron-LM's validate_args fills in its defaults); FlagError
    where the data does not say which (see the module docstring)."""
    if args.tokenizer_type is not None:
        return
    if getattr(args, "mock_data", False) or any(getattr(args, dest, None) is not None
                                                for dest in _TOKENIZER_DESTS):
        args.tokenizer_type = MEGATRON_LM_DEFAULT  # flags given, the type left to its default
        return
    from megatron_eod.training.data import blends  # Megatron-LM's own reading of the flags

    prefixes = [p for p in blend_prefixes(*blends(args)) if "://" not in p]
    made_by = {}
    for prefix in prefixes:
        meta = read_sidecar(prefix) or {}
        made_by[prefix] = (meta.get("tokenizer") or {}).get("class")
    if prefixes and set(made_by.values()) == {_BYTE_LEVEL}:
        args.tokenizer_type = "NullTokenizer"
        args.vocab_size = null_tokenizer_vocab_size(ByteTokenizer.eod)
        if getattr(args, "rank", 0) == 0:
            print(f" megatron-eod: no tokenizer flags; the data was made with the byte-level "
                  f"tokenizer (EoD {ByteTokenizer.eod}): --tokenizer-type NullTokenizer "
                  f"--vocab-size {args.vocab_size}", flush=True)
        return
    other = next(((p, c) for p, c in made_by.items() if c not in (None, _BYTE_LEVEL)), None)
    if other is not None:
        raise FlagError(f"--tokenizer-type not given: {other[0]} was made with {other[1]}; pass "
                        f"the tokenizer flags the data was made with (Megatron-LM's default, "
                        f"GPT2BPETokenizer, downloads GPT-2's vocabulary)")
    where = f" ({prefixes[0]} has no metadata file saying which made it)" if prefixes else ""
    raise FlagError(f"--tokenizer-type not given{where}: pass the tokenizer flags the data was "
                    f"made with (Megatron-LM's default, GPT2BPETokenizer, downloads GPT-2's "
                    f"vocabulary, which needs the wget package and a network); byte-level "
                    f"data made by tools/preprocess_data.py needs none")


def check_tokenizer(args) -> None:
    """What --tokenizer-type reads, and Megatron-LM's HuggingFace rules (FlagError)."""
    if args.tokenizer_type not in _fetched_vocabularies(args):
        check_tokenizer_files(args)
    _check_hf_tokenizer(args)


def _check_hf_tokenizer(args) -> None:
    """Megatron-LM's trainer reads --tokenizer-type HuggingFaceTokenizer with transformers'
    AutoTokenizer: it needs that package and a directory (or a hub name), not a tokenizer.json
    file (each was a traceback on every rank)."""
    model = getattr(args, "tokenizer_model", None)
    if args.tokenizer_type != "HuggingFaceTokenizer" or not model:
        return
    if os.path.isfile(model):
        raise FlagError(f"--tokenizer-model {model}: Megatron-LM's trainer reads a HuggingFace "
                        f"tokenizer with transformers' AutoTokenizer, which takes its "
                        f"directory (with a tokenizer_config.json naming its eos_token), not a "
                        f"file: pass --tokenizer-model {os.path.dirname(model) or '.'}")
    if importlib.util.find_spec("transformers") is None:
        raise FlagError("--tokenizer-type HuggingFaceTokenizer under Megatron-LM's trainer "
                        "needs the transformers package: pip install transformers (pip "
                        "install -e .[hf])")


def _fetched_vocabularies(args) -> tuple:
    """The --tokenizer-type values whose files this Megatron-LM fetches itself where none is
    given: from 0.17 megatron-core's tokenizer builder downloads GPT-2's and BERT's
    vocabularies; core_v0.16's builder (and --legacy-tokenizer later) asserts them bare."""
    try:
        builder = getattr(importlib.import_module("megatron.training.global_vars"),
                          "build_tokenizer", None)
    except ImportError:  # no Megatron-LM trainer (a stand-in): its legacy rules
        return ()
    if getattr(args, "legacy_tokenizer", False) or builder is None or \
            builder.__module__.startswith("megatron.training"):
        return ()
    return ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase")
